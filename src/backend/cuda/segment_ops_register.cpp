// Registration of the CUDA row-segment kernels (segment_ops.cu): segment_mask and dropout for f32, f64, bf16 and
// f16. The attrs (validated by shape inference) are packed into the by-value SegmentTable here; more than
// kMaxSegments segments is refused by the predicate, with the reason.
// Covered by the segment_mask / dropout op-check cases (src/testing/op_cases.cpp).
#include "backend/cuda/cuda_backend.h"
#include "backend/cuda/segment_launchers.h"
#include "backend/dropout_hash.h"
#include "backend/registry.h"

namespace lathe::cuda {

namespace {

Support segment_supports(const OpCall& c) {
  const size_t n_seg = c.attr<SegmentAttrs>().rows.size() - 1;
  if (n_seg > size_t(kMaxSegments))
    return Support::no(fmt::format("{} segments, above the {} the kernel takes (the segment table is a kernel "
                                   "argument)", n_seg, kMaxSegments));
  return all_contiguous(c);
}

SegmentTable table_of(const OpCall& c) {
  const SegmentAttrs& a = c.attr<SegmentAttrs>();
  SegmentTable t;
  t.count = int32_t(a.rows.size() - 1);
  for (int s = 0; s <= t.count; ++s) t.rows[s] = a.rows[size_t(s)];
  for (int s = 0; s < t.count; ++s) {
    if (c.op == OpId::segment_mask) {
      t.col_begin[s] = a.col_begin[size_t(s)];
      t.col_end[s] = a.col_end[size_t(s)];
      t.scale[s] = a.scale[size_t(s)];
    } else {
      t.keep_prob[s] = 1.0 - a.p[size_t(s)];
      t.seed[s] = a.seed[size_t(s)];
      t.k_min[s] = dropout_threshold(a.p[size_t(s)]);
      t.row_shift[s] = a.row_shift.empty() ? 0 : a.row_shift[size_t(s)];
    }
  }
  t.col_offset = a.col_offset;
  t.row_width = a.row_width > 0 ? a.row_width : c.inputs[0].size(1);
  return t;
}

void run_segment_mask(const OpCall& c, ExecContext& ctx) {
  const Tensor& x = c.inputs[0];  // (T, C)
  launch_segment_mask(x.dtype(), x.size(0), x.size(1), x.data_ptr(), c.outputs[0].data_ptr(), table_of(c),
                      as_cuda(ctx.stream).handle());
}

void run_dropout(const OpCall& c, ExecContext& ctx) {
  const Tensor& x = c.inputs[0];  // (T, C)
  launch_segment_dropout(x.dtype(), x.size(0), x.size(1), x.data_ptr(), c.outputs[0].data_ptr(), table_of(c),
                         as_cuda(ctx.stream).handle());
}

}  // namespace

void register_cuda_segment_kernels(KernelRegistry& r) {
  for (DType dt : {DType::F32, DType::F64, DType::BF16, DType::F16}) {
    r.add(KernelDef{OpId::segment_mask, DeviceType::CUDA, dt, "cuda/segment_mask", segment_supports, run_segment_mask});
    r.add(KernelDef{OpId::dropout, DeviceType::CUDA, dt, "cuda/segment_dropout", segment_supports, run_dropout});
  }
}

}  // namespace lathe::cuda
