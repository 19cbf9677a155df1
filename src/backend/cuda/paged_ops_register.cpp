// Registration of the rollout engine's CUDA kernels (paged.cu, paged_decode.cu): paged_attention for f32, bf16 and f16
// (the cp.async pipeline for 128-, 256- and 512-byte rows in pages of a power of two positions, then the general
// kernel for head dims up to 256), row_argmax_logsumexp, sample_rows and penalize_rows for f32, bf16 and f16,
// scatter_rows for every float dtype (a row copy). Covered by src/testing/op_cases_paged.cpp.
#include <algorithm>
#include <cmath>
#include <cstdint>

#include "backend/cuda/cuda_backend.h"
#include "backend/cuda/paged_launchers.h"
#include "backend/registry.h"

namespace lathe::cuda {

namespace {

Support paged_attention_supports(const OpCall& c) {
  if (c.inputs[0].size(2) > kMaxPagedHeadDim) return Support::no("head dim above 256 (a warp holds a query row)");
  return all_contiguous(c);
}

Support paged_attention_pipelined_supports(const OpCall& c) {
  const Tensor& q = c.inputs[0];
  const int64_t block_size = c.attr<PagedAttentionAttrs>().block_size;
  if (!paged_attention_pipelined_applies(q.dtype(), q.size(2), block_size))
    return Support::no(fmt::format("rows of {} x {} bytes in pages of {} positions (the pipeline copies 128-, 256- or "
                                   "512-byte rows, pages of a power of two from 4)",
                                   q.size(2), dtype_size(q.dtype()), block_size));
  for (int k = 0; k < 3; ++k)
    if (reinterpret_cast<uintptr_t>(c.inputs[k].data_ptr()) % 16 != 0)
      return Support::no("q and the caches must be 16-byte aligned (cp.async)");
  return all_contiguous(c);
}

template <bool kPipelined>
void run_paged_attention(const OpCall& c, ExecContext& ctx) {
  const Tensor& q = c.inputs[0];
  const auto& a = c.attr<PagedAttentionAttrs>();
  const int64_t tokens = q.size(0), heads = q.size(1), d = q.size(2), kv_heads = c.inputs[1].size(1);
  const int64_t width = c.inputs[3].size(1);
  const int64_t splits = paged_attention_splits(tokens, heads, kv_heads, width * a.block_size);
  const Tensor workspace =
      splits > 1 ? Tensor::empty({tokens * heads * splits * (d + 2)}, DType::F32, ctx.allocator) : Tensor();
  const float scale = float(a.scale ? a.scale : 1.0 / std::sqrt(double(d)));
  float* part = splits > 1 ? workspace.data<float>() : nullptr;
  if constexpr (kPipelined)
    launch_paged_attention_pipelined(q.dtype(), tokens, heads, kv_heads, d, a.block_size, c.inputs[3].size(0), width,
                                     splits, scale, q.data_ptr(), c.inputs[1].data_ptr(), c.inputs[2].data_ptr(),
                                     c.inputs[3].data<int32_t>(), c.inputs[4].data<int32_t>(),
                                     c.inputs[5].data<int32_t>(), c.outputs[0].data_ptr(), part, PagedPipeline{},
                                     stream_of(ctx));
  else
    launch_paged_attention(q.dtype(), tokens, heads, kv_heads, d, a.block_size, c.inputs[3].size(0), width, splits,
                           scale, q.data_ptr(), c.inputs[1].data_ptr(), c.inputs[2].data_ptr(),
                           c.inputs[3].data<int32_t>(), c.inputs[4].data<int32_t>(), c.inputs[5].data<int32_t>(),
                           c.outputs[0].data_ptr(), part, stream_of(ctx));
}

void run_scatter_rows(const OpCall& c, ExecContext& ctx) {
  const Tensor& src = c.inputs[0];
  const Tensor& dst = c.inputs[2];
  const Tensor& out = c.outputs[0];
  if (dst.data_ptr() != out.data_ptr())  // scatter_rows_into passes the destination as the output
    ctx.backend.copy(out.data_ptr(), ctx.device, dst.data_ptr(), ctx.device, dst.nbytes(), ctx.stream);
  const int64_t rows = src.size(0);
  launch_scatter_rows(rows, rows > 0 ? int64_t(src.nbytes()) / rows : 0, src.data_ptr(), c.inputs[1].data<int32_t>(),
                      out.data_ptr(), stream_of(ctx));
}

void run_row_argmax_logsumexp(const OpCall& c, ExecContext& ctx) {
  const Tensor& x = c.inputs[0];
  const int64_t rows = x.size(0), chunks = row_argmax_logsumexp_chunks(rows, x.size(1));
  const Tensor workspace = Tensor::empty({std::max<int64_t>(rows, 1) * chunks * 4}, DType::F32, ctx.allocator);
  launch_row_argmax_logsumexp(x.dtype(), rows, x.size(1), c.attr<ArgmaxAttrs>().limit, chunks, x.data_ptr(),
                              c.outputs[0].data<int32_t>(), c.outputs[1].data<float>(), c.outputs[2].data<float>(),
                              workspace.data<float>(), stream_of(ctx));
}

void run_sample_rows(const OpCall& c, ExecContext& ctx) {
  const Tensor& x = c.inputs[0];
  const int64_t m = c.inputs[1].size(0), limit = c.attr<ArgmaxAttrs>().limit;
  const int64_t chunks = row_argmax_logsumexp_chunks(m, limit > 0 ? limit : x.size(1));
  const int64_t blocks = std::max<int64_t>(m, 1) * chunks;
  const Tensor maxes = Tensor::empty({blocks}, DType::F32, ctx.allocator);
  const Tensor cuts = Tensor::empty({std::max<int64_t>(m, 1)}, DType::I32, ctx.allocator);
  const Tensor part = Tensor::empty({blocks * 3}, DType::F64, ctx.allocator);
  launch_sample_rows(x.dtype(), m, x.size(1), limit, chunks, x.data_ptr(), c.inputs[1].data<int32_t>(),
                     c.inputs[2].data_ptr(), c.inputs[3].data<int32_t>(), c.outputs[0].data<int32_t>(),
                     c.outputs[1].data_ptr(), c.outputs[2].data_ptr(), maxes.data<float>(),
                     reinterpret_cast<uint32_t*>(cuts.data<int32_t>()), part.data<double>(), stream_of(ctx));
}

void run_penalize_rows(const OpCall& c, ExecContext& ctx) {
  const Tensor& x = c.inputs[0];
  launch_penalize_rows(x.dtype(), c.inputs[1].size(0), x.size(1), c.inputs[3].size(0), x.data_ptr(),
                       c.inputs[1].data<int32_t>(), c.inputs[2].data<float>(), c.inputs[3].data<int32_t>(),
                       c.outputs[0].data<float>(), stream_of(ctx));
}

}  // namespace

void register_cuda_paged_kernels(KernelRegistry& r) {
  for (DType dt : {DType::F32, DType::BF16, DType::F16})
    r.add(KernelDef{OpId::penalize_rows, DeviceType::CUDA, dt, "cuda/penalize_rows", all_contiguous, run_penalize_rows});
  for (DType dt : {DType::F32, DType::BF16, DType::F16})
    r.add(KernelDef{OpId::sample_rows, DeviceType::CUDA, dt, "cuda/sample_rows", all_contiguous, run_sample_rows});
  for (DType dt : {DType::F32, DType::BF16, DType::F16})
    r.add(KernelDef{OpId::row_argmax_logsumexp, DeviceType::CUDA, dt, "cuda/row_argmax_logsumexp", all_contiguous,
                    run_row_argmax_logsumexp});
  for (DType dt : {DType::F32, DType::BF16, DType::F16}) {
    r.add(KernelDef{OpId::paged_attention, DeviceType::CUDA, dt, "cuda/paged_attention_pipelined",
                    paged_attention_pipelined_supports, run_paged_attention<true>});
    r.add(KernelDef{OpId::paged_attention, DeviceType::CUDA, dt, "cuda/paged_attention", paged_attention_supports,
                    run_paged_attention<false>});
  }
  for (DType dt : {DType::F32, DType::F64, DType::BF16, DType::F16})
    r.add(KernelDef{OpId::scatter_rows, DeviceType::CUDA, dt, "cuda/scatter_rows", all_contiguous, run_scatter_rows});
}

}  // namespace lathe::cuda
