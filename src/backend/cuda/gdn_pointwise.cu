// CUDA kernels of the Gated DeltaNet's pointwise and short-range ops: sigmoid, the log-decay
// g = -exp(A_log) softplus(a + dt_bias) and the packed depthwise causal conv1d, forward and backward, for f32, bf16 and
// f16 (float math). Packed documents come through cu_seqlens on the device; the reductions (the decay's dA_log and
// ddt_bias, the conv's dw) run in a fixed order, so every output is bitwise reproducible. The delta rule itself is in
// gated_delta.cu; the launchers are declared in gated_delta_launchers.h.
// Covered by tests/ops (testing/op_cases_gated_delta.cpp) and tests/models/test_qwen3_5_cuda.cpp.
#include <type_traits>

#include "backend/cuda/check.h"
#include "backend/cuda/device_math.cuh"
#include "backend/cuda/gated_delta_launchers.h"
#include "backend/cuda/gdn_device.cuh"

namespace lathe::cuda {

namespace {

// ------------------------------------------------------------------------------------------- sigmoid, decay
template <typename T> __global__ void sigmoid_kernel(int64_t n, const T* x, T* y) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
    store(y, i, 1.0f / (1.0f + __expf(-load(x, i))));
}

template <typename T> __global__ void sigmoid_backward_kernel(int64_t n, const T* y, const T* dy, T* dx) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    const float s = load(y, i);
    store(dx, i, load(dy, i) * s * (1.0f - s));
  }
}

__device__ __forceinline__ float softplus(float x) { return fmaxf(x, 0.0f) + log1pf(__expf(-fabsf(x))); }

template <typename T>
__global__ void decay_kernel(int64_t tokens, int64_t heads, const T* a, const T* a_log, const T* dt, T* g) {
  const int64_t n = tokens * heads;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t h = i % heads;
    store(g, i, -expf(load(a_log, h)) * softplus(load(a, i) + load(dt, h)));
  }
}

// One block per head: da elementwise, dA_log and ddt_bias as fixed-order block reductions over the tokens.
template <typename T>
__global__ void decay_backward_kernel(int64_t tokens, int64_t heads, const T* a, const T* a_log, const T* dt,
                                      const T* dg, T* da, T* d_alog, T* d_dt) {
  __shared__ float scratch[32];
  const int64_t h = blockIdx.x;
  const float e = expf(load(a_log, h)), bias = load(dt, h);
  float s_alog = 0, s_dt = 0;
  for (int64_t t = threadIdx.x; t < tokens; t += blockDim.x) {
    const int64_t i = t * heads + h;
    const float x = load(a, i) + bias, dgv = load(dg, i);
    const float dav = -dgv * e / (1.0f + __expf(-x));
    store(da, i, dav);
    s_dt += dav;
    s_alog += dgv * (-e * softplus(x));
  }
  s_alog = block_reduce<float, false>(s_alog, scratch);
  s_dt = block_reduce<float, false>(s_dt, scratch);
  if (threadIdx.x == 0) {
    store(d_alog, h, s_alog);
    store(d_dt, h, s_dt);
  }
}

// --------------------------------------------------------------------------------------------------- conv1d
// A block covers kConvChannels consecutive channels (coalesced) of one slab of consecutive tokens; each thread walks
// its channel along the slab keeping a sliding window of the last W inputs in registers, so every input is loaded
// once and a document's span is looked up only where a document starts. kW > 0 is the width at compile time (the
// model's 4, and 2, 3); kW = 0 takes any width up to kMaxConvWidth at run time (taps past it are zero).
// Window convention: win[k] = the input k tokens back (k = 0 newest); y[t] = sum_k tap[k] win[k], tap[k] = w[c, W-1-k].
constexpr int kConvChannels = 128;
constexpr int kConvTokens = 64;

template <int kW>
__device__ __forceinline__ int conv_taps(int width) { return kW > 0 ? kW : width; }

// Shifts the window by one token and puts `v` in front.
template <int kN>
__device__ __forceinline__ void conv_push(float (&win)[kN], float v) {
#pragma unroll
  for (int k = kN - 1; k > 0; --k) win[k] = win[k - 1];
  win[0] = v;
}

// tap[k] = w[c, W-1-k] (zero past the width).
template <int kN, typename T>
__device__ __forceinline__ void conv_load_taps(const T* w, int64_t c, int width, float (&tap)[kN]) {
#pragma unroll
  for (int k = 0; k < kN; ++k) tap[k] = k < width ? float(load(w, c * width + (width - 1 - k))) : 0.0f;
}

// Walks channel c of x forwards over tokens [t0, t1): for each t, pushes x[t] into the window (which holds the inputs
// before t inside t's document, zero before its start) and calls step(t, win).
template <int kN, typename T, typename F>
__device__ __forceinline__ void conv_walk_forward(const T* x, int64_t ch, int64_t c, int64_t t0, int64_t t1,
                                                  const int32_t* cu, int64_t docs, int64_t tokens, F&& step) {
  float win[kN];
  Span doc = doc_of_token(cu, docs, t0, tokens);
#pragma unroll
  for (int k = 0; k < kN; ++k) {  // history before t0: win[k] = x[t0 - 1 - k] inside the document
    const int64_t s = t0 - 1 - k;
    win[k] = s >= doc.start ? float(load(x, s * ch + c)) : 0.0f;
  }
  for (int64_t t = t0; t < t1; ++t) {
    if (t == doc.end) {  // a new document: no history
      doc = doc_of_token(cu, docs, t, tokens);
#pragma unroll
      for (int k = 0; k < kN; ++k) win[k] = 0.0f;
    }
    conv_push(win, float(load(x, t * ch + c)));
    step(t, win);
  }
}

template <typename T, int kW>
__global__ void conv_kernel(int64_t tokens, int64_t ch, int width_arg, int64_t docs, const T* x, const T* w,
                            const int32_t* cu, T* y) {
  constexpr int kN = kW > 0 ? kW : int(kMaxConvWidth);
  const int width = conv_taps<kW>(width_arg);
  const int64_t c = blockIdx.x * int64_t(kConvChannels) + threadIdx.x;
  if (c >= ch) return;
  float tap[kN];
  conv_load_taps(w, c, width, tap);
  const int64_t t0 = blockIdx.y * int64_t(kConvTokens);
  const int64_t t1 = t0 + kConvTokens < tokens ? t0 + kConvTokens : tokens;
  conv_walk_forward<kN>(x, ch, c, t0, t1, cu, docs, tokens, [&](int64_t t, const float (&win)[kN]) {
    float acc = 0;
#pragma unroll
    for (int k = 0; k < kN; ++k) acc += tap[k] * win[k];
    store(y, t * ch + c, acc);
  });
}

// dx[s, c] = sum_k tap[k] dy[s + k, c] over targets inside s's document; walks the slab downwards with the window
// win[k] = dy[s + k].
template <typename T, int kW>
__global__ void conv_dx_kernel(int64_t tokens, int64_t ch, int width_arg, int64_t docs, const T* w, const T* dy,
                               const int32_t* cu, T* dx) {
  constexpr int kN = kW > 0 ? kW : int(kMaxConvWidth);
  const int width = conv_taps<kW>(width_arg);
  const int64_t c = blockIdx.x * int64_t(kConvChannels) + threadIdx.x;
  if (c >= ch) return;
  float tap[kN], win[kN];
  conv_load_taps(w, c, width, tap);
  const int64_t s0 = blockIdx.y * int64_t(kConvTokens);
  const int64_t s1 = s0 + kConvTokens < tokens ? s0 + kConvTokens : tokens;
  Span doc = doc_of_token(cu, docs, s1 - 1, tokens);
#pragma unroll
  for (int k = 0; k < kN; ++k) {  // the future after s1 - 1: win[k] = dy[s1 + k] inside the document
    const int64_t t = s1 + k;
    win[k] = t < doc.end ? float(load(dy, t * ch + c)) : 0.0f;
  }
  for (int64_t s = s1 - 1; s >= s0; --s) {
    if (s < doc.start) {  // the previous document: nothing after its end
      doc = doc_of_token(cu, docs, s, tokens);
#pragma unroll
      for (int k = 0; k < kN; ++k) win[k] = 0.0f;
    }
    conv_push(win, float(load(dy, s * ch + c)));
    float acc = 0;
#pragma unroll
    for (int k = 0; k < kN; ++k) acc += tap[k] * win[k];
    store(dx, s * ch + c, acc);
  }
}

// dw[c, W-1-k] = sum_t dy[t, c] x[t - k, c], in two fixed-order passes: each (channel block, token slab) sums its
// slab into partial[slab][c][j] (fp32), then conv_dw_sum_kernel adds the slabs in order.
template <typename T, int kW>
__global__ void conv_dw_partial_kernel(int64_t tokens, int64_t ch, int width_arg, int64_t docs, int64_t slab,
                                       const T* x, const T* dy, const int32_t* cu, float* partial) {
  constexpr int kN = kW > 0 ? kW : int(kMaxConvWidth);
  const int width = conv_taps<kW>(width_arg);
  const int64_t c = blockIdx.x * int64_t(kConvChannels) + threadIdx.x;
  if (c >= ch) return;
  float acc[kN];
#pragma unroll
  for (int k = 0; k < kN; ++k) acc[k] = 0.0f;
  const int64_t t0 = blockIdx.y * slab;
  const int64_t t1 = t0 + slab < tokens ? t0 + slab : tokens;
  conv_walk_forward<kN>(x, ch, c, t0, t1, cu, docs, tokens, [&](int64_t t, const float (&win)[kN]) {
    const float d = load(dy, t * ch + c);
#pragma unroll
    for (int k = 0; k < kN; ++k) acc[k] += d * win[k];
  });
  float* out = partial + (blockIdx.y * ch + c) * width;
  for (int k = 0; k < width; ++k) out[width - 1 - k] = acc[k < kN ? k : 0];
}

template <typename T>
__global__ void conv_dw_sum_kernel(int64_t n, int64_t slabs, const float* partial, T* dw) {
  const int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;  // i = c * width + j
  if (i >= n) return;
  float s = 0;
  for (int64_t k = 0; k < slabs; ++k) s += partial[k * n + i];
  store(dw, i, s);
}

// Calls f(std::integral_constant<int, W>) with the compile-time width for 2, 3, 4 and 0 (run time) otherwise.
template <typename F>
void dispatch_conv_width(int64_t width, F f) {
  switch (width) {
    case 2: f(std::integral_constant<int, 2>{}); break;
    case 3: f(std::integral_constant<int, 3>{}); break;
    case 4: f(std::integral_constant<int, 4>{}); break;
    default: f(std::integral_constant<int, 0>{}); break;
  }
}

}  // namespace

void launch_sigmoid(DType dtype, int64_t n, const void* x, void* y, cudaStream_t stream) {
  dispatch_float(dtype, [&](auto tag) {
    using T = decltype(tag);
    sigmoid_kernel<T><<<grid_for(n, kThreads), kThreads, 0, stream>>>(n, static_cast<const T*>(x), static_cast<T*>(y));
  });
  LATHE_CUDA_LAUNCH_CHECK("sigmoid_kernel");
}

void launch_sigmoid_backward(DType dtype, int64_t n, const void* y, const void* dy, void* dx, cudaStream_t stream) {
  dispatch_float(dtype, [&](auto tag) {
    using T = decltype(tag);
    sigmoid_backward_kernel<T><<<grid_for(n, kThreads), kThreads, 0, stream>>>(
        n, static_cast<const T*>(y), static_cast<const T*>(dy), static_cast<T*>(dx));
  });
  LATHE_CUDA_LAUNCH_CHECK("sigmoid_backward_kernel");
}

void launch_causal_conv1d(DType dtype, int64_t tokens, int64_t channels, int64_t width, int64_t docs, const void* x,
                          const void* w, const int32_t* cu, void* y, cudaStream_t stream) {
  if (tokens == 0 || channels == 0) return;
  const dim3 grid(unsigned((channels + kConvChannels - 1) / kConvChannels), unsigned((tokens + kConvTokens - 1) / kConvTokens));
  dispatch_float(dtype, [&](auto tag) {
    using T = decltype(tag);
    dispatch_conv_width(width, [&](auto kw) {
      conv_kernel<T, decltype(kw)::value><<<grid, kConvChannels, 0, stream>>>(
          tokens, channels, int(width), docs, static_cast<const T*>(x), static_cast<const T*>(w), cu, static_cast<T*>(y));
    });
  });
  LATHE_CUDA_LAUNCH_CHECK("causal_conv1d_kernel");
}

int64_t conv_dw_slabs(int64_t tokens) { return tokens < 256 ? 1 : (tokens + 255) / 256 < 256 ? (tokens + 255) / 256 : 256; }

size_t conv_backward_workspace_bytes(int64_t tokens, int64_t channels, int64_t width) {
  return size_t(conv_dw_slabs(tokens) * channels * width) * sizeof(float);
}

void launch_causal_conv1d_backward(DType dtype, int64_t tokens, int64_t channels, int64_t width, int64_t docs,
                                   const void* x, const void* w, const void* dy, const int32_t* cu, void* dx, void* dw,
                                   void* workspace, cudaStream_t stream) {
  if (channels == 0) return;
  const int64_t slabs = conv_dw_slabs(tokens), slab = (tokens + slabs - 1) / slabs;
  const unsigned cblocks = unsigned((channels + kConvChannels - 1) / kConvChannels);
  float* partial = static_cast<float*>(workspace);
  dispatch_float(dtype, [&](auto tag) {
    using T = decltype(tag);
    if (tokens > 0) {
      dispatch_conv_width(width, [&](auto kw) {
        constexpr int kW = decltype(kw)::value;
        conv_dx_kernel<T, kW><<<dim3(cblocks, unsigned((tokens + kConvTokens - 1) / kConvTokens)), kConvChannels, 0,
                                stream>>>(tokens, channels, int(width), docs, static_cast<const T*>(w),
                                          static_cast<const T*>(dy), cu, static_cast<T*>(dx));
        LATHE_CUDA_LAUNCH_CHECK("causal_conv1d_dx_kernel");
        conv_dw_partial_kernel<T, kW><<<dim3(cblocks, unsigned(slabs)), kConvChannels, 0, stream>>>(
            tokens, channels, int(width), docs, slab, static_cast<const T*>(x), static_cast<const T*>(dy), cu, partial);
        LATHE_CUDA_LAUNCH_CHECK("causal_conv1d_dw_partial_kernel");
      });
    }
    const int64_t n = channels * width;
    conv_dw_sum_kernel<T><<<grid_for(n, kThreads), kThreads, 0, stream>>>(n, tokens > 0 ? slabs : 0, partial,
                                                                             static_cast<T*>(dw));
    LATHE_CUDA_LAUNCH_CHECK("causal_conv1d_dw_sum_kernel");
  });
}

void launch_gdn_decay(DType dtype, int64_t tokens, int64_t heads, const void* a, const void* a_log,
                      const void* dt_bias, void* g, cudaStream_t stream) {
  dispatch_float(dtype, [&](auto tag) {
    using T = decltype(tag);
    decay_kernel<T><<<grid_for(tokens * heads, kThreads), kThreads, 0, stream>>>(
        tokens, heads, static_cast<const T*>(a), static_cast<const T*>(a_log), static_cast<const T*>(dt_bias),
        static_cast<T*>(g));
  });
  LATHE_CUDA_LAUNCH_CHECK("gdn_decay_kernel");
}

void launch_gdn_decay_backward(DType dtype, int64_t tokens, int64_t heads, const void* a, const void* a_log,
                               const void* dt_bias, const void* dg, void* da, void* d_a_log, void* d_dt_bias,
                               cudaStream_t stream) {
  dispatch_float(dtype, [&](auto tag) {
    using T = decltype(tag);
    decay_backward_kernel<T><<<unsigned(heads), kThreads, 0, stream>>>(
        tokens, heads, static_cast<const T*>(a), static_cast<const T*>(a_log), static_cast<const T*>(dt_bias),
        static_cast<const T*>(dg), static_cast<T*>(da), static_cast<T*>(d_a_log), static_cast<T*>(d_dt_bias));
  });
  LATHE_CUDA_LAUNCH_CHECK("gdn_decay_backward_kernel");
}

}  // namespace lathe::cuda
