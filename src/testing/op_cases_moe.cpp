// Op cases of the mixture-of-experts ops. The grouped GEMMs (grouped_matmul, grouped_matmul_weight_grad): an empty group
// first, in the middle and last, groups of one row, all rows in one group, P = 0, one expert, both trans_w values, and
// the weight grad directly (it is differentiable: its backward is two grouped_matmuls). Every forward row also checks
// the backward (dx and dw on each device through op_backward; finite differences in f64 on the CPU).
// Sizes: K and N multiples of 8 (16-byte rows in bf16/f16, 32 in f32) take the CUDA grouped call
// (cuda/cublas_grouped_gemm); odd ones (7, 5) leave the 16-byte alignment it needs and take the per-group cuBLAS
// fallback, so both CUDA kernels run in every dtype; K and N of 256 take cuda/hopper_grouped_gemm in bf16 on sm_90
// (the routed ops' too).
// The CPU has f32/f64 kernels; its bf16/f16 rows run as upcast_f32. Strided weight views (a narrowed fused gate_up_proj) cannot be expressed here (inputs are contiguous):
// tests/ops/test_grouped_matmul.cpp checks them on every device.
#include "testing/op_check.h"

#include <algorithm>
#include <tuple>

namespace lathe {

namespace {

// Offsets 0, c0, c0 + c1, ... of the group sizes `counts`.
std::vector<int64_t> offsets_of(const std::vector<int64_t>& counts) {
  std::vector<int64_t> o = {0};
  for (int64_t n : counts) o.push_back(o.back() + n);
  return o;
}

std::string groups_str(const std::vector<int64_t>& counts) { return fmt::format("{}", fmt::join(counts, "+")); }

// A routing of t tokens to k distinct experts each among the first `used` of e (drawn by a fixed LCG, in no order, as
// top-k leaves them), laid out as moe_route makes it: picked (t E + expert), offsets (E + 2; no bad token) and
// position (each pair's row sorted by expert, then pair), and what moe_ep_messages makes of it over n ranks: back.
struct EpRouting {
  std::vector<double> picked, offsets, position, back;
};

EpRouting ep_routing(int64_t t, int64_t e, int64_t k, int64_t n, int64_t used) {
  EpRouting r;
  std::vector<int64_t> expert;
  uint64_t state = uint64_t(t * 131 + e * 17 + k * 7 + n);
  for (int64_t i = 0; i < t; ++i)
    for (int64_t j = 0; j < k; ++j) {
      int64_t x = 0;
      bool taken = true;
      while (taken) {
        state = state * 6364136223846793005ull + 1442695040888963407ull;
        x = int64_t((state >> 33) % uint64_t(used));
        taken = std::find(expert.end() - j, expert.end(), x) != expert.end();
      }
      expert.push_back(x);
      r.picked.push_back(double(i * e + x));
    }
  std::vector<int64_t> next(size_t(e + 1), 0);
  for (int64_t x : expert) ++next[size_t(x + 1)];
  for (int64_t x = 0; x < e; ++x) next[size_t(x + 1)] += next[size_t(x)];
  for (int64_t x : next) r.offsets.push_back(double(x));
  r.offsets.push_back(-1);
  for (int64_t x : expert) r.position.push_back(double(next[size_t(x)]++));
  r.back.assign(size_t(t * n), -1);
  int64_t u = 0;
  for (int64_t rank = 0; rank < n; ++rank)
    for (int64_t i = 0; i < t; ++i)
      for (int64_t j = 0; j < k; ++j)
        if (expert[size_t(i * k + j)] / (e / n) == rank) {
          r.back[size_t(i * n + rank)] = double(u++);
          break;
        }
  return r;
}

}  // namespace

void add_moe_op_cases(std::vector<OpCase>& c) {
  const std::vector<DType> kFloat = {DType::F64, DType::F32, DType::BF16, DType::F16};
  // Without the f64 row, whose finite differences of a ~20k-element loss sit at the check's 1e-6 bound (rounding of
  // the loss sum); the other rows still compare values and gradients with the f64 reference.
  const std::vector<DType> kLarge = {DType::F32, DType::BF16, DType::F16};
  // grouped_matmul(x (P, K), w): w (E, N, K) when trans_w, (E, K, N) otherwise.
  const auto add_forward = [&](int64_t k, int64_t n, const std::vector<int64_t>& counts, bool trans_w,
                               const std::vector<DType>& dtypes) {
    const std::vector<int64_t> off = offsets_of(counts);
    const int64_t p = off.back(), e = int64_t(counts.size());
    const Shape w = trans_w ? Shape{e, n, k} : Shape{e, k, n};
    c.push_back({OpId::grouped_matmul,
                 fmt::format("p={},e={},k={},n={},groups={},trans_w={}", p, e, k, n, groups_str(counts), int(trans_w)),
                 {{p, k}, w}, GroupedMatmulAttrs{off, trans_w}, dtypes});
  };
  // grouped_matmul_weight_grad(dy (P, N), x (P, K)) -> (E, N, K).
  const auto add_weight_grad = [&](int64_t n, int64_t k, const std::vector<int64_t>& counts,
                                   const std::vector<DType>& dtypes) {
    const std::vector<int64_t> off = offsets_of(counts);
    const int64_t p = off.back();
    c.push_back({OpId::grouped_matmul_weight_grad,
                 fmt::format("p={},e={},n={},k={},groups={}", p, counts.size(), n, k, groups_str(counts)),
                 {{p, n}, {p, k}}, GroupedMatmulAttrs{off, true}, dtypes});
  };
  // Odd sizes (the per-group fallback on CUDA): an empty group in the middle, first, last.
  add_forward(7, 5, {3, 0, 6, 4}, true, kFloat);
  add_forward(6, 5, {0, 5, 4}, false, kFloat);
  add_forward(5, 7, {2, 1, 3, 0}, true, kFloat);
  // 16-byte rows (the grouped call on CUDA): groups of one row, empty groups at both ends.
  add_forward(16, 24, {3, 1, 6, 0}, true, kFloat);
  add_forward(32, 16, {0, 4, 1, 16, 0}, false, kFloat);
  add_forward(24, 40, {0, 7, 0, 1, 1, 9, 0}, true, kFloat);
  // Every row in one expert of six; one expert only; no rows at all (P = 0).
  add_forward(16, 8, {0, 0, 20, 0, 0, 0}, true, kFloat);
  add_forward(8, 16, {11}, false, kFloat);
  add_forward(8, 8, {0, 0, 0}, true, kFloat);
  add_forward(7, 5, {0, 0}, false, kFloat);
  // Larger and uneven, as a MoE layer's rows spread over experts (one empty).
  add_forward(64, 48, {37, 0, 101, 5, 60, 1, 64, 32}, true, kLarge);
  add_forward(48, 64, {37, 0, 101, 5, 60, 1, 64, 32}, false, kLarge);

  add_weight_grad(5, 7, {3, 0, 6, 4}, kFloat);
  add_weight_grad(3, 4, {0, 2, 1}, kFloat);
  add_weight_grad(24, 16, {0, 10, 1, 29, 0}, kFloat);
  add_weight_grad(16, 16, {0, 0, 0, 0}, kFloat);  // P = 0: every block is zero
  add_weight_grad(48, 64, {37, 0, 101, 5, 60, 1, 64, 32}, kLarge);
  // Sizes the Hopper kernel's tiles cover (cuda/hopper_grouped_gemm on sm_90, bf16; K = N = 256 so dx and dw take it
  // too): groups across its 128-row tiles and 64-row stages, an empty one.
  add_forward(256, 256, {300, 0, 37, 129, 1, 64, 65}, true, kLarge);
  add_forward(256, 256, {130, 63, 0, 128}, false, kLarge);
  add_weight_grad(256, 256, {0, 200, 1, 127, 0}, kLarge);
  // Groups of 1024 rows and more run as GEMMs of their own ahead of the grouped call on CUDA.
  add_forward(64, 48, {1100, 0, 37, 1030}, true, kLarge);
  add_forward(48, 64, {1100, 0, 37, 1030}, false, kLarge);
  add_weight_grad(48, 64, {1100, 0, 37, 1030}, kLarge);

  // The routed ops, their groups as moe_route leaves them on the device (its last entry, the non-finite flag, unread).
  // grouped_matmul_routed(x (P, K), w, offsets (E + 2)) with few_rows (a decoding step's): odd K (the element kernel
  // on CUDA), whole packs (the skinny kernel: chunks of 8 rows, a group of 19 takes three, a group of one, empty
  // groups first, inside and last), K too wide for a staged chunk in f32 (1,536 x 8 x 4 bytes: read from global
  // memory), and no rows. Without few_rows (a training step's), !trans_w too, and
  // grouped_matmul_weight_grad_routed(dy (P, N), x (P, K), offsets (E + 2)) -> (E, N, K): on CUDA only the Hopper
  // kernel takes those (the MoE layer reads the groups to the host where none does), so they skip elsewhere.
  const auto routed_offsets = [](const std::vector<int64_t>& counts) {
    std::vector<double> off;
    for (int64_t o : offsets_of(counts)) off.push_back(double(o));
    off.push_back(-1.0);
    return off;
  };
  const auto add_routed = [&](int64_t k, int64_t n, const std::vector<int64_t>& counts, bool trans_w, bool few_rows,
                              const std::vector<DType>& dtypes) {
    const std::vector<double> off = routed_offsets(counts);
    const int64_t p = int64_t(off[off.size() - 2]), e = int64_t(counts.size());
    const Shape w = trans_w ? Shape{e, n, k} : Shape{e, k, n};
    GroupedMatmulAttrs attrs{{}, trans_w};
    attrs.few_rows = few_rows;
    c.push_back({OpId::grouped_matmul_routed,
                 fmt::format("p={},e={},k={},n={},groups={},trans_w={},few_rows={}", p, e, k, n, groups_str(counts),
                             int(trans_w), int(few_rows)),
                 {{p, k}, w, {e + 2}}, attrs, dtypes, false, false, {{}, {}, off}});
  };
  const auto add_routed_grad = [&](int64_t n, int64_t k, const std::vector<int64_t>& counts,
                                   const std::vector<DType>& dtypes) {
    const std::vector<double> off = routed_offsets(counts);
    const int64_t p = int64_t(off[off.size() - 2]), e = int64_t(counts.size());
    c.push_back({OpId::grouped_matmul_weight_grad_routed,
                 fmt::format("p={},e={},n={},k={},groups={}", p, e, n, k, groups_str(counts)),
                 {{p, n}, {p, k}, {e + 2}}, GroupedMatmulAttrs{}, dtypes, false, false, {{}, {}, off}});
  };
  add_routed(7, 5, {3, 0, 6, 4}, true, true, kFloat);
  add_routed(16, 24, {0, 1, 19, 0, 8, 0}, true, true, kFloat);
  add_routed(64, 40, {9, 0, 0, 1, 2, 16, 0}, true, true, kFloat);
  add_routed(1536, 6, {2, 9, 0}, true, true, kLarge);
  add_routed(16, 8, {0, 0, 0}, true, true, kFloat);
  add_routed(7, 5, {3, 0, 6, 4}, true, false, kFloat);
  add_routed(6, 5, {0, 5, 4}, false, false, kFloat);
  add_routed_grad(5, 7, {3, 0, 6, 4}, kFloat);
  add_routed_grad(16, 16, {0, 0, 0, 0}, kFloat);  // P = 0: every block is zero
  // The Hopper kernel's sizes with its schedule built on the device (bf16 on sm_90): groups across its 128-row tiles
  // and 64-row stages, empty ones (zero blocks in the weight grad).
  add_routed(256, 256, {300, 0, 37, 129, 1, 64, 65}, true, false, kLarge);
  add_routed(256, 256, {130, 63, 0, 128}, false, false, kLarge);
  add_routed_grad(256, 256, {0, 200, 1, 127, 0}, kLarge);

  // moe_route(logits (T, E)): f32 and f64 logits (the routing dtypes); the integer outputs (choices, plan) must be
  // exact. Qwen3-30B-A3B's 128 / top-8 and Qwen3-Next's 512 / top-10 (several probabilities per lane), k = E, k = 1 of
  // one expert, an expert count that is no power of two, and an empty batch.
  const std::vector<DType> kRouting = {DType::F64, DType::F32};
  for (const auto& [t, e, k, norm] : {std::tuple<int64_t, int64_t, int64_t, bool>{9, 6, 2, true}, {5, 4, 4, false},
                                      {300, 128, 8, true}, {40, 512, 10, true}, {33, 60, 4, false}, {3, 1, 1, true},
                                      {0, 8, 2, true}})
    c.push_back({OpId::moe_route, fmt::format("t={},e={},k={},norm={}", t, e, k, int(norm)), {{t, e}},
                 MoeRouteAttrs{k, norm}, kRouting, false, false});
  // moe_pad_plan(offsets (E + 2), pair (P)): an empty expert first and in the middle, padding in every expert, spare
  // rows beyond the largest count, k = 1.
  const auto add_pad = [&](const std::vector<double>& offsets, const std::vector<double>& pair, int64_t m, int64_t k) {
    c.push_back({OpId::moe_pad_plan, fmt::format("e={},p={},m={},k={}", offsets.size() - 2, pair.size(), m, k),
                 {{int64_t(offsets.size())}, {int64_t(pair.size())}}, MoePadAttrs{m, k}, {DType::I32}, false, false,
                 {offsets, pair}});
  };
  add_pad({0, 0, 3, 3, 7, 8, -1}, {5, 0, 7, 2, 6, 1, 4, 3}, 4, 2);
  add_pad({0, 0, 0, 5, -1}, {4, 2, 0, 1, 3}, 7, 1);
  // Expert parallelism's exchange plan: two ranks of 4 experts (k 2 and k 8 of 128), four ranks of 3 with a rank no
  // token goes to, k = E (every token to every rank), a rank each of one expert (S = 1). (An empty batch cannot be
  // written here: an empty index list means "not an index input"; the model refuses one before routing.)
  for (const auto& [t, e, k, n, used] : {std::tuple<int64_t, int64_t, int64_t, int64_t, int64_t>{9, 8, 2, 2, 8},
                                         {300, 128, 8, 2, 128}, {40, 12, 3, 4, 9}, {5, 4, 4, 2, 4}, {33, 6, 2, 6, 6}}) {
    const EpRouting r = ep_routing(t, e, k, n, used);
    const std::string params = fmt::format("t={},e={},k={},n={},used={}", t, e, k, n, used);
    c.push_back({OpId::moe_ep_messages, params, {{t, k}, {e + 2}}, MoeExchangeAttrs{n, 0}, {DType::I32}, false, false,
                 {r.picked, r.offsets}});
    std::vector<double> bases;
    for (int64_t i = 0; i < e; ++i) bases.push_back(double(5 * i - 7));
    c.push_back({OpId::moe_ep_slots, params, {{t, k}, {t * k}, {t, n}, {e}}, MoeExchangeAttrs{n, 0}, {DType::I32},
                 false, false, {r.picked, r.position, r.back, bases}});
  }
  // moe_ep_regroup: rank 1 of 3 with 2 experts each (blocks by sending rank, then expert, regrouped by expert, then
  // sending rank), empty blocks first, in the middle and last; one block; no rows.
  const auto add_regroup = [&](int64_t ranks, int64_t mine, const std::vector<int64_t>& counts) {
    std::vector<double> blocks(size_t(2 * ranks * mine + 1), 0);
    int64_t at = 0;
    for (int64_t b = 0; b < ranks * mine; ++b) {
      blocks[size_t(b)] = double(at);
      at += counts[size_t(b)];
    }
    blocks[size_t(ranks * mine)] = double(at);
    int64_t g = 0;
    for (int64_t x = 0; x < mine; ++x)
      for (int64_t j = 0; j < ranks; ++j) {
        blocks[size_t(ranks * mine + 1 + j * mine + x)] = double(g);
        g += counts[size_t(j * mine + x)];
      }
    c.push_back({OpId::moe_ep_regroup, fmt::format("ranks={},mine={},counts={}", ranks, mine, groups_str(counts)),
                 {{int64_t(blocks.size())}}, MoeExchangeAttrs{1, at}, {DType::I32}, false, false, {blocks}});
  };
  add_regroup(3, 2, {0, 4, 3, 0, 7, 2});
  add_regroup(2, 2, {5, 1, 0, 9});
  add_regroup(1, 1, {6});
  add_regroup(2, 1, {0, 0});
  // moe_ep_sources(pairs (U, S)): rows named in a scattered order with empty slots anywhere (a whole token's too), and
  // a table with every slot filled.
  const auto add_sources = [&](int64_t u, int64_t s, int64_t rows, int64_t stride) {
    std::vector<double> pairs(size_t(u * s), -1);
    for (int64_t g = 0; g < rows; ++g) pairs[size_t((g * stride) % (u * s))] = double(g);  // stride coprime to U S
    c.push_back({OpId::moe_ep_sources, fmt::format("u={},s={},rows={}", u, s, rows), {{u, s}},
                 MoeExchangeAttrs{1, rows}, {DType::I32}, false, false, {pairs}});
  };
  add_sources(5, 3, 9, 7);
  add_sources(100, 4, 250, 37);
  add_sources(6, 1, 6, 5);
  // gather_sum(rows (N, D), index (M, S), weights (M, S)): slots left empty (-1) anywhere in a row, a whole row of
  // them, a row read twice in one sum; D of 6 (element by element in every dtype), 256 (16-byte packs) and 2,048 with
  // S = 1 (expert parallelism's weighted gather).
  const auto add_gather_sum = [&](int64_t n, int64_t d, int64_t m, int64_t s, std::vector<double> index) {
    c.push_back({OpId::gather_sum, fmt::format("n={},d={},m={},s={}", n, d, m, s), {{n, d}, {m, s}, {m, s}}, {}, kFloat,
                 false, false, {{}, std::move(index)}});
  };
  add_gather_sum(10, 6, 4, 3, {0, 9, -1, -1, 3, 3, -1, -1, -1, 5, 2, 7});
  std::vector<double> wide;
  for (int64_t i = 0; i < 33 * 4; ++i) wide.push_back(i % 7 == 3 ? -1 : double((i * 13) % 40));
  add_gather_sum(40, 256, 33, 4, wide);
  std::vector<double> single;
  for (int64_t i = 0; i < 24; ++i) single.push_back(double((i * 5) % 24));
  add_gather_sum(24, 2048, 24, 1, single);
}

}  // namespace lathe
