// ParallelGrid: where each rank sits in the tp x cp x ep x dp x pp layout, and which ranks share each kind of group.
// Rank order "tp-cp-ep-dp-pp": tp varies fastest (kept inside one NVLink domain), pp slowest, as Megatron's default.
// Two views over the same ranks (research note parallelism.md §1, "MoE parallel folding"):
// - dense (attention, dense MLP, embeddings): rank = tp + t*(cp + c*(dp + d*pp)), with d = world / (t*c*p);
// - expert (MoE layers): rank = tp + t*(ep + e*(edp + d_e*pp)), with d_e = world / (t*e*p),
// so ep reuses the dense view's cp and dp ranks and is not capped by dp. Both views have the same pp groups.
// Pure arithmetic, no communication: the communicators are made from the group lists (comm/). A layout that cannot
// work is refused with one message naming the constraint. Covered by tests/parallel/test_grid.cpp.
#pragma once

#include <string>
#include <vector>

namespace lathe {

struct ParallelSizes {
  int tp = 1, cp = 1, ep = 1, dp = 0, pp = 1;  // dp 0: inferred from the world size
};

enum class GroupKind { Tp, Cp, Dp, DpCp, Pp, Ep, Edp };
const char* group_kind_name(GroupKind k);

class ParallelGrid {
 public:
  // Refuses (lathe::Error) a layout whose sizes do not divide the world, or an ep that does not divide cp*dp.
  ParallelGrid(int world, ParallelSizes sizes);

  int world() const { return world_; }
  const ParallelSizes& sizes() const { return sizes_; }  // dp resolved
  int edp() const { return edp_; }                       // expert data-parallel size

  struct Coords {
    int tp, cp, dp, pp;  // dense view
    int ep, edp;         // expert view (tp and pp as in the dense view)
  };
  Coords coords(int rank) const;
  // The ranks of `rank`'s group of this kind, ordered by their coordinate in it (position i = the group's rank i).
  std::vector<int> group(GroupKind kind, int rank) const;
  // Every group of this kind, each once, in order of its lowest rank: communicators are made in this order on every
  // rank (one split per kind, colour = the group's index here).
  std::vector<std::vector<int>> groups(GroupKind kind) const;
  int group_index(GroupKind kind, int rank) const;  // `rank`'s group's index in groups(kind)

  std::string describe() const;  // "tp=2 cp=1 ep=1 dp=4 pp=1 (world 8)"

 private:
  int world_;
  ParallelSizes sizes_;
  int edp_;
};

}  // namespace lathe
