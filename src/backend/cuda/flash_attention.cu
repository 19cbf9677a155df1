// Tiled causal attention over packed documents on tensor cores (flash-attention-2 algorithm; mma.sync
// m16n8k16 with bf16/f16 operands and fp32 accumulation; ldmatrix from shared memory; cp.async double
// buffering), head dims 64, 128 and 256. Forward: o and lse with an online softmax in base 2. Backward, three
// kernels and no atomics (bitwise repeatable): row statistics (D_i = do_i . o_i, lse * log2 e); dK/dV per key
// tile, looping over the q heads of its GQA group and the query tiles after it in a fixed order; dQ per query
// tile, looping over the key tiles before it.
// Conventions: a tile is a run of consecutive tokens of ONE document, counted from the document's start; each
// CTA finds its (document, tile) from cu_seqlens on the device, so a launch needs only shapes (no host copy,
// graph-capturable). Each warp owns 16 or 32 rows of the tile's left operand (queries, or keys in dK/dV), so
// softmax statistics and accumulators never leave a warp. Shared tiles hold rows of D elements with the 16-byte chunks
// XOR-swizzled by (row & 7): the 8 row addresses of one ldmatrix land in 8 different bank groups.
// Covered by tests/ops (op_cases.cpp attention cases with D = 64/128/256 against the CPU reference).
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "backend/cuda/check.h"
#include "backend/cuda/flash_attention.h"

namespace lathe::cuda {

namespace {

constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;
constexpr unsigned kFullMask = 0xffffffffu;

// Tile shapes per head dim. Forward and dQ: a CTA of kWarps warps, each owning 16 * kRows queries (kRows row
// tiles share every K/V fragment read from shared memory), streams key tiles of kKeys. dK/dV: 16 * kDkdvWarps /
// kDkdvSplit keys per CTA, query tiles of kDkdvQueries; with kDkdvSplit = 2 two warps share 16 keys, each
// accumulating half of the head dim (D = 256 would need 256 accumulator registers a thread otherwise): each computes
// the scores of those keys for half of the query tile, and the two swap their halves of P and dS through shared
// memory.
template <int D> struct FlashConfig;
template <> struct FlashConfig<64> {
  static constexpr int kFwdWarps = 4, kFwdRows = 2, kFwdKeys = 64, kFwdMinBlocks = 2;
  static constexpr int kDkdvWarps = 8, kDkdvQueries = 64, kDkdvSplit = 1;
  static constexpr int kDqWarps = 8, kDqRows = 1, kDqKeys = 64;
};
template <> struct FlashConfig<128> {  // each the fastest of bench/attention_tiles_lab's shapes on an H100
  static constexpr int kFwdWarps = 4, kFwdRows = 2, kFwdKeys = 32, kFwdMinBlocks = 1;
  static constexpr int kDkdvWarps = 4, kDkdvQueries = 64, kDkdvSplit = 1;  // 128 B of spills, still 12% faster
  static constexpr int kDqWarps = 8, kDqRows = 1, kDqKeys = 64;
};
// D = 256: the fastest of attention_tiles_lab_256's shapes on an H200 at Qwen3.5-0.8B's attention (8,192 tokens in 2
// documents, 8 q / 2 kv heads): dK/dV 1.48 ms (W8, 64 queries; 32 queries took 1.63), dQ 0.78 ms (W8; W4 took 1.00).
template <> struct FlashConfig<256> {
  static constexpr int kFwdWarps = 4, kFwdRows = 1, kFwdKeys = 32, kFwdMinBlocks = 1;
  static constexpr int kDkdvWarps = 8, kDkdvQueries = 64, kDkdvSplit = 2;
  static constexpr int kDqWarps = 8, kDqRows = 1, kDqKeys = 32;
};

// ---------------------------------------------------------------- PTX wrappers

__device__ __forceinline__ uint32_t smem_addr(const void* p) { return uint32_t(__cvta_generic_to_shared(p)); }

// 16 bytes global -> shared, zero-filled when !valid (src must still be a valid address).
__device__ __forceinline__ void cp_async16(uint32_t dst, const void* src, bool valid) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(valid ? 16 : 0));
}
__device__ __forceinline__ void cp_async4(uint32_t dst, const void* src, bool valid) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(dst), "l"(src), "r"(valid ? 4 : 0));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N> __device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N)); }

__device__ __forceinline__ void ldsm_x4(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}
__device__ __forceinline__ void ldsm_x4_trans(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}

// 2^x in one MUFU instruction (2 ulp; flushes subnormal results to zero; 2^-inf = 0).
__device__ __forceinline__ float exp2_approx(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

// c (16x8 f32) += a (16x16, row) * b (16x8, col).
template <typename T>
__device__ __forceinline__ void mma16816(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1);
template <>
__device__ __forceinline__ void mma16816<__nv_bfloat16>(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
               "{%0, %1, %2, %3};\n"
               : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
template <>
__device__ __forceinline__ void mma16816<__half>(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
               "{%0, %1, %2, %3};\n"
               : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// Two floats as one register of two 16-bit values, `lo` in the low half (the A/C fragment column order).
template <typename T> __device__ __forceinline__ uint32_t pack2(float lo, float hi);
template <> __device__ __forceinline__ uint32_t pack2<__nv_bfloat16>(float lo, float hi) {
  __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&v);
}
template <> __device__ __forceinline__ uint32_t pack2<__half>(float lo, float hi) {
  __half2 v = __floats2half2_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&v);
}

template <typename T> __device__ __forceinline__ float to_float(T x);
template <> __device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }
template <> __device__ __forceinline__ float to_float(__half x) { return __half2float(x); }

// ---------------------------------------------------------------- shared-memory tiles

// Byte offset of element (row, col) of a swizzled tile of rows of D elements; col is a multiple of 8.
template <int D, typename T> __device__ __forceinline__ uint32_t tile_offset(int row, int col) {
  return uint32_t((row * D + (((col >> 3) ^ (row & 7)) << 3)) * int(sizeof(T)));
}

// Starts the copy of rows [first, first + ROWS) of a (tokens, heads, D) tensor, `g` already offset to the
// head, row stride `stride` elements. Rows at or past `limit` are zero-filled.
template <int ROWS, int D, int THREADS, typename T>
__device__ __forceinline__ void load_tile(T* s, const T* g, int64_t first, int64_t limit, int64_t stride) {
  constexpr int kChunks = D / 8, kTotal = ROWS * kChunks;
  static_assert(kTotal % THREADS == 0, "tile copy must divide evenly over the threads");
  const uint32_t base = smem_addr(s);
#pragma unroll
  for (int it = 0; it < kTotal / THREADS; ++it) {
    const int c = it * THREADS + int(threadIdx.x);
    const int r = c / kChunks, ch = c % kChunks;
    const int64_t row = first + r;
    const bool valid = row < limit;
    cp_async16(base + uint32_t((r * D + ((ch ^ (r & 7)) << 3)) * int(sizeof(T))), g + (valid ? row * stride + ch * 8 : 0),
               valid);
  }
}

// A fragment (16 rows x 16 cols, rows r0.., cols c0..) of a row-major swizzled tile.
template <int D, typename T>
__device__ __forceinline__ void load_a(uint32_t (&a)[4], uint32_t base, int r0, int c0, int lane) {
  ldsm_x4(a, base + tile_offset<D, T>(r0 + (lane & 15), c0 + (lane >> 4) * 8));
}
// B fragments of two n8 tiles for X * tile^T: rows n0..n0+15 of the tile are the n index, cols c0..c0+15 the
// k index. b[0], b[1] serve n-tile n0..n0+7; b[2], b[3] n-tile n0+8..n0+15.
template <int D, typename T>
__device__ __forceinline__ void load_b_nt(uint32_t (&b)[4], uint32_t base, int n0, int c0, int lane) {
  ldsm_x4(b, base + tile_offset<D, T>(n0 + (lane & 7) + ((lane >> 4) << 3), c0 + ((lane >> 3) & 1) * 8));
}
// B fragments of two n8 tiles for X * tile: rows k0..k0+15 of the tile are the k index, cols c0..c0+15 the n
// index. b[0], b[1] serve cols c0..c0+7; b[2], b[3] cols c0+8..c0+15.
template <int D, typename T>
__device__ __forceinline__ void load_b_nn(uint32_t (&b)[4], uint32_t base, int k0, int c0, int lane) {
  ldsm_x4_trans(b, base + tile_offset<D, T>(k0 + (lane & 15), c0 + (lane >> 4) * 8));
}

// acc (16*M x 8*N) += tile A rows a_r0.. (16*M x D) * (tile B rows b_r0.. (8*N x D))^T, both row-major
// swizzled; each B fragment serves the M row tiles.
template <int D, int M, int N, typename T>
__device__ __forceinline__ void gemm_nt(float (&acc)[M][N][4], uint32_t a_base, int a_r0, uint32_t b_base, int b_r0,
                                        int lane) {
#pragma unroll
  for (int kk = 0; kk < D / 16; ++kk) {
    uint32_t a[M][4];
#pragma unroll
    for (int mi = 0; mi < M; ++mi) load_a<D, T>(a[mi], a_base, a_r0 + 16 * mi, kk * 16, lane);
#pragma unroll
    for (int nn = 0; nn < N / 2; ++nn) {
      uint32_t b[4];
      load_b_nt<D, T>(b, b_base, b_r0 + nn * 16, kk * 16, lane);
#pragma unroll
      for (int mi = 0; mi < M; ++mi) {
        mma16816<T>(acc[mi][2 * nn], a[mi], b[0], b[1]);
        mma16816<T>(acc[mi][2 * nn + 1], a[mi], b[2], b[3]);
      }
    }
  }
}

// acc (16*M x 8*N, cols c0..) += P (16*M x 8*K: the C fragments `p`, rounded to T) * tile rows 0..8*K.
template <int D, int M, int N, int K, typename T>
__device__ __forceinline__ void gemm_pn(float (&acc)[M][N][4], const float (&p)[M][K][4], uint32_t b_base, int c0,
                                        int lane) {
#pragma unroll
  for (int kk = 0; kk < K / 2; ++kk) {
    uint32_t a[M][4];
#pragma unroll
    for (int mi = 0; mi < M; ++mi) {
      a[mi][0] = pack2<T>(p[mi][2 * kk][0], p[mi][2 * kk][1]);
      a[mi][1] = pack2<T>(p[mi][2 * kk][2], p[mi][2 * kk][3]);
      a[mi][2] = pack2<T>(p[mi][2 * kk + 1][0], p[mi][2 * kk + 1][1]);
      a[mi][3] = pack2<T>(p[mi][2 * kk + 1][2], p[mi][2 * kk + 1][3]);
    }
#pragma unroll
    for (int dd = 0; dd < N / 2; ++dd) {
      uint32_t b[4];
      load_b_nn<D, T>(b, b_base, kk * 16, c0 + dd * 16, lane);
#pragma unroll
      for (int mi = 0; mi < M; ++mi) {
        mma16816<T>(acc[mi][2 * dd], a[mi], b[0], b[1]);
        mma16816<T>(acc[mi][2 * dd + 1], a[mi], b[2], b[3]);
      }
    }
  }
}

// The A fragments (16 x 16 each, K / 2 of them along k) of P (16 x 8*K: C fragments `p`, rounded to T), as gemm_pn
// builds them.
template <int K, typename T>
__device__ __forceinline__ void pack_a(uint32_t (&a)[K / 2][4], const float (&p)[1][K][4]) {
#pragma unroll
  for (int kk = 0; kk < K / 2; ++kk) {
    a[kk][0] = pack2<T>(p[0][2 * kk][0], p[0][2 * kk][1]);
    a[kk][1] = pack2<T>(p[0][2 * kk][2], p[0][2 * kk][3]);
    a[kk][2] = pack2<T>(p[0][2 * kk + 1][0], p[0][2 * kk + 1][1]);
    a[kk][3] = pack2<T>(p[0][2 * kk + 1][2], p[0][2 * kk + 1][3]);
  }
}

// acc (16 x 8*N, cols c0..) += A (16 x 16*KK: A fragments in shared memory, word (kk * 4 + reg) * 32 + lane at
// `frags`) * tile rows 0..16*KK.
template <int D, int N, int KK, typename T>
__device__ __forceinline__ void gemm_fn(float (&acc)[1][N][4], const uint32_t* frags, uint32_t b_base, int c0,
                                        int lane) {
#pragma unroll
  for (int kk = 0; kk < KK; ++kk) {
    uint32_t a[4];
#pragma unroll
    for (int r = 0; r < 4; ++r) a[r] = frags[(kk * 4 + r) * 32 + lane];
#pragma unroll
    for (int dd = 0; dd < N / 2; ++dd) {
      uint32_t b[4];
      load_b_nn<D, T>(b, b_base, kk * 16, c0 + dd * 16, lane);
      mma16816<T>(acc[0][2 * dd], a, b[0], b[1]);
      mma16816<T>(acc[0][2 * dd + 1], a, b[2], b[3]);
    }
  }
}

// Waits for the `threads` threads (a multiple of 32) of the CTA that use barrier `id` (1..15; 0 is __syncthreads').
__device__ __forceinline__ void named_barrier(int id, int threads) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}

template <int M, int N> __device__ __forceinline__ void zero(float (&acc)[M][N][4]) {
#pragma unroll
  for (int mi = 0; mi < M; ++mi)
#pragma unroll
    for (int i = 0; i < N; ++i) acc[mi][i][0] = acc[mi][i][1] = acc[mi][i][2] = acc[mi][i][3] = 0.0f;
}

// ---------------------------------------------------------------- tile schedule

// Document [start, end) and the first token of one tile of `rows` tokens.
struct TileSpan {
  int64_t start = 0, end = 0, first = 0;
  bool valid = false;
};

// Tile `index` of the list of every document's tiles (document b has ceil(len_b / rows) tiles, in document
// order), counted from the last tile when `from_last`. Each warp scans cu_seqlens 32 documents at a time.
// cu_seqlens is validated on the host; the clamps only keep malformed values inside [0, tokens).
__device__ TileSpan locate_tile(const int32_t* cu, int n_docs, int64_t tokens, int rows, int64_t index, bool from_last) {
  const int lane = int(threadIdx.x & 31);
  auto bound = [&](int b) -> int64_t {
    const int64_t x = cu[b];
    return x < 0 ? 0 : (x > tokens ? tokens : x);
  };
  auto doc = [&](int b, int64_t& s, int64_t& e) -> int64_t {  // tiles of document b (0 past the end)
    s = e = 0;
    if (b >= n_docs) return 0;
    s = bound(b);
    e = bound(b + 1);
    if (e < s) e = s;
    return (e - s + rows - 1) / rows;
  };
  int64_t g = index;
  if (from_last) {
    int64_t total = 0;
    for (int base = 0; base < n_docs; base += 32) {
      int64_t s, e, tiles = doc(base + lane, s, e);
      for (int o = 16; o > 0; o >>= 1) tiles += __shfl_xor_sync(kFullMask, tiles, o);
      total += tiles;
    }
    g = total - 1 - index;
    if (g < 0) return {};
  }
  int64_t acc = 0;
  for (int base = 0; base < n_docs; base += 32) {
    int64_t s, e;
    const int64_t tiles = doc(base + lane, s, e);
    int64_t incl = tiles;
    for (int o = 1; o < 32; o <<= 1) {
      const int64_t y = __shfl_up_sync(kFullMask, incl, o);
      if (lane >= o) incl += y;
    }
    const int64_t chunk = __shfl_sync(kFullMask, incl, 31);
    if (g < acc + chunk) {
      const int f = __ffs(__ballot_sync(kFullMask, acc + incl > g)) - 1;
      TileSpan sp;
      sp.start = __shfl_sync(kFullMask, s, f);
      sp.end = __shfl_sync(kFullMask, e, f);
      sp.first = sp.start + (g - acc - __shfl_sync(kFullMask, incl - tiles, f)) * rows;
      sp.valid = true;
      return sp;
    }
    acc += chunk;
  }
  return {};
}

// ---------------------------------------------------------------- forward

template <typename T> struct ForwardArgs {
  const T* q;  // (tokens, q_heads, D)
  const T* k;  // (tokens, kv_heads, D)
  const T* v;
  const int32_t* cu;
  T* o;        // (tokens, q_heads, D)
  float* lse;  // (tokens, q_heads)
  int64_t tokens;
  int q_heads, kv_heads, n_docs;
  float scale;
};

// One CTA per (query tile, q head); heads vary fastest, so the q heads of a GQA group run side by side and
// share their K/V tiles through L2, and the tiles with the most keys (last of a document) start first. Warp w
// owns queries 16 * M * w .. + 16 * M of the tile (M row tiles share each K/V fragment).
template <typename T, int D, int W, int M, int BN, int kMinBlocks>
__global__ void __launch_bounds__(W * 32, kMinBlocks) flash_attention_forward_kernel(ForwardArgs<T> a) {
  constexpr int BM = 16 * M * W, kThreads = 32 * W;
  extern __shared__ __align__(128) unsigned char smem[];
  T* qs = reinterpret_cast<T*>(smem);  // (BM, D)
  T* ks = qs + BM * D;                 // 2 x (BN, D)
  T* vs = ks + 2 * BN * D;             // 2 x (BN, D)

  const int h = int(blockIdx.x % unsigned(a.q_heads));
  const TileSpan sp = locate_tile(a.cu, a.n_docs, a.tokens, BM, int64_t(blockIdx.x / unsigned(a.q_heads)), true);
  if (!sp.valid) return;
  const int kvh = h / (a.q_heads / a.kv_heads);
  const int64_t q0 = sp.first, kend = sp.end < q0 + BM ? sp.end : q0 + BM;
  const int n_tiles = int((kend - sp.start + BN - 1) / BN);
  const int64_t qstride = int64_t(a.q_heads) * D, kvstride = int64_t(a.kv_heads) * D;
  const T* kg = a.k + int64_t(kvh) * D;
  const T* vg = a.v + int64_t(kvh) * D;

  load_tile<BM, D, kThreads>(qs, a.q + int64_t(h) * D, q0, a.tokens, qstride);
  load_tile<BN, D, kThreads>(ks, kg, sp.start, a.tokens, kvstride);
  load_tile<BN, D, kThreads>(vs, vg, sp.start, a.tokens, kvstride);
  cp_async_commit();

  const int warp = int(threadIdx.x / 32), lane = int(threadIdx.x % 32), g = lane >> 2, t = lane & 3;
  // This warp's first query; the thread's rows are row0 + 16 * mi + g and + 8.
  const int64_t row0 = q0 + warp * 16 * M;
  const float sl2 = a.scale * kLog2e;
  const uint32_t q_base = smem_addr(qs);
  float o_acc[M][D / 8][4];
  zero(o_acc);
  float m[M][2], l[M][2];  // running max (scaled, base 2) and this thread's partial row sums
#pragma unroll
  for (int mi = 0; mi < M; ++mi) m[mi][0] = m[mi][1] = -INFINITY, l[mi][0] = l[mi][1] = 0.0f;

  for (int n = 0; n < n_tiles; ++n) {
    const int64_t k0 = sp.start + int64_t(n) * BN;
    if (n + 1 < n_tiles) {
      const int nb = (n + 1) & 1;
      load_tile<BN, D, kThreads>(ks + nb * BN * D, kg, k0 + BN, a.tokens, kvstride);
      load_tile<BN, D, kThreads>(vs + nb * BN * D, vg, k0 + BN, a.tokens, kvstride);
      cp_async_commit();
      cp_async_wait<1>();
    } else {
      cp_async_wait<0>();
    }
    __syncthreads();
    if (k0 <= row0 + 16 * M - 1) {  // otherwise every key of the tile comes after every row of this warp
      const uint32_t k_base = smem_addr(ks + (n & 1) * BN * D), v_base = smem_addr(vs + (n & 1) * BN * D);
      float s[M][BN / 8][4];
      zero(s);
      gemm_nt<D, M, BN / 8, T>(s, q_base, warp * 16 * M, k_base, 0, lane);
      if (k0 + BN - 1 > row0) {  // the diagonal (or past the document end): causal mask
#pragma unroll
        for (int mi = 0; mi < M; ++mi) {
          const int rel = int(k0 - row0) - 16 * mi - g;  // key k0 + x comes after row row0 + 16 mi + g when x + rel > 0
#pragma unroll
          for (int nt = 0; nt < BN / 8; ++nt)
#pragma unroll
            for (int e = 0; e < 2; ++e) {
              const int x = nt * 8 + 2 * t + e;
              if (x + rel > 0) s[mi][nt][e] = -INFINITY;
              if (x + rel > 8) s[mi][nt][2 + e] = -INFINITY;
            }
        }
      }
#pragma unroll
      for (int mi = 0; mi < M; ++mi) {
        float mx[2] = {-INFINITY, -INFINITY};
#pragma unroll
        for (int nt = 0; nt < BN / 8; ++nt) {
          mx[0] = fmaxf(mx[0], fmaxf(s[mi][nt][0], s[mi][nt][1]));
          mx[1] = fmaxf(mx[1], fmaxf(s[mi][nt][2], s[mi][nt][3]));
        }
        float base[2], corr[2];
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          mx[r] = fmaxf(mx[r], __shfl_xor_sync(kFullMask, mx[r], 1));
          mx[r] = fmaxf(mx[r], __shfl_xor_sync(kFullMask, mx[r], 2));
          const float m_new = fmaxf(m[mi][r], mx[r] * sl2);
          base[r] = m_new == -INFINITY ? 0.0f : m_new;  // a row with no key yet keeps p = 0, not NaN
          corr[r] = exp2_approx(m[mi][r] - base[r]);
          m[mi][r] = m_new;
          l[mi][r] *= corr[r];
        }
#pragma unroll
        for (int nt = 0; nt < BN / 8; ++nt) {
          s[mi][nt][0] = exp2_approx(fmaf(s[mi][nt][0], sl2, -base[0]));
          s[mi][nt][1] = exp2_approx(fmaf(s[mi][nt][1], sl2, -base[0]));
          s[mi][nt][2] = exp2_approx(fmaf(s[mi][nt][2], sl2, -base[1]));
          s[mi][nt][3] = exp2_approx(fmaf(s[mi][nt][3], sl2, -base[1]));
          l[mi][0] += s[mi][nt][0] + s[mi][nt][1];
          l[mi][1] += s[mi][nt][2] + s[mi][nt][3];
        }
#pragma unroll
        for (int dt = 0; dt < D / 8; ++dt) {
          o_acc[mi][dt][0] *= corr[0];
          o_acc[mi][dt][1] *= corr[0];
          o_acc[mi][dt][2] *= corr[1];
          o_acc[mi][dt][3] *= corr[1];
        }
      }
      gemm_pn<D, M, D / 8, BN / 8, T>(o_acc, s, v_base, 0, lane);
    }
    __syncthreads();  // the next iteration's copy overwrites this tile
  }

#pragma unroll
  for (int mi = 0; mi < M; ++mi)
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      float lr = l[mi][r];
      lr += __shfl_xor_sync(kFullMask, lr, 1);
      lr += __shfl_xor_sync(kFullMask, lr, 2);
      const int64_t i = row0 + 16 * mi + g + 8 * r;
      if (i >= sp.end) continue;  // rows of the next document (or past the tensor) belong to another tile
      const float inv = 1.0f / lr;  // lr > 0: key `start` is never masked for a row of the document
      T* orow = a.o + (i * a.q_heads + h) * D;
#pragma unroll
      for (int dt = 0; dt < D / 8; ++dt)
        *reinterpret_cast<uint32_t*>(orow + dt * 8 + 2 * t) =
            pack2<T>(o_acc[mi][dt][2 * r] * inv, o_acc[mi][dt][2 * r + 1] * inv);
      if (t == 0) a.lse[i * a.q_heads + h] = (m[mi][r] + log2f(lr)) * kLn2;
    }
}

// ---------------------------------------------------------------- backward

template <typename T> struct BackwardArgs {
  const T* q;     // (tokens, q_heads, D)
  const T* k;     // (tokens, kv_heads, D)
  const T* v;
  const T* dout;  // (tokens, q_heads, D)
  const int32_t* cu;
  const float* lse2;   // (q_heads, tokens): lse * log2(e)
  const float* delta;  // (q_heads, tokens): do_i . o_i
  T* dq;
  T* dk;
  T* dv;
  int64_t tokens;
  int q_heads, kv_heads, n_docs;
  float scale;
};

// kN 16-bit values as one load.
template <int kN> struct RawVector;
template <> struct RawVector<2> { using type = uint32_t; };
template <> struct RawVector<4> { using type = uint2; };
template <> struct RawVector<8> { using type = uint4; };

// lse2 and delta, head-major so a tile's values are contiguous. One warp per (token, q head) row; each lane
// reads D / 32 consecutive elements of o and do.
template <typename T, int D>
__global__ void flash_attention_row_stats_kernel(const T* o, const T* dout, const float* lse, int64_t tokens, int q_heads,
                                                 float* lse2, float* delta) {
  constexpr int kPer = D / 32;
  const int lane = int(threadIdx.x % 32);
  const int64_t rows = tokens * q_heads, stride = int64_t(gridDim.x) * (blockDim.x / 32);
  for (int64_t r = int64_t(blockIdx.x) * (blockDim.x / 32) + threadIdx.x / 32; r < rows; r += stride) {
    using Raw = typename RawVector<kPer>::type;
    const Raw xo = *reinterpret_cast<const Raw*>(o + r * D + lane * kPer);
    const Raw xd = *reinterpret_cast<const Raw*>(dout + r * D + lane * kPer);
    const T* eo = reinterpret_cast<const T*>(&xo);
    const T* ed = reinterpret_cast<const T*>(&xd);
    float s = 0.0f;
#pragma unroll
    for (int c = 0; c < kPer; ++c) s += to_float(eo[c]) * to_float(ed[c]);
    for (int off = 16; off > 0; off >>= 1) s += __shfl_xor_sync(kFullMask, s, off);
    if (lane == 0) {
      const int64_t i = r / q_heads, h = r % q_heads;
      delta[h * tokens + i] = s;
      lse2[h * tokens + i] = lse[r] * kLog2e;
    }
  }
}

// One CTA per (key tile, kv head). Warp w owns keys 16 * (w % kKeyWarps) .. + 16 of the tile and, with a split head
// dim, the dK/dV columns of part w / kKeyWarps; it computes P and dS of its keys for queries [part * BQ, + BQ) of each
// query tile (BQ = BM / kSplit) and, when split, swaps them with the other part's warp through shared memory (as mma
// A fragments; a named barrier per pair). Loops over (q head of the group, query tile from the key tile's start to
// the document end), prefetching the next pair's Q, dO and statistics.
template <typename T, int D, int W, int BM, int kSplit>
__global__ void __launch_bounds__(W * 32, 1) flash_attention_dkdv_kernel(BackwardArgs<T> a) {
  constexpr int kThreads = 32 * W, kKeyWarps = W / kSplit, BN = 16 * kKeyWarps, DW = D / kSplit, BQ = BM / kSplit;
  static_assert(2 * BM <= kThreads, "one thread per statistic copy");
  static_assert(kSplit == 1 || kSplit == 2, "a head dim split in at most two parts");
  static_assert(BQ % 16 == 0, "each part's queries are whole A fragments");
  constexpr int kFragWords = (BM / 16) * 4 * 32;  // one 16 x BM matrix as A fragments, per pair
  extern __shared__ __align__(128) unsigned char smem[];
  T* ks = reinterpret_cast<T*>(smem);  // (BN, D)
  T* vs = ks + BN * D;                 // (BN, D)
  T* qs = vs + BN * D;                 // 2 x (BM, D)
  T* dos = qs + 2 * BM * D;            // 2 x (BM, D)
  float* lse_s = reinterpret_cast<float*>(dos + 2 * BM * D);  // 2 x BM
  float* delta_s = lse_s + 2 * BM;                            // 2 x BM
  uint32_t* frags = reinterpret_cast<uint32_t*>(delta_s + 2 * BM);  // split: kKeyWarps x {P, dS} x kFragWords

  const int kvh = int(blockIdx.x % unsigned(a.kv_heads));
  const TileSpan sp = locate_tile(a.cu, a.n_docs, a.tokens, BN, int64_t(blockIdx.x / unsigned(a.kv_heads)), false);
  if (!sp.valid) return;
  const int group = a.q_heads / a.kv_heads;
  const int64_t k0 = sp.first, qstride = int64_t(a.q_heads) * D, kvstride = int64_t(a.kv_heads) * D;
  const int n_qt = int((sp.end - k0 + BM - 1) / BM), n_it = group * n_qt;

  auto load_queries = [&](int it, int buf) {
    const int hq = kvh * group + it / n_qt;
    const int64_t i0 = k0 + int64_t(it % n_qt) * BM;
    load_tile<BM, D, kThreads>(qs + buf * BM * D, a.q + int64_t(hq) * D, i0, a.tokens, qstride);
    load_tile<BM, D, kThreads>(dos + buf * BM * D, a.dout + int64_t(hq) * D, i0, a.tokens, qstride);
    const int c = int(threadIdx.x) % BM;
    const int64_t i = i0 + c, off = int64_t(hq) * a.tokens + i;
    const bool valid = i < a.tokens;
    if (threadIdx.x < BM) cp_async4(smem_addr(lse_s + buf * BM + c), a.lse2 + (valid ? off : 0), valid);
    else if (threadIdx.x < 2 * BM) cp_async4(smem_addr(delta_s + buf * BM + c), a.delta + (valid ? off : 0), valid);
  };
  load_tile<BN, D, kThreads>(ks, a.k + int64_t(kvh) * D, k0, a.tokens, kvstride);
  load_tile<BN, D, kThreads>(vs, a.v + int64_t(kvh) * D, k0, a.tokens, kvstride);
  load_queries(0, 0);
  cp_async_commit();

  const int warp = int(threadIdx.x / 32), lane = int(threadIdx.x % 32), g = lane >> 2, t = lane & 3;
  const int pair = warp % kKeyWarps, part = warp / kKeyWarps;
  const int kr = pair * 16, c0 = part * DW, q_off = part * BQ;
  uint32_t* p_frags = frags + pair * 2 * kFragWords;  // this pair's P, then dS
  uint32_t* ds_frags = p_frags + kFragWords;
  const int64_t j0 = k0 + kr;  // this warp's first key; the thread's keys are j0 + g and + 8
  const float sl2 = a.scale * kLog2e;
  const uint32_t k_base = smem_addr(ks), v_base = smem_addr(vs);
  float dk[1][DW / 8][4], dv[1][DW / 8][4];
  zero(dk);
  zero(dv);

  for (int it = 0; it < n_it; ++it) {
    const int buf = it & 1;
    const int64_t i0 = k0 + int64_t(it % n_qt) * BM;
    if (it + 1 < n_it) {
      load_queries(it + 1, buf ^ 1);
      cp_async_commit();
      cp_async_wait<1>();
    } else {
      cp_async_wait<0>();
    }
    __syncthreads();
    if (i0 + BM - 1 >= j0) {  // otherwise every query of the tile comes before every key of this pair
      const uint32_t q_base = smem_addr(qs + buf * BM * D), do_base = smem_addr(dos + buf * BM * D);
      float s[1][BQ / 8][4], dp[1][BQ / 8][4];  // S^T and dP^T: (16 keys, this part's BQ queries)
      zero(s);
      zero(dp);
      gemm_nt<D, 1, BQ / 8, T>(s, k_base, kr, q_base, q_off, lane);
      gemm_nt<D, 1, BQ / 8, T>(dp, v_base, kr, do_base, q_off, lane);
      const bool mask = i0 < j0 + 15 || i0 + BM > sp.end;
      const int rel = int(i0 - j0);  // query i0 + c comes before key j0 + g when g > rel + c
      const int in_doc = int(sp.end - i0 < BM ? sp.end - i0 : BM);  // queries of the tile inside the document
      const float* ls = lse_s + buf * BM;
      const float* ds = delta_s + buf * BM;
#pragma unroll
      for (int nt = 0; nt < BQ / 8; ++nt)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int c = q_off + nt * 8 + 2 * t + e;
          const float l2 = ls[c], dl = ds[c];
          float p0 = exp2_approx(fmaf(s[0][nt][e], sl2, -l2)), p1 = exp2_approx(fmaf(s[0][nt][2 + e], sl2, -l2));
          if (mask) {  // keys after the query, or queries past the document end
            if (g > rel + c || c >= in_doc) p0 = 0.0f;
            if (g + 8 > rel + c || c >= in_doc) p1 = 0.0f;
          }
          s[0][nt][e] = p0;
          s[0][nt][2 + e] = p1;
          dp[0][nt][e] = p0 * (dp[0][nt][e] - dl);
          dp[0][nt][2 + e] = p1 * (dp[0][nt][2 + e] - dl);
        }
      if constexpr (kSplit == 1) {
        gemm_pn<D, 1, DW / 8, BM / 8, T>(dv, s, do_base, c0, lane);  // dV += P^T dO
        gemm_pn<D, 1, DW / 8, BM / 8, T>(dk, dp, q_base, c0, lane);  // dK += dS^T Q
      } else {
        uint32_t pa[BQ / 16][4], da[BQ / 16][4];
        pack_a<BQ / 8, T>(pa, s);
        pack_a<BQ / 8, T>(da, dp);
#pragma unroll
        for (int kk = 0; kk < BQ / 16; ++kk)
#pragma unroll
          for (int r = 0; r < 4; ++r) {
            const int word = ((part * (BQ / 16) + kk) * 4 + r) * 32 + lane;
            p_frags[word] = pa[kk][r];
            ds_frags[word] = da[kk][r];
          }
        named_barrier(1 + pair, 64);  // the pair's two warps: both halves written
        gemm_fn<D, DW / 8, BM / 16, T>(dv, p_frags, do_base, c0, lane);  // dV += P^T dO
        gemm_fn<D, DW / 8, BM / 16, T>(dk, ds_frags, q_base, c0, lane);  // dK += dS^T Q
      }
    }
    __syncthreads();  // the next iteration's copy overwrites this buffer (and, split, the fragments)
  }

#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int64_t j = j0 + g + 8 * r;
    if (j >= sp.end) continue;
    T* dkrow = a.dk + (j * a.kv_heads + kvh) * D + c0;
    T* dvrow = a.dv + (j * a.kv_heads + kvh) * D + c0;
#pragma unroll
    for (int dt = 0; dt < DW / 8; ++dt) {
      *reinterpret_cast<uint32_t*>(dkrow + dt * 8 + 2 * t) =
          pack2<T>(dk[0][dt][2 * r] * a.scale, dk[0][dt][2 * r + 1] * a.scale);
      *reinterpret_cast<uint32_t*>(dvrow + dt * 8 + 2 * t) = pack2<T>(dv[0][dt][2 * r], dv[0][dt][2 * r + 1]);
    }
  }
}

// One CTA per (query tile, q head), ordered and shaped like the forward. dQ = scale * sum_j dS_ij k_j over
// the key tiles from the document start to the tile's diagonal.
template <typename T, int D, int W, int M, int BN>
__global__ void __launch_bounds__(W * 32, 1) flash_attention_dq_kernel(BackwardArgs<T> a) {
  constexpr int BM = 16 * M * W, kThreads = 32 * W;
  extern __shared__ __align__(128) unsigned char smem[];
  T* qs = reinterpret_cast<T*>(smem);  // (BM, D)
  T* dos = qs + BM * D;                // (BM, D)
  T* ks = dos + BM * D;                // 2 x (BN, D)
  T* vs = ks + 2 * BN * D;             // 2 x (BN, D)

  const int h = int(blockIdx.x % unsigned(a.q_heads));
  const TileSpan sp = locate_tile(a.cu, a.n_docs, a.tokens, BM, int64_t(blockIdx.x / unsigned(a.q_heads)), true);
  if (!sp.valid) return;
  const int kvh = h / (a.q_heads / a.kv_heads);
  const int64_t q0 = sp.first, kend = sp.end < q0 + BM ? sp.end : q0 + BM;
  const int n_tiles = int((kend - sp.start + BN - 1) / BN);
  const int64_t qstride = int64_t(a.q_heads) * D, kvstride = int64_t(a.kv_heads) * D;
  const T* kg = a.k + int64_t(kvh) * D;
  const T* vg = a.v + int64_t(kvh) * D;

  load_tile<BM, D, kThreads>(qs, a.q + int64_t(h) * D, q0, a.tokens, qstride);
  load_tile<BM, D, kThreads>(dos, a.dout + int64_t(h) * D, q0, a.tokens, qstride);
  load_tile<BN, D, kThreads>(ks, kg, sp.start, a.tokens, kvstride);
  load_tile<BN, D, kThreads>(vs, vg, sp.start, a.tokens, kvstride);
  cp_async_commit();

  const int warp = int(threadIdx.x / 32), lane = int(threadIdx.x % 32), g = lane >> 2, t = lane & 3;
  const int64_t row0 = q0 + warp * 16 * M;
  const float sl2 = a.scale * kLog2e;
  float l2[M][2], dl[M][2];
#pragma unroll
  for (int mi = 0; mi < M; ++mi)
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int64_t i = row0 + 16 * mi + g + 8 * r;
      l2[mi][r] = i < a.tokens ? a.lse2[int64_t(h) * a.tokens + i] : 0.0f;
      dl[mi][r] = i < a.tokens ? a.delta[int64_t(h) * a.tokens + i] : 0.0f;
    }
  const uint32_t q_base = smem_addr(qs), do_base = smem_addr(dos);
  float dq[M][D / 8][4];
  zero(dq);

  for (int n = 0; n < n_tiles; ++n) {
    const int64_t k0 = sp.start + int64_t(n) * BN;
    if (n + 1 < n_tiles) {
      const int nb = (n + 1) & 1;
      load_tile<BN, D, kThreads>(ks + nb * BN * D, kg, k0 + BN, a.tokens, kvstride);
      load_tile<BN, D, kThreads>(vs + nb * BN * D, vg, k0 + BN, a.tokens, kvstride);
      cp_async_commit();
      cp_async_wait<1>();
    } else {
      cp_async_wait<0>();
    }
    __syncthreads();
    if (k0 <= row0 + 16 * M - 1) {
      const uint32_t k_base = smem_addr(ks + (n & 1) * BN * D), v_base = smem_addr(vs + (n & 1) * BN * D);
      float s[M][BN / 8][4], dp[M][BN / 8][4];
      zero(s);
      zero(dp);
      gemm_nt<D, M, BN / 8, T>(s, q_base, warp * 16 * M, k_base, 0, lane);
      gemm_nt<D, M, BN / 8, T>(dp, do_base, warp * 16 * M, v_base, 0, lane);
      const bool mask = k0 + BN - 1 > row0;
#pragma unroll
      for (int mi = 0; mi < M; ++mi) {
        const int rel = int(k0 - row0) - 16 * mi - g;  // as in the forward
#pragma unroll
        for (int nt = 0; nt < BN / 8; ++nt)
#pragma unroll
          for (int e = 0; e < 2; ++e)
#pragma unroll
            for (int r = 0; r < 2; ++r) {
              float p = exp2_approx(fmaf(s[mi][nt][2 * r + e], sl2, -l2[mi][r]));
              if (mask && nt * 8 + 2 * t + e + rel > 8 * r) p = 0.0f;
              s[mi][nt][2 * r + e] = p * (dp[mi][nt][2 * r + e] - dl[mi][r]);  // dS (unscaled)
            }
      }
      gemm_pn<D, M, D / 8, BN / 8, T>(dq, s, k_base, 0, lane);  // dQ += dS K
    }
    __syncthreads();
  }

#pragma unroll
  for (int mi = 0; mi < M; ++mi)
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int64_t i = row0 + 16 * mi + g + 8 * r;
      if (i >= sp.end) continue;
      T* row = a.dq + (i * a.q_heads + h) * D;
#pragma unroll
      for (int dt = 0; dt < D / 8; ++dt)
        *reinterpret_cast<uint32_t*>(row + dt * 8 + 2 * t) =
            pack2<T>(dq[mi][dt][2 * r] * a.scale, dq[mi][dt][2 * r + 1] * a.scale);
    }
}

// ---------------------------------------------------------------- launch helpers

template <typename T> struct DTypeTag {
  using type = T;
};
template <typename F> void dispatch_dtype(DType dt, const char* what, F f) {
  switch (dt) {
    case DType::BF16: f(DTypeTag<__nv_bfloat16>{}); return;
    case DType::F16: f(DTypeTag<__half>{}); return;
    default: throw_cuda_error(what, cudaErrorInvalidValue, __FILE__, __LINE__);
  }
}
template <int D> struct HeadDim {
  static constexpr int value = D;
};
template <typename F> void dispatch_head_dim(int64_t d, const char* what, F f) {
  switch (d) {
    case 64: f(HeadDim<64>{}); return;
    case 128: f(HeadDim<128>{}); return;
    case 256: f(HeadDim<256>{}); return;
    default: throw_cuda_error(what, cudaErrorInvalidValue, __FILE__, __LINE__);
  }
}

// Upper bound of the tiles of `rows` tokens over all documents: ceil(tokens / rows) + documents.
unsigned grid_for_tiles(const AttentionDims& d, int rows, int64_t heads) {
  const int64_t tiles = (d.tokens + rows - 1) / rows + (d.n_cu - 1);
  return unsigned(tiles * heads);
}

template <typename K> void set_smem(K kernel, size_t bytes) {
  LATHE_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(bytes)));
}

// One launch per kernel, for any tile shape (the public launchers take FlashConfig's; a tile-shape experiment
// can call these with others).
template <typename T, int D, int W, int M, int BN, int kMinBlocks>
void launch_forward_tiles(const AttentionDims& dims, const ForwardArgs<T>& args, cudaStream_t stream) {
  constexpr int BM = 16 * M * W;
  const size_t bytes = size_t(BM + 4 * BN) * D * sizeof(T);
  auto kernel = flash_attention_forward_kernel<T, D, W, M, BN, kMinBlocks>;
  set_smem(kernel, bytes);
  kernel<<<grid_for_tiles(dims, BM, dims.q_heads), W * 32, bytes, stream>>>(args);
  LATHE_CUDA_LAUNCH_CHECK("flash_attention_forward_kernel");
}

template <typename T, int D>
void launch_row_stats(const AttentionDims& dims, const T* o, const T* dout, const float* lse, float* lse2, float* delta,
                      cudaStream_t stream) {
  const int64_t blocks = (dims.tokens * dims.q_heads + 7) / 8;  // a warp per row
  flash_attention_row_stats_kernel<T, D><<<unsigned(blocks < 65536 * 8 ? blocks : 65536 * 8), 256, 0, stream>>>(
      o, dout, lse, dims.tokens, int(dims.q_heads), lse2, delta);
  LATHE_CUDA_LAUNCH_CHECK("flash_attention_row_stats_kernel");
}

template <typename T, int D, int W, int BM, int kSplit>
void launch_dkdv_tiles(const AttentionDims& dims, const BackwardArgs<T>& args, cudaStream_t stream) {
  constexpr int BN = 16 * W / kSplit;
  const size_t frag_bytes = kSplit > 1 ? size_t(W / kSplit) * 2 * (BM / 16) * 4 * 32 * sizeof(uint32_t) : 0;
  const size_t bytes = size_t(2 * BN + 4 * BM) * D * sizeof(T) + 4 * BM * sizeof(float) + frag_bytes;
  auto kernel = flash_attention_dkdv_kernel<T, D, W, BM, kSplit>;
  set_smem(kernel, bytes);
  kernel<<<grid_for_tiles(dims, BN, dims.kv_heads), W * 32, bytes, stream>>>(args);
  LATHE_CUDA_LAUNCH_CHECK("flash_attention_dkdv_kernel");
}

template <typename T, int D, int W, int M, int BN>
void launch_dq_tiles(const AttentionDims& dims, const BackwardArgs<T>& args, cudaStream_t stream) {
  constexpr int BM = 16 * M * W;
  const size_t bytes = size_t(2 * BM + 4 * BN) * D * sizeof(T);
  auto kernel = flash_attention_dq_kernel<T, D, W, M, BN>;
  set_smem(kernel, bytes);
  kernel<<<grid_for_tiles(dims, BM, dims.q_heads), W * 32, bytes, stream>>>(args);
  LATHE_CUDA_LAUNCH_CHECK("flash_attention_dq_kernel");
}

}  // namespace

bool flash_attention_head_dim_supported(int64_t head_dim) {
  return head_dim == 64 || head_dim == 128 || head_dim == 256;
}

void launch_flash_attention(DType dtype, const AttentionDims& dims, const void* q, const void* k, const void* v,
                            const int32_t* cu_seqlens, void* o, float* lse, cudaStream_t stream) {
  if (dims.tokens * dims.q_heads == 0 || dims.n_cu < 2) return;
  dispatch_dtype(dtype, "flash attention (dtype must be bf16 or f16)", [&](auto tag) {
    using T = typename decltype(tag)::type;
    const ForwardArgs<T> args{static_cast<const T*>(q), static_cast<const T*>(k), static_cast<const T*>(v), cu_seqlens,
                              static_cast<T*>(o), lse, dims.tokens, int(dims.q_heads), int(dims.kv_heads),
                              int(dims.n_cu - 1), dims.scale};
    dispatch_head_dim(dims.head_dim, "flash attention (head dim must be 64, 128 or 256)", [&](auto hd) {
      constexpr int D = decltype(hd)::value;
      using C = FlashConfig<D>;
      launch_forward_tiles<T, D, C::kFwdWarps, C::kFwdRows, C::kFwdKeys, C::kFwdMinBlocks>(dims, args, stream);
    });
  });
}

int64_t flash_attention_backward_scratch_floats(const AttentionDims& dims) { return 2 * dims.tokens * dims.q_heads; }

void launch_flash_attention_backward(DType dtype, const AttentionDims& dims, const void* q, const void* k,
                                     const void* v, const void* o, const float* lse, const void* dout,
                                     const int32_t* cu_seqlens, void* dq, void* dk, void* dv, float* scratch,
                                     cudaStream_t stream) {
  if (dims.tokens * dims.q_heads == 0 || dims.n_cu < 2) return;
  float* lse2 = scratch;
  float* delta = scratch + dims.tokens * dims.q_heads;
  dispatch_dtype(dtype, "flash attention backward (dtype must be bf16 or f16)", [&](auto tag) {
    using T = typename decltype(tag)::type;
    const BackwardArgs<T> args{static_cast<const T*>(q), static_cast<const T*>(k), static_cast<const T*>(v),
                               static_cast<const T*>(dout), cu_seqlens, lse2, delta, static_cast<T*>(dq),
                               static_cast<T*>(dk), static_cast<T*>(dv), dims.tokens, int(dims.q_heads),
                               int(dims.kv_heads), int(dims.n_cu - 1), dims.scale};
    dispatch_head_dim(dims.head_dim, "flash attention backward (head dim must be 64, 128 or 256)", [&](auto hd) {
      constexpr int D = decltype(hd)::value;
      using C = FlashConfig<D>;
      launch_row_stats<T, D>(dims, static_cast<const T*>(o), static_cast<const T*>(dout), lse, lse2, delta, stream);
      launch_dkdv_tiles<T, D, C::kDkdvWarps, C::kDkdvQueries, C::kDkdvSplit>(dims, args, stream);
      launch_dq_tiles<T, D, C::kDqWarps, C::kDqRows, C::kDqKeys>(dims, args, stream);
    });
  });
}

}  // namespace lathe::cuda
