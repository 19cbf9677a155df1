#include "parallel/grid.h"

#include <fmt/format.h>

#include <algorithm>
#include <map>

#include "core/error.h"

namespace lathe {

const char* group_kind_name(GroupKind k) {
  switch (k) {
    case GroupKind::Tp: return "tp";
    case GroupKind::Cp: return "cp";
    case GroupKind::Dp: return "dp";
    case GroupKind::DpCp: return "dp_cp";
    case GroupKind::Pp: return "pp";
    case GroupKind::Ep: return "ep";
    case GroupKind::Edp: return "edp";
  }
  return "?";
}

ParallelGrid::ParallelGrid(int world, ParallelSizes s) : world_(world), sizes_(s) {
  LATHE_CHECK(world >= 1, "parallel: the world size must be at least 1 (got {})", world);
  LATHE_CHECK(s.tp >= 1 && s.cp >= 1 && s.ep >= 1 && s.pp >= 1 && s.dp >= 0,
              "parallel: tp, cp, ep and pp must be at least 1 and dp at least 0 (got tp={} cp={} ep={} dp={} pp={})", s.tp,
              s.cp, s.ep, s.dp, s.pp);
  const int model = s.tp * s.cp * s.pp;
  if (s.dp == 0) {
    LATHE_CHECK(world % model == 0, "parallel: tp x cp x pp = {} x {} x {} = {} does not divide the {} ranks, so dp "
                "cannot be inferred", s.tp, s.cp, s.pp, model, world);
    sizes_.dp = world / model;
  }
  LATHE_CHECK(model * sizes_.dp == world, "parallel: tp x cp x dp x pp = {} x {} x {} x {} = {}, but the job has {} ranks",
              s.tp, s.cp, sizes_.dp, s.pp, model * sizes_.dp, world);
  LATHE_CHECK((s.cp * sizes_.dp) % s.ep == 0, "parallel: ep = {} must divide cp x dp = {} (experts are spread over the "
              "ranks of one tp slice and pp stage)", s.ep, s.cp * sizes_.dp);
  edp_ = s.cp * sizes_.dp / s.ep;
}

ParallelGrid::Coords ParallelGrid::coords(int rank) const {
  LATHE_CHECK(rank >= 0 && rank < world_, "parallel: rank {} is not in a world of {}", rank, world_);
  const ParallelSizes& s = sizes_;
  Coords c{};
  int r = rank;
  c.tp = r % s.tp, r /= s.tp;
  c.cp = r % s.cp, r /= s.cp;
  c.dp = r % s.dp, r /= s.dp;
  c.pp = r;
  const int mid = rank / s.tp % (s.cp * s.dp);  // the (cp, dp) position, re-read as (ep, edp)
  c.ep = mid % s.ep;
  c.edp = mid / s.ep;
  return c;
}

namespace {

// The key that is equal for exactly the ranks of one group of `kind`, and the rank's position inside it.
std::pair<std::vector<int>, int> key_of(const ParallelGrid& g, GroupKind kind, int rank) {
  const ParallelGrid::Coords c = g.coords(rank);
  const ParallelSizes& s = g.sizes();
  switch (kind) {
    case GroupKind::Tp: return {{c.cp, c.dp, c.pp}, c.tp};
    case GroupKind::Cp: return {{c.tp, c.dp, c.pp}, c.cp};
    case GroupKind::Dp: return {{c.tp, c.cp, c.pp}, c.dp};
    case GroupKind::DpCp: return {{c.tp, c.pp}, c.cp + s.cp * c.dp};
    case GroupKind::Pp: return {{c.tp, c.cp, c.dp}, c.pp};
    case GroupKind::Ep: return {{c.tp, c.edp, c.pp}, c.ep};
    case GroupKind::Edp: return {{c.tp, c.ep, c.pp}, c.edp};
  }
  return {{}, 0};
}

}  // namespace

std::vector<std::vector<int>> ParallelGrid::groups(GroupKind kind) const {
  std::map<std::vector<int>, std::vector<std::pair<int, int>>> by_key;  // key -> (position, rank)
  std::vector<std::vector<int>> order;                                  // keys by lowest rank
  for (int r = 0; r < world_; ++r) {
    auto [key, pos] = key_of(*this, kind, r);
    auto& members = by_key[key];
    if (members.empty()) order.push_back(key);
    members.push_back({pos, r});
  }
  std::vector<std::vector<int>> out;
  for (const std::vector<int>& key : order) {
    auto members = by_key[key];
    std::sort(members.begin(), members.end());
    std::vector<int> ranks;
    for (const auto& [pos, r] : members) ranks.push_back(r);
    out.push_back(std::move(ranks));
  }
  return out;
}

std::vector<int> ParallelGrid::group(GroupKind kind, int rank) const { return groups(kind)[size_t(group_index(kind, rank))]; }

int ParallelGrid::group_index(GroupKind kind, int rank) const {
  const std::vector<std::vector<int>> all = groups(kind);
  for (size_t i = 0; i < all.size(); ++i)
    if (std::find(all[i].begin(), all[i].end(), rank) != all[i].end()) return int(i);
  LATHE_FAIL("parallel: rank {} is in no {} group", rank, group_kind_name(kind));
}

std::string ParallelGrid::describe() const {
  return fmt::format("tp={} cp={} ep={} dp={} pp={} (world {})", sizes_.tp, sizes_.cp, sizes_.ep, sizes_.dp, sizes_.pp,
                     world_);
}

}  // namespace lathe
