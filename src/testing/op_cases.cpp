// The op cases: shapes chosen to hit edge sizes (1, odd, not multiples of tile sizes), broadcasting,
// transposes, batching and strided inputs, and both paths of the CUDA kernels that move 16-byte packs (sizes
// that are multiples of the pack, with a tail, and rows of single elements). A new kernel must be reachable from
// at least one case (the coverage check in op_check.cpp fails otherwise). Run by tests/ops on every device.
#include "testing/op_check.h"

#include <tuple>

namespace lathe {

namespace {
const std::vector<DType> kFloat = {DType::F64, DType::F32, DType::BF16, DType::F16};
const std::vector<DType> kAll(std::begin(kAllDTypes), std::end(kAllDTypes));

std::string mm_params(int64_t b, int64_t m, int64_t n, int64_t k, const MatmulAttrs& a) {
  return fmt::format("b={},m={},n={},k={},ta={},tb={},alpha={},beta={}", b, m, n, k, int(a.trans_a), int(a.trans_b),
                     a.alpha, a.beta);
}

void add_matmul(std::vector<OpCase>& out, int64_t b, int64_t m, int64_t n, int64_t k, MatmulAttrs a, bool b_shared) {
  Shape sa = a.trans_a ? Shape{k, m} : Shape{m, k};
  Shape sb = a.trans_b ? Shape{n, k} : Shape{k, n};
  if (b > 0) {
    sa.insert(sa.begin(), b);
    if (!b_shared) sb.insert(sb.begin(), b);
  }
  out.push_back({OpId::matmul, mm_params(b, m, n, k, a) + (b_shared ? ",shared_b" : ""), {sa, sb}, a, kFloat});
}
std::vector<double> iota_mod(int64_t n, int64_t mod, int64_t mul) {
  std::vector<double> v(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) v[size_t(i)] = double((i * mul + 3) % mod);
  return v;
}

// Positions restarting at every document boundary of `cu`.
std::vector<double> positions(const std::vector<double>& cu) {
  std::vector<double> p;
  for (size_t b = 0; b + 1 < cu.size(); ++b)
    for (double i = 0; i < cu[b + 1] - cu[b]; ++i) p.push_back(i);
  return p;
}

void add_model_op_cases(std::vector<OpCase>& c) {
  // embedding: repeated ids exercise the scatter-add of the backward.
  c.push_back({OpId::embedding, "v=11,h=6,t=9", {{11, 6}, {9}}, {}, kFloat, false, true, {{}, iota_mod(9, 11, 4)}});
  c.push_back({OpId::embedding, "v=1000,h=64,t=300", {{1000, 64}, {300}}, {}, kFloat, false, true,
               {{}, iota_mod(300, 1000, 37)}});
  // The CUDA gather copies 16-byte packs when hidden is a multiple of 16 bytes (2048, 256), elements otherwise (258).
  c.push_back({OpId::embedding, "v=20,h=2048,t=12", {{20, 2048}, {12}}, {}, kFloat, false, true, {{}, iota_mod(12, 20, 7)}});
  c.push_back({OpId::embedding, "v=30,h=256,t=33", {{30, 256}, {33}}, {}, kFloat, false, true, {{}, iota_mod(33, 30, 11)}});
  c.push_back({OpId::embedding, "v=30,h=258,t=20", {{30, 258}, {20}}, {}, kFloat, false, true, {{}, iota_mod(20, 30, 13)}});
  // A vocab-parallel slice (ids [40, 52) of a vocabulary of 64): the other ids give zero rows and no gradient.
  c.push_back({OpId::embedding, "v=12,h=64,t=30,first=40", {{12, 64}, {30}}, EmbeddingAttrs{0, false, 40}, kFloat, false,
               true, {{}, iota_mod(30, 64, 7)}});
  c.push_back({OpId::rmsnorm, "h=32,eps=1e-6", {{5, 32}, {32}}, NormAttrs{1e-6, 0.0}, kFloat});
  c.push_back({OpId::rmsnorm, "h=96,offset=1", {{3, 4, 96}, {96}}, NormAttrs{1e-5, 1.0}, kFloat});
  c.push_back({OpId::rmsnorm_backward, "h=40", {{6, 40}, {40}, {6, 40}}, NormAttrs{1e-6, 0.0}, kFloat, false, false});
  // residual_rmsnorm: the CUDA lane groups of 16 lanes (h = 128 in bf16), one warp with a second pass (1030, element
  // packs) and two warps (2048 in bf16); offset 1 (Qwen3.5's norms). Finite differences (the f64 row) on the
  // smallest only.
  const std::vector<DType> kNoF64 = {DType::F32, DType::BF16, DType::F16};
  for (const auto& [rows, h, offset] : {std::tuple<int64_t, int64_t, double>{5, 32, 0.0}, {300, 128, 0.0},
                                        {7, 1030, 1.0}, {40, 2048, 0.0}}) {
    const std::string params = fmt::format("rows={},h={},offset={}", rows, h, offset);
    c.push_back({OpId::residual_rmsnorm, params, {{rows, h}, {rows, h}, {h}}, NormAttrs{1e-6, offset},
                 h == 32 ? kFloat : kNoF64});
    c.push_back({OpId::residual_rmsnorm_backward, params, {{rows, h}, {h}, {rows, h}, {rows, h}},
                 NormAttrs{1e-6, offset}, kFloat, false, false});
  }
  c.push_back({OpId::gated_rmsnorm, "h=32", {{5, 32}, {32}, {5, 32}}, NormAttrs{1e-6, 0.0}, kFloat});
  c.push_back({OpId::gated_rmsnorm, "h=96,offset=1", {{3, 4, 96}, {96}, {3, 4, 96}}, NormAttrs{1e-5, 1.0}, kFloat});
  c.push_back({OpId::gated_rmsnorm_backward, "h=40", {{6, 40}, {40}, {6, 40}, {6, 40}}, NormAttrs{1e-6, 0.0}, kFloat,
               false, false});
  const std::vector<double> cu7 = {0, 3, 7};
  c.push_back({OpId::rope, "t=7,h=3,d=8,theta=1e4", {{7, 3, 8}, {7}}, RopeAttrs{10000.0, 0, false}, kFloat, false, true,
               {{}, positions(cu7)}});
  c.push_back({OpId::rope, "t=7,h=2,d=12,partial=4,theta=1e6", {{7, 2, 12}, {7}}, RopeAttrs{1e6, 4, false}, kFloat, false,
               true, {{}, positions(cu7)}});
  c.push_back({OpId::rope, "t=5,h=2,d=64,far", {{5, 2, 64}, {5}}, RopeAttrs{1e6, 0, false}, kFloat, false, true,
               {{}, {0, 100, 1000, 4095, 32000}}});
  // qk_norm_rope (+ backward): a small case (finite differences in f64; the composite on CUDA: D = 16 is no lane
  // count of the fused kernel), then the CUDA kernel's lane groups (D / pack = 8, 16 or 32 lanes: D = 64 and 128 in
  // bf16/f16 and f32, 256 in bf16/f16), far positions, and more tokens than the backward's partial dw rows.
  for (const auto& [t, hq, hkv, d] : {std::tuple<int64_t, int64_t, int64_t, int64_t>{7, 4, 2, 16}, {37, 4, 2, 128},
                                      {300, 8, 2, 64}, {20, 2, 1, 256}, {5000, 2, 1, 64}}) {
    const std::string params = fmt::format("t={},hq={},hkv={},d={}", t, hq, hkv, d);
    const QkNormRopeAttrs attrs{hq, hkv, NormAttrs{1e-6, 0.0}, RopeAttrs{1e6, 0, false}};
    std::vector<double> pos = positions({0, double(t / 3), double(t)});
    if (t == 20) pos = iota_mod(20, 40000, 2039);  // positions up to 40,000: large angles
    const Shape qs{t, hq, d}, ks{t, hkv, d};
    c.push_back({OpId::qk_norm_rope, params, {{t, (hq + 2 * hkv) * d}, {d}, {d}, {t}}, attrs, kFloat, false, t < 1000,
                 {{}, {}, {}, pos}});
    c.push_back({OpId::qk_norm_rope_backward, params, {{t, (hq + 2 * hkv) * d}, {d}, {d}, {t}, qs, ks, ks}, attrs,
                 kFloat, false, false, {{}, {}, {}, pos}});
  }
  c.push_back({OpId::swiglu, "[6,10]", {{6, 10}, {6, 10}}, {}, kFloat});
  c.push_back({OpId::swiglu_backward, "[4,9]", {{4, 9}, {4, 9}, {4, 9}}, {}, kFloat, false, false});
  // swiglu_halves: odd halves (the CUDA element path), halves of whole 16-byte packs, a 3-D input.
  for (const Shape& gu : {Shape{6, 18}, Shape{33, 2 * 1024}, Shape{2, 5, 2 * 24}}) {
    Shape y = gu;
    y.back() /= 2;
    c.push_back({OpId::swiglu_halves, shape_str(gu), {gu}, {}, kFloat});
    c.push_back({OpId::swiglu_halves_backward, shape_str(gu), {gu, y}, {}, kFloat, false, false});
  }
  // CUDA: 16-byte packs only (1024) and packs plus a tail (2145).
  for (Shape s : {Shape{16, 64}, Shape{33, 65}}) {
    c.push_back({OpId::swiglu, shape_str(s), {s, s}, {}, kFloat});
    c.push_back({OpId::swiglu_backward, shape_str(s), {s, s, s}, {}, kFloat, false, false});
  }
  const std::vector<double> cu12 = {0, 5, 12}, cu40 = {0, 1, 17, 40}, cu1 = {0, 9};
  c.push_back({OpId::attention, "t=12,hq=4,hkv=2,d=8,docs=5+7", {{12, 4, 8}, {12, 2, 8}, {12, 2, 8}, {3}},
               AttentionAttrs{}, kFloat, false, true, {{}, {}, {}, cu12}});
  c.push_back({OpId::attention, "t=9,hq=3,hkv=1,d=16,mqa,one_doc", {{9, 3, 16}, {9, 1, 16}, {9, 1, 16}, {2}},
               AttentionAttrs{}, kFloat, false, true, {{}, {}, {}, cu1}});
  c.push_back({OpId::attention, "t=40,hq=2,hkv=2,d=64,docs=1+16+23", {{40, 2, 64}, {40, 2, 64}, {40, 2, 64}, {4}},
               AttentionAttrs{0.1}, kFloat, false, true, {{}, {}, {}, cu40}});
  const std::vector<double> cu20 = {0, 8, 20};
  for (int64_t d : {96, 128, 256})
    c.push_back({OpId::attention, fmt::format("t=20,hq=2,hkv=1,d={},docs=8+12", d), {{20, 2, d}, {20, 1, d}, {20, 1, d}, {3}},
                 AttentionAttrs{}, kFloat, false, true, {{}, {}, {}, cu20}});
  c.push_back({OpId::attention, "t=20,hq=8,hkv=1,d=32,group=8", {{20, 8, 32}, {20, 1, 32}, {20, 1, 32}, {3}},
               AttentionAttrs{}, kFloat, false, true, {{}, {}, {}, cu20}});
  // Sizes for the tiled CUDA kernels (cuda/flash_attention*: bf16/f16, D = 64/128/256; tiles of 32 to 128
  // tokens): documents longer than several tiles, lengths that are no multiple of a tile, documents of one
  // token, GQA groups 1, 2 and 8. No f64 row: the f64 finite-difference check is done by the small cases
  // above and would take minutes here; every row still compares with the f64 reference.
  const std::vector<DType> kTiled = {DType::F32, DType::BF16, DType::F16};
  const auto add_tiled = [&](int64_t t, int64_t hq, int64_t hkv, int64_t d, const std::vector<double>& cu,
                             AttentionAttrs attrs, const char* what) {
    c.push_back({OpId::attention, fmt::format("t={},hq={},hkv={},d={},{}", t, hq, hkv, d, what),
                 {{t, hq, d}, {t, hkv, d}, {t, hkv, d}, {int64_t(cu.size())}}, attrs, kTiled, false, true,
                 {{}, {}, {}, cu}});
  };
  add_tiled(300, 4, 2, 64, {0, 1, 131, 300}, {}, "docs=1+130+169");
  add_tiled(90, 8, 1, 64, {0, 17, 90}, {}, "group=8,docs=17+73");
  add_tiled(200, 2, 2, 128, {0, 70, 71, 200}, {}, "docs=70+1+129");
  add_tiled(150, 8, 1, 128, {0, 150}, {}, "group=8,one_doc");
  add_tiled(260, 4, 2, 128, {0, 1, 2, 259, 260}, AttentionAttrs{0.05}, "scale=0.05,docs=1+1+257+1");
  add_tiled(100, 4, 2, 256, {0, 33, 34, 100}, {}, "docs=33+1+66");
  add_tiled(70, 8, 1, 256, {0, 70}, {}, "group=8,one_doc");
  // Equal documents; D = 256 without GQA; an empty document (cuda/cudnn_sdpa* refuse it: the tiled kernels' case).
  add_tiled(256, 4, 2, 128, {0, 64, 128, 192, 256}, {}, "docs=4x64");
  add_tiled(384, 8, 2, 64, {0, 128, 256, 384}, AttentionAttrs{0.2}, "scale=0.2,docs=3x128");
  add_tiled(96, 2, 2, 256, {0, 40, 96}, {}, "mha,docs=40+56");
  add_tiled(130, 4, 2, 64, {0, 60, 60, 130}, {}, "docs=60+0+70");
  // Documents of one length: cuDNN's dense graphs (cuda/cudnn_sdpa*; lengths and a padding mask where the length is
  // no multiple of 128), its only right backward at D = 256 with the padded ones (the D = 256 one_doc row above too).
  add_tiled(256, 4, 2, 128, {0, 128, 256}, {}, "docs=2x128");
  add_tiled(256, 4, 2, 256, {0, 128, 256}, {}, "docs=2x128");
  add_tiled(256, 8, 1, 256, {0, 256}, {}, "group=8,one_doc");
  add_tiled(300, 4, 2, 256, {0, 100, 200, 300}, {}, "docs=3x100");
  // D = 256, documents of unequal lengths: the backward on a padded copy (docs=33+1+66 and the others above), or on the
  // tiled kernel where padding would more than double the rows (3 x 98 of 100 here).
  add_tiled(100, 4, 2, 256, {0, 1, 2, 100}, {}, "docs=1+1+98");
  // Backwards that may sum dQ in any order (cuda/cudnn_sdpa_backward_nondeterministic: ragged at D <= 128, dense or
  // padded at D = 256).
  add_tiled(300, 4, 2, 64, {0, 1, 131, 300}, AttentionAttrs{0.0, false}, "nondeterministic,docs=1+130+169");
  add_tiled(260, 8, 2, 128, {0, 100, 260}, AttentionAttrs{0.0, false}, "nondeterministic,docs=100+160");
  add_tiled(100, 4, 2, 256, {0, 33, 34, 100}, AttentionAttrs{0.0, false}, "nondeterministic,docs=33+1+66");
  add_tiled(256, 4, 1, 256, {0, 128, 256}, AttentionAttrs{0.0, false}, "nondeterministic,docs=2x128");
  add_tiled(170, 4, 2, 256, {0, 170}, AttentionAttrs{0.0, false}, "nondeterministic,one_doc");
  // A head dim neither cuDNN (multiples of 8) nor the tiled kernels take: the warp-per-row kernels' bf16/f16 case.
  c.push_back({OpId::attention, "t=13,hq=2,hkv=1,d=20,docs=6+7", {{13, 2, 20}, {13, 1, 20}, {13, 1, 20}, {3}},
               AttentionAttrs{}, kFloat, false, true, {{}, {}, {}, {0, 6, 13}}});
  c.push_back({OpId::rmsnorm, "h=1024", {{3, 1024}, {1024}}, NormAttrs{1e-6, 0.0}, kFloat});
  // CUDA RMSNorm (a group of 8 to 128 lanes per row): 16-byte packs when h is a multiple of 8 (bf16/f16) or 4 (f32),
  // elements otherwise (42, 1030); 16 lanes (128 in bf16), two or four warps (2304, 1030); rows of more packs than
  // the group keeps in registers are read again (1030).
  c.push_back({OpId::rmsnorm, "rows=100,h=128", {{100, 128}, {128}}, NormAttrs{1e-6, 0.0}, kFloat});
  c.push_back({OpId::rmsnorm, "rows=40,h=256,offset=1", {{40, 256}, {256}}, NormAttrs{1e-6, 1.0}, kFloat});
  c.push_back({OpId::rmsnorm, "rows=30,h=42", {{30, 42}, {42}}, NormAttrs{1e-6, 0.0}, kFloat});
  c.push_back({OpId::rmsnorm, "rows=3,h=2304", {{3, 2304}, {2304}}, NormAttrs{1e-6, 0.0}, kFloat});
  c.push_back({OpId::rmsnorm, "rows=3,h=1030", {{3, 1030}, {1030}}, NormAttrs{1e-6, 0.0}, kFloat});
  c.push_back({OpId::rmsnorm_backward, "rows=300,h=40", {{300, 40}, {40}, {300, 40}}, NormAttrs{1e-6, 0.0}, kFloat, false, false});
  // More rows than the CUDA kernel's 4,096 partial-sum lane groups: a group walks several rows (and the offset form).
  c.push_back({OpId::rmsnorm_backward, "rows=4500,h=64,offset=1", {{4500, 64}, {64}, {4500, 64}}, NormAttrs{1e-6, 1.0},
               kFloat, false, false});
  // The CUDA backward's lane groups (at most 4,096, each with its own partial dw row; 16 lanes at h = 128 in bf16)
  // take several rows each at 9000 x 128 and 1100 x 1040; packs (128, 256, 1040), elements (42, 130), and rows wider
  // than a warp's registers (1040 in bf16 and 130: two warps a row).
  c.push_back({OpId::rmsnorm_backward, "rows=9000,h=128", {{9000, 128}, {128}, {9000, 128}}, NormAttrs{1e-6, 0.0},
               kFloat, false, false});
  c.push_back({OpId::rmsnorm_backward, "rows=2100,h=256,offset=1", {{2100, 256}, {256}, {2100, 256}},
               NormAttrs{1e-6, 1.0}, kFloat, false, false});
  c.push_back({OpId::rmsnorm_backward, "rows=2100,h=42", {{2100, 42}, {42}, {2100, 42}}, NormAttrs{1e-6, 0.0}, kFloat,
               false, false});
  c.push_back({OpId::rmsnorm_backward, "rows=1100,h=1040", {{1100, 1040}, {1040}, {1100, 1040}}, NormAttrs{1e-6, 0.0},
               kFloat, false, false});
  c.push_back({OpId::rmsnorm_backward, "rows=1100,h=130", {{1100, 130}, {130}, {1100, 130}}, NormAttrs{1e-6, 0.0},
               kFloat, false, false});
  // Rows too wide for a warp's registers: two warps a row (2048 in bf16), four (2560 in bf16, both in f32; f32 2560
  // also reads packs again and keeps part of its partial dw in memory).
  c.push_back({OpId::rmsnorm_backward, "rows=1500,h=2048", {{1500, 2048}, {2048}, {1500, 2048}}, NormAttrs{1e-6, 0.0},
               kFloat, false, false});
  c.push_back({OpId::rmsnorm_backward, "rows=1500,h=2560,offset=1", {{1500, 2560}, {2560}, {1500, 2560}},
               NormAttrs{1e-6, 1.0}, kFloat, false, false});
  // CUDA gated RMSNorm (the rmsnorm kernels with z read beside x): the GDN output norm's shape (T, H_v, d_v = 128;
  // packs, the whole row in registers), elements (42), rows wider than the registers (1030 elements, 2304 packs);
  // the differentiable rows also check the backward on each device through op_backward. The (T, H_v, d_v) row is
  // forward only: finite differences of a 400k-element loss sit at the f64 check's 1e-6 bound (9e-7 measured).
  c.push_back({OpId::gated_rmsnorm, "t=200,heads=16,h=128", {{200, 16, 128}, {128}, {200, 16, 128}},
               NormAttrs{1e-6, 0.0}, kFloat, false, false});
  c.push_back({OpId::gated_rmsnorm, "rows=100,h=128", {{100, 128}, {128}, {100, 128}}, NormAttrs{1e-6, 0.0}, kFloat});
  c.push_back({OpId::gated_rmsnorm, "rows=30,h=42", {{30, 42}, {42}, {30, 42}}, NormAttrs{1e-6, 0.0}, kFloat});
  c.push_back({OpId::gated_rmsnorm, "rows=40,h=256,offset=1", {{40, 256}, {256}, {40, 256}}, NormAttrs{1e-6, 1.0},
               kFloat});
  c.push_back({OpId::gated_rmsnorm, "rows=3,h=1030", {{3, 1030}, {1030}, {3, 1030}}, NormAttrs{1e-6, 0.0}, kFloat});
  c.push_back({OpId::gated_rmsnorm, "rows=3,h=2304", {{3, 2304}, {2304}, {3, 2304}}, NormAttrs{1e-6, 0.0}, kFloat});
  // The backward directly, with more rows than its partial dw rows (several rows per warp): packs (128, 1040),
  // elements (42, 130), rows wider than the registers (1040, 130), the offset form (64).
  c.push_back({OpId::gated_rmsnorm_backward, "rows=3000,h=128", {{3000, 128}, {128}, {3000, 128}, {3000, 128}},
               NormAttrs{1e-6, 0.0}, kFloat, false, false});
  c.push_back({OpId::gated_rmsnorm_backward, "rows=4500,h=64,offset=1", {{4500, 64}, {64}, {4500, 64}, {4500, 64}},
               NormAttrs{1e-6, 1.0}, kFloat, false, false});
  c.push_back({OpId::gated_rmsnorm_backward, "rows=2100,h=42", {{2100, 42}, {42}, {2100, 42}, {2100, 42}},
               NormAttrs{1e-6, 0.0}, kFloat, false, false});
  c.push_back({OpId::gated_rmsnorm_backward, "rows=1100,h=1040", {{1100, 1040}, {1040}, {1100, 1040}, {1100, 1040}},
               NormAttrs{1e-6, 0.0}, kFloat, false, false});
  c.push_back({OpId::gated_rmsnorm_backward, "rows=1100,h=130", {{1100, 130}, {130}, {1100, 130}, {1100, 130}},
               NormAttrs{1e-6, 0.0}, kFloat, false, false});
  c.push_back({OpId::cross_entropy, "n=2,v=32768,grad", {{2, 32768}, {2}}, CrossEntropyAttrs{-100, true, 0.5}, kFloat,
               false, false, {{}, {17, 32767}}});
  std::vector<double> labels = iota_mod(6, 13, 5);
  labels[2] = -100;
  c.push_back({OpId::cross_entropy, "n=6,v=13,ignore", {{6, 13}, {6}}, CrossEntropyAttrs{-100, true, 0.25}, kFloat,
               false, false, {{}, labels}});
  c.push_back({OpId::cross_entropy, "n=4,v=3001,loss_only", {{4, 3001}, {4}}, CrossEntropyAttrs{-100, false, 1.0},
               kFloat, false, false, {{}, iota_mod(4, 3001, 977)}});
  c.push_back({OpId::cross_entropy, "n=3,v=3001,grad", {{3, 3001}, {3}}, CrossEntropyAttrs{-100, true, 1.0},
               kFloat, false, false, {{}, iota_mod(3, 3001, 1234)}});
  // Vocabulary a multiple of the 16-byte pack (the CUDA kernel's packed path): an ignored row, a label in the last
  // pack, loss only.
  c.push_back({OpId::cross_entropy, "n=3,v=4104,ignore,packed", {{3, 4104}, {3}}, CrossEntropyAttrs{-100, true, 0.5},
               kFloat, false, false, {{}, {4103, -100, 8}}});
  c.push_back({OpId::cross_entropy, "n=2,v=4104,loss_only,packed", {{2, 4104}, {2}},
               CrossEntropyAttrs{-100, false, 1.0}, kFloat, false, false, {{}, {0, 4097}}});
  // A vocab-parallel slice: columns [4104, 8208) of the vocabulary, each row's whole log-sum-exp given (input 2, drawn
  // in [3, 6]): labels held, held by another slice (below and above) and ignored.
  c.push_back({OpId::cross_entropy_slice, "n=5,v=4104,first=4104,packed", {{5, 4104}, {5}, {5}},
               CrossEntropyAttrs{-100, true, 0.5, 4104}, kFloat, false, false, {{}, {4104, 8207, 17, 9000, -100}},
               {{}, {}, {3.0, 6.0}}, {2}});
  c.push_back({OpId::cross_entropy_slice, "n=4,v=13,first=13,loss_only", {{4, 13}, {4}, {4}},
               CrossEntropyAttrs{-100, false, 1.0, 13}, kFloat, false, false, {{}, {13, 25, 2, -100}}, {{}, {}, {1.0, 3.0}},
               {2}});
}

// Row-segment ops (multi-tenant LoRA): empty segments, rows past the last segment, column ranges that differ
// (empty and full ones included), scales != 1, p = 0 next to p > 0, single segments; C above 256 takes the
// CUDA path with one block per row.
SegmentAttrs mask_attrs(std::vector<int64_t> rows, std::vector<int64_t> col_begin, std::vector<int64_t> col_end,
                        std::vector<double> scale) {
  SegmentAttrs a;
  a.rows = std::move(rows);
  a.col_begin = std::move(col_begin);
  a.col_end = std::move(col_end);
  a.scale = std::move(scale);
  return a;
}

SegmentAttrs dropout_attrs(std::vector<int64_t> rows, std::vector<double> p, std::vector<uint64_t> seed) {
  SegmentAttrs a;
  a.rows = std::move(rows);
  a.p = std::move(p);
  a.seed = std::move(seed);
  return a;
}

void add_segment_op_cases(std::vector<OpCase>& c) {
  // Segment 1 empty, row 12 in no segment; segment 3 keeps no column.
  c.push_back({OpId::segment_mask, "t=13,c=10,rows=3+0+5+4,tail=1", {{13, 10}},
               mask_attrs({0, 3, 3, 8, 12}, {0, 2, 3, 5}, {4, 5, 10, 5}, {0.5, 3.0, -1.25, 2.0}), kFloat});
  c.push_back({OpId::segment_mask, "t=6,c=300,one_segment,scale=1", {{6, 300}}, mask_attrs({0, 6}, {0}, {300}, {1.0}),
               kFloat});
  c.push_back({OpId::segment_mask, "t=257,c=1031,rows=100+1+149,tail=7", {{257, 1031}},
               mask_attrs({0, 100, 101, 250}, {0, 17, 512}, {1031, 300, 1030}, {0.125, -2.0, 1.5}), kFloat});
  // Segment 1 empty, rows 12-13 pass through.
  c.push_back({OpId::dropout, "t=14,c=37,rows=4+0+5+3,p=0.3/0.5/0/0.3,tail=2", {{14, 37}},
               dropout_attrs({0, 4, 4, 9, 12}, {0.3, 0.5, 0.0, 0.3}, {1, 2, 3, 0xDEADBEEFCAFEull}), kFloat});
  c.push_back({OpId::dropout, "t=8,c=300,one_segment,p=0.3", {{8, 300}}, dropout_attrs({0, 8}, {0.3}, {42}), kFloat});
  c.push_back({OpId::dropout, "t=8,c=300,one_segment,p=0", {{8, 300}}, dropout_attrs({0, 8}, {0.0}, {42}), kFloat});
  c.push_back({OpId::dropout, "t=300,c=520,rows=150+149,p=0.3/0.1,tail=1", {{300, 520}},
               dropout_attrs({0, 150, 299}, {0.3, 0.1}, {7, 7}), kFloat});
  // A rank's part of its segments: rows that began 6 rows earlier (row_shift, context parallelism) and columns
  // [40, 77) of 120 (col_offset / row_width, a tensor-parallel rank's row-parallel input).
  SegmentAttrs part = dropout_attrs({0, 5, 11}, {0.3, 0.2}, {9, 10});
  part.row_shift = {6, 0};
  part.col_offset = 40;
  part.row_width = 120;
  c.push_back({OpId::dropout, "t=11,c=37,rows=5+6,row_shift=6,cols=40..77_of_120", {{11, 37}}, part, kFloat});
}

}  // namespace

std::vector<OpCase> all_op_cases() {
  std::vector<OpCase> c;
  for (bool ta : {false, true})
    for (bool tb : {false, true}) add_matmul(c, 0, 33, 17, 65, {ta, tb, 1.0f, 0.0f}, false);
  add_matmul(c, 0, 1, 1, 1, {}, false);
  add_matmul(c, 0, 64, 128, 256, {false, false, 0.5f, 0.0f}, false);
  add_matmul(c, 0, 16, 24, 40, {false, true, 1.0f, 1.0f}, false);  // accumulate into the output
  add_matmul(c, 3, 20, 12, 36, {false, false, 1.0f, 0.0f}, false);
  add_matmul(c, 2, 16, 8, 24, {true, true, 2.0f, 0.0f}, false);
  add_matmul(c, 4, 7, 9, 11, {false, true, 1.0f, 0.0f}, true);  // batched A, shared 2-D B
  // Thin batched products (the CUDA thin_batched_matmul kernels; the MoE combine's shapes): K = 1 outer products, a
  // (1, 8) x (8, n) weighted sum, batched matrix-vector products (n = 1), with alpha / beta and odd n (one column a
  // thread) among them.
  add_matmul(c, 6, 4, 40, 1, {}, false);
  add_matmul(c, 5, 1, 24, 8, {}, false);
  add_matmul(c, 3, 2, 13, 5, {false, false, 0.5f, 1.0f}, false);
  add_matmul(c, 4, 3, 1, 70, {}, false);
  add_matmul(c, 3, 5, 1, 40, {false, false, 2.0f, 1.0f}, false);
  // Skinny products x W^T, 1 to 4 rows against a 2-D W (the CUDA skinny_linear kernel; the decoding step's
  // projections): an odd number of W rows (a warp's second row is its first), K of 40 to 1032 packs of 16 bytes
  // (sweeps that do not divide evenly among the lanes), alpha; 5 rows fall to cuBLASLt.
  add_matmul(c, 0, 1, 37, 264, {false, true, 1.0f, 0.0f}, false);
  add_matmul(c, 0, 2, 130, 1032, {false, true, 0.5f, 0.0f}, false);
  add_matmul(c, 0, 3, 9, 40, {false, true, 1.0f, 0.0f}, false);
  add_matmul(c, 0, 4, 64, 512, {false, true, 1.0f, 0.0f}, false);
  add_matmul(c, 0, 5, 16, 64, {false, true, 1.0f, 0.0f}, false);

  for (OpId op : {OpId::add, OpId::mul}) {
    c.push_back({op, "same=[5,7]", {{5, 7}, {5, 7}}, {}, kFloat});
    c.push_back({op, "row=[4,6]+[6]", {{4, 6}, {6}}, {}, kFloat});
    c.push_back({op, "col=[3,5,2]+[3,1,2]", {{3, 5, 2}, {3, 1, 2}}, {}, kFloat});
    c.push_back({op, "both=[4,1]+[1,5]", {{4, 1}, {1, 5}}, {}, kFloat});
    c.push_back({op, "strided=[6,9]^T+[9]", {{6, 9}, {9}}, {}, kFloat, true});
    c.push_back({op, "large=[257,1031]", {{257, 1031}, {257, 1031}}, {}, kFloat});
    c.push_back({op, "packs=[8,16]", {{8, 16}, {8, 16}}, {}, kFloat});  // CUDA: 16-byte packs, no tail
  }
  c.push_back({OpId::scale, "n=1000,alpha=-1.5", {{10, 100}}, ScaleAttrs{-1.5}, kFloat});
  c.push_back({OpId::scale, "n=1001,alpha=0.75", {{7, 143}}, ScaleAttrs{0.75}, kFloat});  // CUDA: packs and a tail
  c.push_back({OpId::scale, "strided=[8,5]^T,alpha=0.25", {{8, 5}}, ScaleAttrs{0.25}, kFloat, true});
  for (DType to : kAll) {
    c.push_back({OpId::cast, fmt::format("to={},[7,13]", dtype_name(to)), {{7, 13}}, CastAttrs{to}, kAll, false, false});
  }
  // CUDA casts move 16 bytes of the narrower side a step: sizes without (128) and with (2145) a tail.
  for (DType to : {DType::F32, DType::BF16}) {
    c.push_back({OpId::cast, fmt::format("to={},[8,16]", dtype_name(to)), {{8, 16}}, CastAttrs{to}, kAll, false, false});
    c.push_back({OpId::cast, fmt::format("to={},[33,65]", dtype_name(to)), {{33, 65}}, CastAttrs{to}, kAll, false, false});
  }
  c.push_back({OpId::cast, "to=f32,strided=[9,4]^T", {{9, 4}}, CastAttrs{DType::F32}, kAll, true, false});
  c.push_back({OpId::cast, "to=bf16,strided=[5,6]^T", {{5, 6}}, CastAttrs{DType::BF16}, kFloat, true, false});
  for (OpId op : {OpId::sum, OpId::mean}) {
    c.push_back({op, "all,[6,7]", {{6, 7}}, ReduceAttrs{{}, false}, kFloat});
    c.push_back({op, "dim=-1,[5,300]", {{5, 300}}, ReduceAttrs{{-1}, false}, kFloat});
    c.push_back({op, "dim=0,keep,[33,8]", {{33, 8}}, ReduceAttrs{{0}, true}, kFloat});
    c.push_back({op, "dims=0,2,[4,3,5]", {{4, 3, 5}}, ReduceAttrs{{0, 2}, false}, kFloat});
    c.push_back({op, "dim=1,strided=[7,6]^T", {{7, 6}}, ReduceAttrs{{1}, false}, kFloat, true});
  }
  // sum_squares: 0-d and empty inputs, odd sizes, both sides of the CUDA single-block limit (4,096 elements), many
  // partials (~1M elements: 258 blocks) and strided inputs on both paths. Not differentiable.
  for (Shape s : {Shape{}, Shape{0}, Shape{1}, Shape{7, 13}, Shape{4096}, Shape{4097}, Shape{3, 5, 331},
                  Shape{1031, 1027}})
    c.push_back({OpId::sum_squares, "shape=" + shape_str(s), {s}, {}, kFloat, false, false});
  c.push_back({OpId::sum_squares, "strided=[9,7]^T", {{9, 7}}, {}, kFloat, true, false});
  c.push_back({OpId::sum_squares, "strided=[2,517,1025]^T", {{2, 517, 1025}}, {}, kFloat, true, false});
  // sum_squares_list: an empty tensor, one element, chunks of 65,536 elements with tails (70,001: two chunks;
  // 300 x 1031: five), and a pack tail (7 x 13).
  const std::vector<Shape> list_shapes = {{7, 13}, {0}, {70001}, {1}, {300, 1031}, {4097}};
  c.push_back({OpId::sum_squares_list, "6 tensors,chunk tails", list_shapes, {}, kFloat, false, false});
  c.push_back({OpId::sum_squares_list, "one tensor", {{5, 3}}, {}, kFloat, false, false});
  for (Shape s : {Shape{1, 1}, Shape{4, 7}, Shape{3, 2, 129}, Shape{2, 3000}}) {
    c.push_back({OpId::softmax, "shape=" + shape_str(s), {s}, {}, kFloat});
    c.push_back({OpId::softmax_backward, "shape=" + shape_str(s), {s, s}, {}, kFloat, false, false});
    c.push_back({OpId::silu, "shape=" + shape_str(s), {s}, {}, kFloat});
    c.push_back({OpId::silu_backward, "shape=" + shape_str(s), {s, s}, {}, kFloat, false, false});
  }
  c.push_back({OpId::silu, "strided=[5,3]^T", {{5, 3}}, {}, kFloat, true});
  add_model_op_cases(c);
  add_segment_op_cases(c);
  add_gated_delta_op_cases(c);
  add_gdn_state_op_cases(c);
  add_moe_op_cases(c);
  add_paged_op_cases(c);
  // adamw: all three outputs checked; grad has the master's dtype here (bf16 grads with f32 masters:
  // tests/unit/test_optim.cpp). The bf16 rows are bf16 optimizer states (parameter, m and v bf16, no master).
  const std::vector<DType> kMaster = {DType::F64, DType::F32};
  const std::vector<DType> kState = {DType::F64, DType::F32, DType::BF16};
  c.push_back({OpId::adamw, "[7,13],step=1,wd=0.1", {{7, 13}, {7, 13}, {7, 13}, {7, 13}},
               AdamWAttrs{0.1, 0.9, 0.999, 1e-8, 0.1, 1, 1.0, std::nullopt}, kState, false, false});
  c.push_back({OpId::adamw, "[1],step=3,eps=0.5", {{1}, {1}, {1}, {1}}, AdamWAttrs{0.05, 0.8, 0.9, 0.5, 0.0, 3, 2.0, std::nullopt},
               kState, false, false});
  c.push_back({OpId::adamw, "[257,1031],step=100,b2=0.95,scale=0.25", {{257, 1031}, {257, 1031}, {257, 1031}, {257, 1031}},
               AdamWAttrs{3e-3, 0.9, 0.95, 1e-8, 0.01, 100, 0.25, std::nullopt}, kState, false, false});
  // bf16 states with an f32 gradient (input 1 in the accumulation dtype), a pack tail on CUDA (1031 * 7 % 8 = 1), and
  // an lr large enough that a dropped update would exceed the bf16 threshold.
  OpCase f32_grad{OpId::adamw, "[1031,7],step=2,lr=0.2,wd=0.1,grad=f32", {{1031, 7}, {1031, 7}, {1031, 7}, {1031, 7}},
                  AdamWAttrs{0.2, 0.9, 0.999, 1e-8, 0.1, 2, 0.5, std::nullopt}, {DType::BF16}, false, false};
  f32_grad.accumulation_inputs = {1};
  c.push_back(f32_grad);
  // adamw_list: groups of four of different sizes (an empty one, chunk tails of the CUDA kernel: 70,001 elements are
  // two chunks of 65,536; pack tails), f32 masters with and without the rounded parameter, bf16 states.
  std::vector<Shape> groups;
  for (Shape s : {Shape{7, 13}, Shape{0}, Shape{70001}, Shape{1}, Shape{257, 1031}})
    for (int i = 0; i < 4; ++i) groups.push_back(s);
  c.push_back({OpId::adamw_list, "5 groups,step=3,wd=0.1", groups,
               AdamWAttrs{0.05, 0.9, 0.999, 1e-8, 0.1, 3, 0.5, std::nullopt}, kState, false, false});
  c.push_back({OpId::adamw_list, "5 groups,step=2,rounded=bf16", groups,
               AdamWAttrs{0.1, 0.9, 0.999, 1e-8, 0.0, 2, 1.0, DType::BF16}, kMaster, false, false});
  // With the rounded parameter as a fourth output (bitwise equality with adamw + cast: tests/unit/test_optim.cpp).
  c.push_back({OpId::adamw, "[7,13],step=2,wd=0.1,rounded=bf16", {{7, 13}, {7, 13}, {7, 13}, {7, 13}},
               AdamWAttrs{0.1, 0.9, 0.999, 1e-8, 0.1, 2, 1.0, DType::BF16}, kMaster, false, false});
  c.push_back({OpId::adamw, "[257,1031],step=100,b2=0.95,rounded=f16", {{257, 1031}, {257, 1031}, {257, 1031}, {257, 1031}},
               AdamWAttrs{3e-3, 0.9, 0.95, 1e-8, 0.01, 100, 0.25, DType::F16}, kMaster, false, false});
  return c;
}

}  // namespace lathe
