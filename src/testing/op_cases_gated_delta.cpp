// Op cases of the Gated DeltaNet ops: documents shorter than the conv width, of one token, longer than a chunk (the
// chunked rule is run with small chunks so that every document spans several), GQA groups 1 and 2 (H_v > H_k),
// d_k != d_v. Inputs of the delta rule are drawn where it is stable (|k|^2 beta <= ~1) and g < 0, as in the model.
// BF16 and F16 rows run on CUDA only (the CPU has f32/f64 kernels and skips them); the model-sized rows (d_k = d_v =
// 128, H_k = 2, H_v = 4, documents of 1, 63, 64, 65 and 200 tokens) exercise the chunked tensor-core kernels in bf16
// and the recurrent kernel in f32/f16. Rows named f32_gates pass g and beta in f32 beside bf16/f16 q, k, v. Rows
// named save_states also return the chunk-start states and, differentiable, run the backward from them; the
// backward rows pass none (0 rows: recomputed).
#include "ops/ops.h"
#include "testing/op_check.h"

namespace lathe {

namespace {
const std::vector<DType> kRef = {DType::F64, DType::F32, DType::BF16, DType::F16};
const std::vector<DType> kDevice = {DType::F32, DType::BF16, DType::F16};  // too large for the f64 finite differences
}  // namespace

void add_gated_delta_op_cases(std::vector<OpCase>& c) {
  for (Shape s : {Shape{1}, Shape{4, 7}, Shape{3, 2, 129}}) {
    // x in [-1, 1]: the bf16 rows' gradient y (1 - y) reads a bf16-rounded y, whose error grows with 1 / (1 - y).
    c.push_back({OpId::sigmoid, "shape=" + shape_str(s), {s}, {}, kRef, false, true, {}, {{-1.0, 1.0}}});
    c.push_back({OpId::sigmoid_backward, "shape=" + shape_str(s), {s, s}, {}, kRef, false, false});
  }
  // causal_conv1d: documents of 2 (< W), 7, 1 and 3 tokens; W = 4 and W = 1; one document.
  const std::vector<double> cu13 = {0, 2, 9, 10, 13}, cu1 = {0, 11};
  c.push_back({OpId::causal_conv1d, "t=13,c=5,w=4,docs=2+7+1+3", {{13, 5}, {5, 4}, {5}}, {}, kRef, false, true,
               {{}, {}, cu13}});
  c.push_back({OpId::causal_conv1d, "t=11,c=3,w=2,one_doc", {{11, 3}, {3, 2}, {2}}, {}, kRef, false, true, {{}, {}, cu1}});
  c.push_back({OpId::causal_conv1d, "t=13,c=6,w=1", {{13, 6}, {6, 1}, {5}}, {}, kRef, false, true, {{}, {}, cu13}});
  c.push_back({OpId::causal_conv1d_backward, "t=13,c=5,w=4", {{13, 5}, {5, 4}, {13, 5}, {5}}, {}, kRef, false, false,
               {{}, {}, {}, cu13}});
  // gdn_decay: a + dt_bias spans both signs; A_log in [-2, 2].
  c.push_back({OpId::gdn_decay, "t=9,h=3", {{9, 3}, {3}, {3}}, {}, kRef});
  c.push_back({OpId::gdn_decay_backward, "t=9,h=3", {{9, 3}, {3}, {3}, {9, 3}}, {}, kRef, false, false});
  // gated_delta_rule: q, k small (the op does not normalise them), g in [-1.5, 0), beta in (0, 1].
  const std::vector<std::pair<double, double>> ranges = {{-0.35, 0.35}, {-0.35, 0.35}, {-2.0, 2.0}, {-1.5, -0.001},
                                                         {0.001, 1.0}};
  const auto add_gdr = [&](int64_t t, int64_t hk, int64_t hv, int64_t dk, int64_t dv, const std::vector<double>& cu,
                           GatedDeltaAttrs a, const char* what) {
    c.push_back({OpId::gated_delta_rule, fmt::format("t={},hk={},hv={},dk={},dv={},chunk={},{}", t, hk, hv, dk, dv, a.chunk, what),
                 {{t, hk, dk}, {t, hk, dk}, {t, hv, dv}, {t, hv}, {t, hv}, {int64_t(cu.size())}}, a, kRef, false, true,
                 {{}, {}, {}, {}, {}, cu}, ranges});
  };
  add_gdr(13, 1, 2, 8, 6, cu13, GatedDeltaAttrs{0.0, 4}, "docs=2+7+1+3");
  add_gdr(11, 2, 2, 4, 4, cu1, GatedDeltaAttrs{0.3, 3}, "scale=0.3,one_doc");
  add_gdr(70, 1, 3, 8, 8, {0, 1, 66, 70}, GatedDeltaAttrs{}, "chunk64,docs=1+65+4");
  // Saved chunk-start states (the recurrent kernel on CUDA): 1 + 2 + 1 chunks, and 2 + 1 chunks in 4 rows (a zero
  // tail).
  add_gdr(70, 1, 3, 8, 8, {0, 1, 66, 70}, GatedDeltaAttrs{0.0, 64, true}, "docs=1+65+4,save_states");
  add_gdr(128, 1, 2, 8, 8, {0, 100, 128}, GatedDeltaAttrs{0.0, 16, true}, "docs=100+28,save_states");
  std::vector<std::pair<double, double>> bwd_ranges = ranges;
  bwd_ranges.push_back({-2.0, 2.0});
  // Model-sized: |k|^2 ~ 1 with d_k = 128 (the model L2-normalises q and k).
  const std::vector<double> cu_docs = {0, 1, 64, 128, 193, 393};
  std::vector<std::pair<double, double>> big = {{-0.15, 0.15}, {-0.15, 0.15}, {-2.0, 2.0}, {-1.5, -0.001}, {0.001, 1.0}};
  // Saving the states (9 chunks in 11 rows) and differentiable: the backward reads the forward's own states.
  c.push_back({OpId::gated_delta_rule, "t=393,hk=2,hv=4,dk=128,dv=128,docs=1+63+64+65+200,save_states",
               {{393, 2, 128}, {393, 2, 128}, {393, 4, 128}, {393, 4}, {393, 4}, {6}}, GatedDeltaAttrs{0.0, 64, true},
               kDevice, false, true, {{}, {}, {}, {}, {}, cu_docs}, big});
  // Many documents (39 of 8 tokens, one of 100): 40 x 4 value heads x 2 = 320 scan blocks of 64 columns, more than
  // the SMs of any current GPU, so the scans take their 64-column path with one buffer a tile (fewer blocks take the
  // 32-column one, and fewer still the 16-column one, both double-buffered where the blocks fit one wave: the
  // five-document rows above and the one-document row below).
  std::vector<double> cu_many = {0};
  for (int d = 0; d < 39; ++d) cu_many.push_back(cu_many.back() + 8);
  cu_many.push_back(cu_many.back() + 100);
  c.push_back({OpId::gated_delta_rule, "t=412,hk=2,hv=4,dk=128,dv=128,docs=39x8+100,save_states",
               {{412, 2, 128}, {412, 2, 128}, {412, 4, 128}, {412, 4}, {412, 4}, {41}}, GatedDeltaAttrs{0.0, 64, true},
               kDevice, false, true, {{}, {}, {}, {}, {}, cu_many}, big});
  // One document of 5 chunks and 2 value heads: 16 blocks of 16 columns fit one wave, so the scans take their
  // 16-column path (forward saving states, then the backward from them); the t=70 backward row below takes it too.
  c.push_back({OpId::gated_delta_rule, "t=300,hk=1,hv=2,dk=128,dv=128,one_doc,save_states",
               {{300, 1, 128}, {300, 1, 128}, {300, 2, 128}, {300, 2}, {300, 2}, {2}}, GatedDeltaAttrs{0.0, 64, true},
               kDevice, false, true, {{}, {}, {}, {}, {}, {0, 300}}, big});
  big.push_back({-2.0, 2.0});
  c.push_back({OpId::gated_delta_rule_backward, "t=393,hk=2,hv=4,dk=128,dv=128,docs=1+63+64+65+200",
               {{393, 2, 128}, {393, 2, 128}, {393, 4, 128}, {393, 4}, {393, 4}, {393, 4, 128}, {6},
                {0, 4, 128, 128}, {0, 4, kGdnChunkCacheWidth}}, GatedDeltaAttrs{},
               kDevice, false, false, {{}, {}, {}, {}, {}, {}, cu_docs}, big});
  // An empty document between two others, and a single document of one chunk plus one token (bf16 chunked).
  c.push_back({OpId::gated_delta_rule_backward, "t=70,hk=1,hv=2,dk=128,dv=128,docs=5+0+65",
               {{70, 1, 128}, {70, 1, 128}, {70, 2, 128}, {70, 2}, {70, 2}, {70, 2, 128}, {4},
                {0, 2, 128, 128}, {0, 2, kGdnChunkCacheWidth}}, GatedDeltaAttrs{0.0, 3},
               kDevice, false, false, {{}, {}, {}, {}, {}, {}, {0, 5, 5, 70}}, big});
  c.push_back({OpId::causal_conv1d, "t=393,c=768,w=4,docs=1+63+64+65+200", {{393, 768}, {768, 4}, {6}}, {}, kDevice,
               false, false, {{}, {}, cu_docs}});
  c.push_back({OpId::causal_conv1d_backward, "t=393,c=768,w=4,docs=1+63+64+65+200",
               {{393, 768}, {768, 4}, {393, 768}, {6}}, {}, kDevice, false, false, {{}, {}, {}, cu_docs}});
  // Several token slabs of the CUDA dw reduction (256 tokens each) with documents across their edges, a partial
  // channel block (130 = 128 + 2) and W = 3.
  const std::vector<double> cu_long = {0, 300, 301, 820, 1100};
  c.push_back({OpId::causal_conv1d, "t=1100,c=130,w=3,docs=300+1+519+280", {{1100, 130}, {130, 3}, {5}}, {}, kDevice,
               false, false, {{}, {}, cu_long}});
  c.push_back({OpId::causal_conv1d_backward, "t=1100,c=130,w=3,docs=300+1+519+280",
               {{1100, 130}, {130, 3}, {1100, 130}, {5}}, {}, kDevice, false, false, {{}, {}, {}, cu_long}});
  // g and beta in f32 beside bf16/f16 q, k, v (the model's fp32 log-decay): the recurrent kernels (small dims,
  // forward and backward through the op's backward) and the chunked ones (model-sized, bf16).
  const std::vector<DType> k16 = {DType::BF16, DType::F16};
  c.push_back({OpId::gated_delta_rule, "t=13,hk=1,hv=2,dk=8,dv=6,chunk=4,f32_gates",
               {{13, 1, 8}, {13, 1, 8}, {13, 2, 6}, {13, 2}, {13, 2}, {5}}, GatedDeltaAttrs{0.0, 4}, k16, false, true,
               {{}, {}, {}, {}, {}, cu13}, ranges, {3, 4}});
  c.push_back({OpId::gated_delta_rule, "t=393,hk=2,hv=4,dk=128,dv=128,docs=1+63+64+65+200,f32_gates",
               {{393, 2, 128}, {393, 2, 128}, {393, 4, 128}, {393, 4}, {393, 4}, {6}}, GatedDeltaAttrs{}, k16, false,
               false, {{}, {}, {}, {}, {}, cu_docs}, big, {3, 4}});
  c.push_back({OpId::gated_delta_rule, "t=393,hk=2,hv=4,dk=128,dv=128,docs=1+63+64+65+200,f32_gates,save_states",
               {{393, 2, 128}, {393, 2, 128}, {393, 4, 128}, {393, 4}, {393, 4}, {6}}, GatedDeltaAttrs{0.0, 64, true},
               k16, false, true, {{}, {}, {}, {}, {}, cu_docs}, big, {3, 4}});
  c.push_back({OpId::gated_delta_rule_backward, "t=393,hk=2,hv=4,dk=128,dv=128,docs=1+63+64+65+200,f32_gates",
               {{393, 2, 128}, {393, 2, 128}, {393, 4, 128}, {393, 4}, {393, 4}, {393, 4, 128}, {6},
                {0, 4, 128, 128}, {0, 4, kGdnChunkCacheWidth}}, GatedDeltaAttrs{},
               k16, false, false, {{}, {}, {}, {}, {}, {}, cu_docs}, big, {3, 4}});
  // H_v = H_k: the chunked backward writes dq, dk itself (no group sum).
  c.push_back({OpId::gated_delta_rule_backward, "t=70,hk=2,hv=2,dk=128,dv=128,docs=5+0+65,f32_gates",
               {{70, 2, 128}, {70, 2, 128}, {70, 2, 128}, {70, 2}, {70, 2}, {70, 2, 128}, {4},
                {0, 2, 128, 128}, {0, 2, kGdnChunkCacheWidth}}, GatedDeltaAttrs{},
               k16, false, false, {{}, {}, {}, {}, {}, {}, {0, 5, 5, 70}}, big, {3, 4}});
  c.push_back({OpId::gated_delta_rule_backward, "t=13,hk=1,hv=2,dk=8,dv=6,chunk=4",
               {{13, 1, 8}, {13, 1, 8}, {13, 2, 6}, {13, 2}, {13, 2}, {13, 2, 6}, {5},
                {0, 2, 8, 6}, {0, 2, kGdnChunkCacheWidth}}, GatedDeltaAttrs{0.0, 4}, kRef,
               false, false, {{}, {}, {}, {}, {}, {}, cu13}, bwd_ranges});
}

}  // namespace lathe
