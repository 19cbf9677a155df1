// Op cases of gated_delta_rule_state (the gated delta rule from given states, for prefill and decoding): several
// documents with non-zero initial states, one-token documents (a batch of decoding steps), an empty document (its
// final state is its initial state), a document longer than a chunk, GQA groups 1, 2 and 3 (H_v > H_k), d_k != d_v,
// and Qwen3.5's head dims (d_k = d_v = 128: the CUDA kernel's state then needs more than 48 KiB of shared memory).
// The state input is in the accumulation dtype (OpCase::accumulation_inputs), and in one case g and beta too.
// Forward only.
#include "testing/op_check.h"

namespace lathe {

void add_gdn_state_op_cases(std::vector<OpCase>& c) {
  const std::vector<DType> dtypes = {DType::F64, DType::F32, DType::BF16, DType::F16};
  // As the gated_delta_rule cases: q, k small (the op does not normalise them), g in [-1.5, 0), beta in (0, 1]; the
  // states of a trained model are O(1).
  const std::vector<std::pair<double, double>> ranges = {{-0.35, 0.35}, {-0.35, 0.35}, {-2.0, 2.0}, {-1.5, -0.001},
                                                         {0.001, 1.0}, {},           {-1.0, 1.0}};
  const auto add = [&](int64_t t, int64_t hk, int64_t hv, int64_t dk, int64_t dv, const std::vector<double>& cu,
                       GatedDeltaAttrs a, const char* what, std::vector<size_t> wide = {6}) {
    const int64_t n = int64_t(cu.size()) - 1;
    c.push_back({OpId::gated_delta_rule_state,
                 fmt::format("t={},hk={},hv={},dk={},dv={},chunk={},{}", t, hk, hv, dk, dv, a.chunk, what),
                 {{t, hk, dk}, {t, hk, dk}, {t, hv, dv}, {t, hv}, {t, hv}, {n + 1}, {n, hv, dk, dv}}, a, dtypes, false,
                 false, {{}, {}, {}, {}, {}, cu, {}}, ranges, wide});
  };
  add(13, 1, 2, 8, 6, {0, 2, 9, 10, 13}, GatedDeltaAttrs{0.0, 4}, "docs=2+7+1+3");
  add(3, 2, 4, 16, 8, {0, 1, 2, 3}, GatedDeltaAttrs{0.3, 64}, "scale=0.3,decode=1+1+1");
  add(70, 1, 3, 8, 8, {0, 0, 66, 70}, GatedDeltaAttrs{}, "docs=0+66+4");
  add(5, 1, 2, 128, 128, {0, 1, 5}, GatedDeltaAttrs{}, "qwen3_5_dims,docs=1+4");
  add(4, 2, 4, 128, 128, {0, 1, 1, 2, 4}, GatedDeltaAttrs{}, "qwen3_5_dims,decode=1+0+1+2");
  // g and beta in f32 beside bf16/f16 q, k, v (the bf16 model's fp32 log-decay), as in the decoder.
  add(13, 1, 2, 8, 6, {0, 2, 9, 10, 13}, GatedDeltaAttrs{}, "f32_gates,docs=2+7+1+3", {3, 4, 6});
}

}  // namespace lathe
