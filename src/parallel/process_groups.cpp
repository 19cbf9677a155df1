#include "parallel/process_groups.h"

#include <fmt/format.h>


namespace lathe {

std::unique_ptr<ProcessGroups> make_process_groups(std::unique_ptr<Communicator> world, const ParallelSizes& sizes) {
  const int n = world ? world->size() : 1;
  auto g = std::unique_ptr<ProcessGroups>(new ProcessGroups{ParallelGrid(n, sizes), world ? world->rank() : 0, nullptr, nullptr});
  if (!world) return g;
  const int index = g->grid.group_index(GroupKind::Dp, g->rank);
  g->dp = world->split(index, g->rank, fmt::format("dp[{}]", index));
  g->world = std::move(world);
  return g;
}

}  // namespace lathe
