// Registration of the CUDA reductions: sum over dims, sum of squares (every float dtype, f64 included; partials
// scratch from the context's allocator, released on return as model_ops_register.cpp describes), row softmax and its
// backward. Covered by tests/ops.
#include <algorithm>
#include <vector>

#include "backend/cuda/cuda_backend.h"
#include "backend/cuda/launchers.h"
#include "backend/registry.h"
#include "ops/ops.h"

namespace lathe::cuda {

namespace {

Support sum_supports(const OpCall& c) {
  if (!c.outputs[0].is_contiguous()) return Support::no("output must be contiguous");
  if (c.inputs[0].dim() > kMaxDims) return Support::no("more than 8 dims");
  return Support::yes();
}

Support sum_squares_supports(const OpCall& c) {
  if (c.inputs[0].dim() > kMaxDims) return Support::no("more than 8 dims");
  return Support::yes();
}

Support rows_supports(const OpCall& c) {
  for (const Tensor& t : c.inputs)
    if (!t.is_contiguous()) return Support::no("inputs must be contiguous");
  if (!c.outputs[0].is_contiguous()) return Support::no("output must be contiguous");
  return Support::yes();
}

void run_sum(const OpCall& c, ExecContext& ctx) {
  const Tensor& x = c.inputs[0];
  const std::vector<int> dims = normalize_reduce_dims(c.attr<ReduceAttrs>().dims, x.dim());
  StridedLayout kept, red;
  for (int d = 0; d < x.dim(); ++d) {
    StridedLayout& l = std::find(dims.begin(), dims.end(), d) != dims.end() ? red : kept;
    l.shape[l.ndim] = x.size(d);
    l.stride[l.ndim] = x.strides()[d];
    l.ndim++;
  }
  int64_t n_red = 1;
  for (int d = 0; d < red.ndim; ++d) n_red *= red.shape[d];
  launch_sum(x.dtype(), c.outputs[0].numel(), x.data_ptr(), kept, red, n_red, c.outputs[0].data_ptr(),
             as_cuda(ctx.stream).handle());
}

void run_sum_squares(const OpCall& c, ExecContext& ctx) {
  const Tensor& x = c.inputs[0];
  const Tensor& out = c.outputs[0];  // 0-d, f32 (f64 for f64)
  StridedLayout lx;
  lx.ndim = x.dim();
  for (int d = 0; d < x.dim(); ++d) {
    lx.shape[d] = x.size(d);
    lx.stride[d] = x.strides()[d];
  }
  const int64_t n_partials = sum_squares_partials(x.numel());
  const Tensor partials = n_partials ? Tensor::empty({n_partials}, out.dtype(), ctx.allocator) : Tensor();
  launch_sum_squares(x.dtype(), x.numel(), x.data_ptr(), lx, x.is_contiguous(),
                     n_partials ? partials.data_ptr() : nullptr, out.data_ptr(), as_cuda(ctx.stream).handle());
}

Support sum_squares_list_supports(const OpCall& c) {
  for (const Tensor& t : c.inputs)
    if (!t.is_contiguous()) return Support::no("inputs must be contiguous");
  return Support::yes();
}

// The table of the tensors goes up through the stream's pinned staging (no wait) into scratch of the allocator,
// followed by the chunk partials.
void run_sum_squares_list(const OpCall& c, ExecContext& ctx) {
  const Tensor& out = c.outputs[0];  // (n), f32 (f64 for f64)
  std::vector<SumSquaresListEntry> table(c.inputs.size());
  int64_t chunks = 0;
  for (size_t i = 0; i < c.inputs.size(); ++i) {
    const Tensor& x = c.inputs[i];
    table[i] = {x.data_ptr(), x.numel(), chunks, reinterpret_cast<uintptr_t>(x.data_ptr()) % 16 == 0 ? 1 : 0};
    chunks += (x.numel() + kSumSquaresListChunk - 1) / kSumSquaresListChunk;
  }
  const int64_t table_bytes = int64_t(table.size() * sizeof(SumSquaresListEntry));
  const int64_t offset = (table_bytes + 255) / 256 * 256;
  const Tensor scratch =
      Tensor::empty({offset + chunks * int64_t(dtype_size(out.dtype()))}, DType::U8, ctx.allocator);
  auto* base = static_cast<uint8_t*>(scratch.data_ptr());
  CudaStream& stream = as_cuda(ctx.stream);
  stream.upload_async(base, table.data(), size_t(table_bytes));
  launch_sum_squares_list(c.inputs[0].dtype(), reinterpret_cast<const SumSquaresListEntry*>(base), int(table.size()),
                          chunks, base + offset, out.data_ptr(), stream.handle());
}

void run_softmax(const OpCall& c, ExecContext& ctx) {
  const Tensor& x = c.inputs[0];
  const int64_t cols = x.size(-1);
  launch_softmax(x.dtype(), cols ? x.numel() / cols : 0, cols, x.data_ptr(), c.outputs[0].data_ptr(),
                 as_cuda(ctx.stream).handle());
}

void run_softmax_backward(const OpCall& c, ExecContext& ctx) {
  const Tensor& y = c.inputs[0];
  const int64_t cols = y.size(-1);
  launch_softmax_backward(y.dtype(), cols ? y.numel() / cols : 0, cols, y.data_ptr(), c.inputs[1].data_ptr(),
                          c.outputs[0].data_ptr(), as_cuda(ctx.stream).handle());
}

}  // namespace

void register_cuda_reduce_kernels(KernelRegistry& r) {
  for (DType dt : {DType::F32, DType::BF16, DType::F16}) {
    r.add(KernelDef{OpId::sum, DeviceType::CUDA, dt, "cuda/strided_block_sum", sum_supports, run_sum});
    r.add(KernelDef{OpId::softmax, DeviceType::CUDA, dt, "cuda/softmax_rows", rows_supports, run_softmax});
    r.add(KernelDef{OpId::softmax_backward, DeviceType::CUDA, dt, "cuda/softmax_backward_rows", rows_supports,
                    run_softmax_backward});
  }
  for (DType dt : {DType::F32, DType::BF16, DType::F16, DType::F64}) {
    r.add(KernelDef{OpId::sum_squares, DeviceType::CUDA, dt, "cuda/block_partials_sum_squares", sum_squares_supports,
                    run_sum_squares});
    r.add(KernelDef{OpId::sum_squares_list, DeviceType::CUDA, dt, "cuda/chunked_sum_squares_list",
                    sum_squares_list_supports, run_sum_squares_list});
  }
}

}  // namespace lathe::cuda
