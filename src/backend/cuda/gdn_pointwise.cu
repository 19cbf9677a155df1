// CUDA kernels of the Gated DeltaNet's pointwise and short-range ops: sigmoid, the log-decay
// g = -exp(A_log) softplus(a + dt_bias) and the packed depthwise causal conv1d, forward and backward, for f32, bf16 and
// f16 (float math). Packed documents come through cu_seqlens on the device; the reductions (the decay's dA_log and
// ddt_bias, the conv's dw) run in a fixed order, so every output is bitwise reproducible. The delta rule itself is in
// gated_delta.cu; the launchers are declared in gated_delta_launchers.h.
// Covered by tests/ops (testing/op_cases_gated_delta.cpp) and tests/models/test_qwen3_5_cuda.cpp.
#include <initializer_list>
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
// A block covers kConvThreads x kV consecutive channels of one slab of consecutive tokens; each thread walks its kV
// channels (a 16-byte pack when the channel count and buffers allow, else one channel) along the slab keeping a
// sliding window of the last W inputs in registers, so every input is loaded once, a warp moves 16 bytes a lane per
// token, and a document's span is looked up only where a document starts. kW > 0 is the width at compile time (the
// model's 4, and 2, 3); kW = 0 takes any width up to kMaxConvWidth at run time (taps past it are zero).
// Window convention: win[v][k] = channel v's input k tokens back (k = 0 newest); y[t] = sum_k tap[v][k] win[v][k],
// tap[v][k] = w[c + v, W-1-k].
constexpr int kConvThreads = 128;
constexpr int kConvTokens = 64;

template <int kW>
__device__ __forceinline__ int conv_taps(int width) { return kW > 0 ? kW : width; }

// Shifts each channel's window by one token and puts the pack's value in front.
template <int kN, int kV, typename T>
__device__ __forceinline__ void conv_push(float (&win)[kV][kN], const Pack<T, kV>& x) {
#pragma unroll
  for (int v = 0; v < kV; ++v) {
#pragma unroll
    for (int k = kN - 1; k > 0; --k) win[v][k] = win[v][k - 1];
    win[v][0] = float(load(x.e, v));
  }
}

template <int kN, int kV> __device__ __forceinline__ void conv_clear(float (&win)[kV][kN]) {
#pragma unroll
  for (int v = 0; v < kV; ++v)
#pragma unroll
    for (int k = 0; k < kN; ++k) win[v][k] = 0.0f;
}

// tap[v][k] = w[c + v, W-1-k] (zero past the width).
template <int kN, int kV, typename T>
__device__ __forceinline__ void conv_load_taps(const T* w, int64_t c, int width, float (&tap)[kV][kN]) {
#pragma unroll
  for (int v = 0; v < kV; ++v)
#pragma unroll
    for (int k = 0; k < kN; ++k) tap[v][k] = k < width ? float(load(w, (c + v) * width + (width - 1 - k))) : 0.0f;
}

// sum_k tap[v][k] win[v][k] for each channel of the pack.
template <int kN, int kV, typename T>
__device__ __forceinline__ Pack<T, kV> conv_dot(const float (&tap)[kV][kN], const float (&win)[kV][kN]) {
  Pack<T, kV> out;
#pragma unroll
  for (int v = 0; v < kV; ++v) {
    float acc = 0;
#pragma unroll
    for (int k = 0; k < kN; ++k) acc += tap[v][k] * win[v][k];
    store(out.e, v, acc);
  }
  return out;
}

// Walks channels [c, c + kV) of x forwards over tokens [t0, t1): for each t, pushes x[t] into the window (which holds
// the inputs before t inside t's document, zero before its start) and calls step(t, win).
template <int kN, int kV, typename T, typename F>
__device__ __forceinline__ void conv_walk_forward(const T* x, int64_t ch, int64_t c, int64_t t0, int64_t t1,
                                                  const int32_t* cu, int64_t docs, int64_t tokens, F&& step) {
  float win[kV][kN];
  conv_clear(win);
  Span doc = doc_of_token(cu, docs, t0, tokens);
  for (int k = kN - 1; k >= 0; --k) {  // history before t0, oldest first: x[t0 - 1 - k] inside the document
    const int64_t s = t0 - 1 - k;
    Pack<T, kV> xs{};
    if (s >= doc.start) xs = load_pack<T, kV>(x + s * ch + c);
    conv_push(win, xs);
  }
  for (int64_t t = t0; t < t1; ++t) {
    if (t == doc.end) {  // a new document: no history
      doc = doc_of_token(cu, docs, t, tokens);
      conv_clear(win);
    }
    conv_push(win, load_pack<T, kV>(x + t * ch + c));
    step(t, win);
  }
}

template <typename T, int kW, int kV>
__global__ void conv_kernel(int64_t tokens, int64_t ch, int width_arg, int64_t docs, const T* x, const T* w,
                            const int32_t* cu, T* y) {
  constexpr int kN = kW > 0 ? kW : int(kMaxConvWidth);
  const int width = conv_taps<kW>(width_arg);
  const int64_t c = (blockIdx.x * int64_t(kConvThreads) + threadIdx.x) * kV;
  if (c >= ch) return;
  float tap[kV][kN];
  conv_load_taps(w, c, width, tap);
  const int64_t t0 = blockIdx.y * int64_t(kConvTokens);
  const int64_t t1 = t0 + kConvTokens < tokens ? t0 + kConvTokens : tokens;
  conv_walk_forward<kN, kV>(x, ch, c, t0, t1, cu, docs, tokens, [&](int64_t t, const float (&win)[kV][kN]) {
    store_pack(y + t * ch + c, conv_dot<kN, kV, T>(tap, win));
  });
}

// dx[s, c] = sum_k tap[k] dy[s + k, c] over targets inside s's document; walks the slab downwards with the window
// win[v][k] = dy[s + k].
template <typename T, int kW, int kV>
__global__ void conv_dx_kernel(int64_t tokens, int64_t ch, int width_arg, int64_t docs, const T* w, const T* dy,
                               const int32_t* cu, T* dx) {
  constexpr int kN = kW > 0 ? kW : int(kMaxConvWidth);
  const int width = conv_taps<kW>(width_arg);
  const int64_t c = (blockIdx.x * int64_t(kConvThreads) + threadIdx.x) * kV;
  if (c >= ch) return;
  float tap[kV][kN], win[kV][kN];
  conv_load_taps(w, c, width, tap);
  conv_clear(win);
  const int64_t s0 = blockIdx.y * int64_t(kConvTokens);
  const int64_t s1 = s0 + kConvTokens < tokens ? s0 + kConvTokens : tokens;
  Span doc = doc_of_token(cu, docs, s1 - 1, tokens);
  for (int k = kN - 1; k >= 0; --k) {  // the future after s1 - 1, farthest first: dy[s1 + k] inside the document
    const int64_t t = s1 + k;
    Pack<T, kV> d{};
    if (t < doc.end) d = load_pack<T, kV>(dy + t * ch + c);
    conv_push(win, d);
  }
  for (int64_t s = s1 - 1; s >= s0; --s) {
    if (s < doc.start) {  // the previous document: nothing after its end
      doc = doc_of_token(cu, docs, s, tokens);
      conv_clear(win);
    }
    conv_push(win, load_pack<T, kV>(dy + s * ch + c));
    store_pack(dx + s * ch + c, conv_dot<kN, kV, T>(tap, win));
  }
}

// dw[c, W-1-k] = sum_t dy[t, c] x[t - k, c], in two fixed-order passes: each (channel block, token slab) sums its
// slab into partial[slab][c][j] (fp32), then conv_dw_sum_kernel adds the slabs in order.
template <typename T, int kW, int kV>
__global__ void conv_dw_partial_kernel(int64_t tokens, int64_t ch, int width_arg, int64_t docs, int64_t slab,
                                       const T* x, const T* dy, const int32_t* cu, float* partial) {
  constexpr int kN = kW > 0 ? kW : int(kMaxConvWidth);
  const int width = conv_taps<kW>(width_arg);
  const int64_t c = (blockIdx.x * int64_t(kConvThreads) + threadIdx.x) * kV;
  if (c >= ch) return;
  float acc[kV][kN];
  conv_clear(acc);
  const int64_t t0 = blockIdx.y * slab;
  const int64_t t1 = t0 + slab < tokens ? t0 + slab : tokens;
  conv_walk_forward<kN, kV>(x, ch, c, t0, t1, cu, docs, tokens, [&](int64_t t, const float (&win)[kV][kN]) {
    const Pack<T, kV> d = load_pack<T, kV>(dy + t * ch + c);
#pragma unroll
    for (int v = 0; v < kV; ++v) {
      const float dv = float(load(d.e, v));
#pragma unroll
      for (int k = 0; k < kN; ++k) acc[v][k] += dv * win[v][k];
    }
  });
  for (int v = 0; v < kV; ++v) {
    float* out = partial + (blockIdx.y * ch + c + v) * width;
    for (int k = 0; k < width; ++k) out[width - 1 - k] = acc[v][k < kN ? k : 0];
  }
}

template <typename T>
__global__ void conv_dw_sum_kernel(int64_t n, int64_t slabs, const float* partial, T* dw) {
  const int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;  // i = c * width + j
  if (i >= n) return;
  float s = 0;
  for (int64_t k = 0; k < slabs; ++k) s += partial[k * n + i];
  store(dw, i, s);
}

// Calls f(std::integral_constant<int, kV>): the channels a thread takes, a 16-byte pack where the width is known at
// compile time (kW > 0; a run-time width keeps kMaxConvWidth taps a channel, which would spill), the channel count is a
// multiple of the pack and every listed buffer is 16-byte aligned, else 1.
template <typename T, int kW, typename F>
void dispatch_conv_pack(int64_t channels, std::initializer_list<const void*> bufs, F f) {
  constexpr int kV = kPackOf16<T>;
  bool packed = kW > 0 && channels % kV == 0;
  for (const void* p : bufs) packed = packed && aligned16(p);
  if constexpr (kW > 0) {
    if (packed) {
      f(std::integral_constant<int, kV>{});
      return;
    }
  }
  f(std::integral_constant<int, 1>{});
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
  dispatch_float(dtype, [&](auto tag) {
    using T = decltype(tag);
    dispatch_conv_width(width, [&](auto kw) {
      constexpr int kW = decltype(kw)::value;
      dispatch_conv_pack<T, kW>(channels, {x, y}, [&](auto pack) {
        constexpr int kV = decltype(pack)::value;
        const int64_t per_block = int64_t(kConvThreads) * kV;
        const dim3 grid(unsigned((channels + per_block - 1) / per_block),
                        unsigned((tokens + kConvTokens - 1) / kConvTokens));
        conv_kernel<T, kW, kV><<<grid, kConvThreads, 0, stream>>>(tokens, channels, int(width), docs,
                                                                  static_cast<const T*>(x), static_cast<const T*>(w),
                                                                  cu, static_cast<T*>(y));
      });
    });
  });
  LATHE_CUDA_LAUNCH_CHECK("causal_conv1d_kernel");
}

// Token slabs of the dw partial sums: about 128 tokens each (up to 512 slabs), so that the blocks of 128 threads x 16-byte
// channel packs still fill the GPU (8,192 tokens x 6,144 channels: 6 x 64 blocks).
int64_t conv_dw_slabs(int64_t tokens) {
  const int64_t slabs = (tokens + 127) / 128;
  return slabs < 1 ? 1 : (slabs < 512 ? slabs : 512);
}

size_t conv_backward_workspace_bytes(int64_t tokens, int64_t channels, int64_t width) {
  return size_t(conv_dw_slabs(tokens) * channels * width) * sizeof(float);
}

void launch_causal_conv1d_backward(DType dtype, int64_t tokens, int64_t channels, int64_t width, int64_t docs,
                                   const void* x, const void* w, const void* dy, const int32_t* cu, void* dx, void* dw,
                                   void* workspace, cudaStream_t stream) {
  if (channels == 0) return;
  const int64_t slabs = conv_dw_slabs(tokens), slab = (tokens + slabs - 1) / slabs;
  float* partial = static_cast<float*>(workspace);
  dispatch_float(dtype, [&](auto tag) {
    using T = decltype(tag);
    if (tokens > 0) {
      dispatch_conv_width(width, [&](auto kw) {
        constexpr int kW = decltype(kw)::value;
        dispatch_conv_pack<T, kW>(channels, {x, dy, dx}, [&](auto pack) {
          constexpr int kV = decltype(pack)::value;
          const int64_t per_block = int64_t(kConvThreads) * kV;
          const unsigned cblocks = unsigned((channels + per_block - 1) / per_block);
          conv_dx_kernel<T, kW, kV><<<dim3(cblocks, unsigned((tokens + kConvTokens - 1) / kConvTokens)),
                                      kConvThreads, 0, stream>>>(tokens, channels, int(width), docs,
                                                                 static_cast<const T*>(w), static_cast<const T*>(dy),
                                                                 cu, static_cast<T*>(dx));
          LATHE_CUDA_LAUNCH_CHECK("causal_conv1d_dx_kernel");
          conv_dw_partial_kernel<T, kW, kV><<<dim3(cblocks, unsigned(slabs)), kConvThreads, 0, stream>>>(
              tokens, channels, int(width), docs, slab, static_cast<const T*>(x), static_cast<const T*>(dy), cu,
              partial);
          LATHE_CUDA_LAUNCH_CHECK("causal_conv1d_dw_partial_kernel");
        });
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
