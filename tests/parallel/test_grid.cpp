// src/parallel/grid.h: rank order tp-cp-ep-dp-pp with tp fastest, groups that partition the world, the expert view
// folded over cp x dp, and layouts that cannot work refused with the constraint named.
#include <gtest/gtest.h>

#include <set>

#include "core/error.h"
#include "parallel/grid.h"
#include "support/error_of.h"

using lathe::GroupKind;
using lathe::ParallelGrid;
using lathe::test_support::error_of;

TEST(ParallelGrid, RankOrderIsTpFastestThenCpDpPp) {
  const ParallelGrid g(16, {.tp = 2, .cp = 2, .ep = 1, .dp = 2, .pp = 2});
  for (int r = 0; r < 16; ++r) {
    const ParallelGrid::Coords c = g.coords(r);
    EXPECT_EQ(r, c.tp + 2 * (c.cp + 2 * (c.dp + 2 * c.pp))) << r;
  }
  EXPECT_EQ(g.group(GroupKind::Tp, 5), (std::vector<int>{4, 5}));
  EXPECT_EQ(g.group(GroupKind::Cp, 5), (std::vector<int>{5, 7}));
  EXPECT_EQ(g.group(GroupKind::Dp, 5), (std::vector<int>{1, 5}));
  EXPECT_EQ(g.group(GroupKind::DpCp, 5), (std::vector<int>{1, 3, 5, 7}));
  EXPECT_EQ(g.group(GroupKind::Pp, 5), (std::vector<int>{5, 13}));
}

TEST(ParallelGrid, EveryKindPartitionsTheWorld) {
  const ParallelGrid g(24, {.tp = 2, .cp = 1, .ep = 4, .dp = 0, .pp = 3});  // dp inferred: 4
  EXPECT_EQ(g.sizes().dp, 4);
  EXPECT_EQ(g.edp(), 1);
  for (GroupKind k : {GroupKind::Tp, GroupKind::Cp, GroupKind::Dp, GroupKind::DpCp, GroupKind::Pp, GroupKind::Ep,
                      GroupKind::Edp}) {
    std::multiset<int> seen;
    for (const auto& grp : g.groups(k)) {
      for (int r : grp) seen.insert(r);
      for (size_t i = 0; i < grp.size(); ++i) EXPECT_EQ(g.group(k, grp[i]), grp) << lathe::group_kind_name(k);
    }
    EXPECT_EQ(seen.size(), 24u) << lathe::group_kind_name(k);
    for (int r = 0; r < 24; ++r) EXPECT_EQ(seen.count(r), 1u) << lathe::group_kind_name(k) << " rank " << r;
  }
}

TEST(ParallelGrid, ExpertsFoldOverTheDataParallelRanks) {
  const ParallelGrid g(4, {.tp = 1, .cp = 1, .ep = 2, .dp = 4, .pp = 1});
  EXPECT_EQ(g.edp(), 2);
  EXPECT_EQ(g.group(GroupKind::Ep, 0), (std::vector<int>{0, 1}));
  EXPECT_EQ(g.group(GroupKind::Ep, 3), (std::vector<int>{2, 3}));
  EXPECT_EQ(g.group(GroupKind::Edp, 1), (std::vector<int>{1, 3}));
  EXPECT_EQ(g.group(GroupKind::Dp, 2), (std::vector<int>{0, 1, 2, 3}));  // ep is not capped by dp: it reuses dp's ranks
}

TEST(ParallelGrid, ImpossibleLayoutsNameTheConstraint) {
  EXPECT_NE(error_of([] { ParallelGrid(6, {.tp = 4}); }).find("tp x cp x pp = 4 x 1 x 1 = 4 does not divide the 6 ranks"),
            std::string::npos);
  EXPECT_NE(error_of([] { ParallelGrid(8, {.tp = 2, .dp = 2}); }).find("= 4, but the job has 8 ranks"), std::string::npos);
  EXPECT_NE(error_of([] { ParallelGrid(6, {.ep = 4}); }).find("ep = 4 must divide cp x dp = 6"), std::string::npos);
  EXPECT_NE(error_of([] { ParallelGrid(4, {.tp = 0}); }).find("must be at least 1"), std::string::npos);
}
