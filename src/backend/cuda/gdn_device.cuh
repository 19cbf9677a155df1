// Device helpers shared by the Gated DeltaNet CUDA files (gated_delta.cu: the delta rule; gdn_pointwise.cu: sigmoid,
// the log-decay and the conv1d): the float-dtype dispatch and the packed documents of a cu_seqlens array.
// Internal to those files (an unnamed namespace: one copy per translation unit).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "core/dtype.h"

namespace lathe::cuda {

namespace {

constexpr int kThreads = 256;

template <typename F> void dispatch_float(DType dt, F f) {
  switch (dt) {
    case DType::F32: f(float{}); return;
    case DType::BF16: f(__nv_bfloat16{}); return;
    case DType::F16: f(__half{}); return;
    default: return;  // the registration offers these three only
  }
}

// ---------------------------------------------------------------------------------------------------- documents
// Document d is tokens [start, end), clamped into [0, tokens] and non-decreasing.
struct Span {
  int64_t start, end;
};
__device__ __forceinline__ Span doc_span(const int32_t* cu, int64_t d, int64_t tokens) {
  int64_t s = cu[d], e = cu[d + 1];
  s = s < 0 ? 0 : (s > tokens ? tokens : s);
  e = e < s ? s : (e > tokens ? tokens : e);
  return {s, e};
}

// Document of token i: the last d with cu[d] <= i (binary search), as a clamped span containing i.
__device__ __forceinline__ Span doc_of_token(const int32_t* cu, int64_t docs, int64_t i, int64_t tokens) {
  int64_t lo = 0, hi = docs + 1;  // first index with cu[idx] > i
  while (lo < hi) {
    const int64_t mid = (lo + hi) / 2;
    if (cu[mid] <= i) lo = mid + 1;
    else hi = mid;
  }
  int64_t s = lo > 0 ? cu[lo - 1] : 0, e = lo <= docs ? cu[lo] : tokens;
  s = s < 0 ? 0 : (s > i ? i : s);
  e = e <= i ? i + 1 : (e > tokens ? tokens : e);
  return {s, e};
}

}  // namespace

}  // namespace lathe::cuda
