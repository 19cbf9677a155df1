// Op cases of the rollout engine's ops: row_argmax_logsumexp, sample_rows and penalize_rows (odd widths, a limit below the width, rows
// the CUDA kernels cut into chunks; draws that share a row), paged_attention
// (decoding steps of several sequences over scattered blocks, chunks of new tokens after a past, a first chunk, GQA
// groups 1 to 4 and 8, head dims 8 to 256 (every row width of the CUDA kernels' 16-byte loads), block sizes 4, 8 and 16,
// long contexts that the CUDA kernels split, a chunk long enough for the pipelined kernel's ring to wrap; unused
// table entries point at block 0) and scatter_rows (rows of 12 floats, 6 bf16 values: every element width of
// the CUDA copy). Forward only. The CPU kernel itself is checked against the training attention op in
// tests/ops/test_fused_ops.cpp.
#include "testing/op_check.h"

namespace lathe {

void add_paged_op_cases(std::vector<OpCase>& c) {
  const std::vector<DType> dtypes = {DType::F64, DType::F32, DType::BF16, DType::F16};
  // q (T, Hq, D), caches (S, Hkv, D), table (B, M), cu_q (B + 1), context_lens (B).
  const auto add = [&](const char* what, int64_t hq, int64_t hkv, int64_t d, int64_t bs, int64_t blocks,
                       std::vector<double> table, std::vector<double> cu, std::vector<double> ctx) {
    const int64_t b = int64_t(ctx.size()), m = int64_t(table.size()) / b, t = int64_t(cu.back());
    const int64_t s = blocks * bs;
    c.push_back({OpId::paged_attention, fmt::format("{},hq={},hkv={},d={},bs={}", what, hq, hkv, d, bs),
                 {{t, hq, d}, {s, hkv, d}, {s, hkv, d}, {b, m}, {b + 1}, {b}}, PagedAttentionAttrs{0.0, bs}, dtypes,
                 false, false, {{}, {}, {}, table, cu, ctx}});
  };
  add("decode=1+1+1,ctx=5+9+1", 4, 2, 8, 4, 10, {7, 2, 0, 1, 9, 4, 3, 0, 0}, {0, 1, 2, 3}, {5, 9, 1});
  add("chunks=3+5,ctx=7+5", 6, 2, 16, 4, 6, {5, 1, 2, 4}, {0, 3, 8}, {7, 5});
  add("decode+chunk,ctx=20+3", 2, 1, 128, 16, 4, {3, 0, 2, 0}, {0, 1, 3}, {20, 3});
  add("mha,decode=1+1,ctx=33+2", 3, 3, 64, 16, 5, {4, 1, 0, 2, 0, 0}, {0, 1, 2}, {33, 2});
  // Long contexts of few queries: the CUDA kernel splits them (and merges the splits); groups of 8 and 4 heads.
  add("decode=1+1,group=8,ctx=200+77", 16, 2, 128, 16, 20,
      {19, 3, 7, 0, 12, 5, 16, 1, 9, 14, 2, 11, 6, 4, 8, 10, 13, 15, 0, 0, 0, 0, 0, 0, 0, 0}, {0, 1, 2}, {200, 77});
  add("chunk=3,group=4,d=256,ctx=150", 8, 2, 256, 16, 12, {11, 0, 5, 3, 9, 1, 7, 2, 10, 4}, {0, 3}, {150});
  // Head dim 32: 16-byte rows of 8 lanes in f32 on CUDA (4 positions a warp at once), and a query chunk over 70.
  add("decode+chunk=2,group=4,d=32,ctx=70+13", 4, 1, 32, 4, 24,
      {17, 3, 22, 8, 0, 11, 19, 5, 14, 1, 20, 9, 6, 15, 2, 12, 23, 7, 4, 10, 13, 16, 18, 21, 0, 0, 0, 0, 0, 0, 0, 0, 0,
       0, 0, 0},
      {0, 1, 3}, {70, 13});
  // The CUDA pipelined kernel (pages of a power of two positions, 128- to 512-byte rows): chunks of 4 positions in
  // pages of 8, contexts ending inside a chunk, splits of a rounded length; then 140 queries of one chunk (the grid
  // is then large enough not to split) over 300 positions, so that each slot's ring of stages wraps several times.
  // `scattered`: sequence b's page p at (37 (b M + p)) mod blocks.
  const auto scattered = [](int64_t b, int64_t m, int64_t blocks) {
    std::vector<double> t;
    for (int64_t k = 0; k < b * m; ++k) t.push_back(double(37 * k % blocks));
    return t;
  };
  add("decode=1+1+1,group=2,d=64,ctx=203+61+1", 4, 2, 64, 8, 78, scattered(3, 26, 78), {0, 1, 2, 3}, {203, 61, 1});
  add("chunk=140,group=2,d=128,ctx=300", 4, 2, 128, 16, 19, scattered(1, 19, 19), {0, 140}, {300});
  c.push_back({OpId::row_argmax_logsumexp, "n=5,v=37", {{5, 37}}, ArgmaxAttrs{}, dtypes, false, false});
  c.push_back({OpId::row_argmax_logsumexp, "n=5,v=37,limit=20", {{5, 37}}, ArgmaxAttrs{20}, dtypes, false, false});
  c.push_back({OpId::row_argmax_logsumexp, "n=3,v=3001", {{3, 3001}}, ArgmaxAttrs{}, dtypes, false, false});
  // Rows the CUDA kernel cuts into chunks, with the limit inside a chunk.
  c.push_back({OpId::row_argmax_logsumexp, "n=2,v=20001,limit=15000", {{2, 20001}}, ArgmaxAttrs{15000}, dtypes, false,
               false});
  // sample_rows: draws sharing a row with different keys and counters, a limit inside a chunk of the CUDA kernel; each
  // draw's (temperature, min-p, top-k, top-p): min-p alone, top-k, top-p, all three, top-k beyond the row.
  const auto sample = [&](const char* what, int64_t n, int64_t v, int64_t limit, std::vector<double> rows,
                          std::vector<double> keys, std::vector<double> params) {
    OpCase oc{OpId::sample_rows, what, {{n, v}, {int64_t(rows.size())}, {int64_t(rows.size()), 4},
              {int64_t(rows.size()), 3}}, ArgmaxAttrs{limit}, dtypes, false, false, {{}, rows, {}, keys}};
    oc.fixed_values = {{}, {}, params, {}};
    oc.accumulation_inputs = {2};
    c.push_back(std::move(oc));
  };
  sample("n=3,v=37,draws=5", 3, 37, 0, {0, 2, 2, 1, 0}, {7, 0, 0, 7, 0, 1, 9, 3, 0, -5, 12, 4, 7, 0, 0},
         {0.75, 0.3125, 0, 1, 0.5, 0, 5, 1, 0.875, 0, 0, 0.625, 0.375, 0.0625, 8, 0.8125, 0.8125, 0, 40, 1});
  sample("n=2,v=20001,limit=15000,draws=3", 2, 20001, 15000, {1, 0, 1}, {11, 22, 5, 11, 22, 6, -1, -1, 0},
         {0.625, 0.5, 0, 1, 0.3125, 0, 300, 0.875, 0.875, 0, 0, 0.5});
  // penalize_rows: four draws from three rows (two share one), (repetition, frequency) each, entries that penalise
  // and count generations, and one of a draw whose penalties are off (no change). Bans (-inf, which the harness reads
  // as unwritten) are checked by PenalizeRows in tests/ops/test_fused_ops.cpp, on CUDA too.
  OpCase pen{OpId::penalize_rows, "n=3,v=37,draws=4", {{3, 37}, {4}, {4, 2}, {6, 3}}, {}, dtypes, false, false,
             {{}, {0, 2, 2, 1}, {}, {0, 3, 0, 0, 5, 2, 1, 0, 1, 2, 7, 0, 3, 4, 3, 3, 36, 0}}};
  pen.fixed_values = {{}, {}, {1.5, 0.5, 1, 0, 0.75, 1.25, 2, -0.5}, {}};
  pen.accumulation_inputs = {2};
  c.push_back(std::move(pen));
  c.push_back({OpId::scatter_rows, "rows=5,into=10,row=3x4", {{5, 3, 4}, {5}, {10, 3, 4}}, {}, dtypes, false, false,
               {{}, {7, 0, 3, 9, 2}, {}}});
  c.push_back({OpId::scatter_rows, "rows=3,into=4,row=6", {{3, 6}, {3}, {4, 6}}, {}, dtypes, false, false,
               {{}, {1, 0, 2}, {}}});
}

}  // namespace lathe
