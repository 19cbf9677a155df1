#include "parallel/process_groups.h"

#include <fmt/format.h>

namespace lathe {

std::unique_ptr<ProcessGroups> make_process_groups(std::unique_ptr<Communicator> world, const ParallelSizes& sizes,
                                                   std::unique_ptr<Stream> grad_stream) {
  const int n = world ? world->size() : 1;
  auto g = std::make_unique<ProcessGroups>(
      ProcessGroups{ParallelGrid(n, sizes), world ? world->rank() : 0, {}, {}, {}, {}, {}, {}, {}, {}, {}, {}, {}, {},
                    {}});
  if (!world) return g;
  const int index = g->grid.group_index(GroupKind::Dp, g->rank);
  g->dp = world->split(index, g->rank, fmt::format("dp[{}]", index), nullptr);
  g->grad_stream = std::move(grad_stream);
  g->dp_grads = g->dp->split(0, g->dp->rank(), fmt::format("dp[{}].grads", index), g->grad_stream.get());
  if (sizes.tp > 1) {
    const int t = g->grid.group_index(GroupKind::Tp, g->rank);
    g->tp = world->split(t, g->rank, fmt::format("tp[{}]", t), nullptr);
  }
  if (sizes.cp > 1) {
    const int c = g->grid.group_index(GroupKind::Cp, g->rank);
    g->cp = world->split(c, g->rank, fmt::format("cp[{}]", c), nullptr);
    const int r = g->grid.group_index(GroupKind::DpCp, g->rank);
    g->dp_cp = world->split(r, g->rank, fmt::format("dp_cp[{}]", r), nullptr);
    g->dp_cp_grads = g->dp_cp->split(0, g->dp_cp->rank(), fmt::format("dp_cp[{}].grads", r), g->grad_stream.get());
  }
  if (sizes.ep > 1) {
    const int e = g->grid.group_index(GroupKind::Ep, g->rank), d = g->grid.group_index(GroupKind::Edp, g->rank);
    g->ep = world->split(e, g->rank, fmt::format("ep[{}]", e), nullptr);
    g->edp = world->split(d, g->rank, fmt::format("edp[{}]", d), nullptr);
    g->edp_grads = g->edp->split(0, g->edp->rank(), fmt::format("edp[{}].grads", d), g->grad_stream.get());
  }
  if (sizes.pp > 1) {
    const int p = g->grid.group_index(GroupKind::Pp, g->rank);
    g->pp = world->split(p, g->rank, fmt::format("pp[{}]", p), nullptr);
  }
  if (sizes.tp * sizes.ep * sizes.pp > 1) {  // the ranks of one replica's slices: one (cp, dp) place, or one edp index
    const ParallelGrid::Coords c = g->grid.coords(g->rank);
    const int r = sizes.ep > 1 ? c.edp : c.cp + g->grid.sizes().cp * c.dp;
    g->slices = world->split(r, g->rank, fmt::format("slices[{}]", r), nullptr);
  }
  g->world = std::move(world);
  return g;
}

}  // namespace lathe
