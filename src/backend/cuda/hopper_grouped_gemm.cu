// Hopper (sm_90a) grouped GEMM for the MoE experts, bf16 in and out with fp32 accumulation (hopper_grouped_gemm.h
// has the three products). Written for the skew of a MoE layer's rows, where cuBLAS's grouped call ran at 0.3-0.4x of
// dense speed (docs/benchmarks.md): a few experts of thousands of rows beside many of a dozen.
//
// Persistent: one CTA per SM takes 128 x 256 output tiles of the experts in turn. Three warpgroups: the first a
// producer whose one thread issues TMA loads into a 3-stage ring of shared memory (64 reduced elements a stage), the
// other two consumers that each multiply their 64 rows by the tile's 256 columns with wgmma.m64n256k16 (both operands
// from shared memory, 128-byte swizzle) into 128 fp32 registers a thread (setmaxnreg moves registers from the producer
// to them). mbarriers pace the ring: a stage's `full` completes when its bytes land, its `empty` when the eight
// consumer warps have read it; the producer runs ahead into the next tile while the consumers write one out.
// Shared-memory operand layouts (the PTX ISA's canonical 128-byte-swizzle layouts):
//   K-major (x, and w when trans_w): rows of 64 elements (128 bytes), 8-row atoms of 1 KiB: descriptor SBO 1 KiB;
//     the k16 step j starts 32 j bytes in.
//   MN-major (dy and x in the weight grad, w otherwise): blocks of 64 reduced rows x 64 elements (8 KiB), one per 64
//     output rows or columns: LBO 8 KiB (block to block), SBO 1 KiB (8 reduced rows); the k16 step j starts 2 KiB j in.
// Rows: the forward's 128-row slices may run past their expert (into the next one's rows, or past P where TMA fills
// zeros); those rows are computed and never stored. The weight grad reduces over a group's rows, so in its last stage
// the consumers zero the rows past the group before multiplying.
// The epilogue: each consumer warpgroup writes its 64 x 256 bf16 half into its own staging buffer and one thread sends
// it out with TMA stores (the weight grad accumulating: TMA bf16 additions, old + bf16(new)) that complete while the
// next tile is computed; a forward half that runs past its expert's rows is stored from registers instead.
// Deterministic: a fixed reduction order per output element, each element written (or added to) once a call.
// The tile table comes from the host (grouped_gemm.cpp builds it from host groups), or, for the routed ops (groups on
// the device), from hopper_schedule_kernel below, one block run ahead on the stream, whose length the kernel then
// reads on the device: the same table in the same order, so both give the same bytes.
#include <cuda_bf16.h>

#include "backend/cuda/check.h"
#include "backend/cuda/hopper_grouped_gemm.h"

namespace lathe::cuda {

namespace {

constexpr int kStages = 3;
constexpr int kABytes = kHopperTileM * kHopperTileK * 2;  // 16 KiB
constexpr int kBBytes = kHopperTileN * kHopperTileK * 2;  // 32 KiB
constexpr int kStageBytes = kABytes + kBBytes;
constexpr int kBlockBytes = 64 * 128;  // an MN-major block: 64 reduced rows of 128 bytes
constexpr int kStagingBytes = 64 * kHopperTileN * 2;  // a consumer warpgroup's 64 x 256 bf16 output, 4 TMA boxes
// Alignment slack, the ring, each consumer warpgroup's output staging, the barriers.
constexpr int kSmemBytes = 1024 + kStages * kStageBytes + 2 * kStagingBytes + 2 * kStages * 8;
constexpr int kThreads = 384;
constexpr int kConsumerWarps = 8;

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)

__device__ __forceinline__ uint32_t shared_address(const void* p) { return uint32_t(__cvta_generic_to_shared(p)); }

__device__ __forceinline__ void barrier_init(uint32_t bar, uint32_t count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(bar), "r"(count) : "memory");
}

__device__ __forceinline__ void barrier_expect_bytes(uint32_t bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(bytes) : "memory");
}

__device__ __forceinline__ void barrier_arrive(uint32_t bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(bar) : "memory");
}

// Waits until the barrier's phase of this parity has completed.
__device__ __forceinline__ void barrier_wait(uint32_t bar, uint32_t parity) {
  uint32_t done = 0;
  while (!done)
    asm volatile(
        "{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\nselp.u32 %0, 1, 0, p;\n}\n"
        : "=r"(done)
        : "r"(bar), "r"(parity)
        : "memory");
}

__device__ __forceinline__ void tma_load_2d(uint32_t dst, const CUtensorMap* map, int c0, int c1, uint32_t bar) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];" ::"r"(
          dst),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(c0), "r"(c1), "r"(bar)
      : "memory");
}

__device__ __forceinline__ void tma_load_3d(uint32_t dst, const CUtensorMap* map, int c0, int c1, int c2,
                                            uint32_t bar) {
  asm volatile(
      "cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4}], [%5];" ::
          "r"(dst),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(c0), "r"(c1), "r"(c2), "r"(bar)
      : "memory");
}

// Bulk stores and reductions from shared memory to a tensor (the bulk group of the issuing thread).
__device__ __forceinline__ void tma_store_2d(const CUtensorMap* map, int c0, int c1, uint32_t src) {
  asm volatile("cp.async.bulk.tensor.2d.global.shared::cta.bulk_group [%0, {%1, %2}], [%3];" ::"l"(
                   reinterpret_cast<uint64_t>(map)),
               "r"(c0), "r"(c1), "r"(src)
               : "memory");
}

__device__ __forceinline__ void tma_store_3d(const CUtensorMap* map, int c0, int c1, int c2, uint32_t src) {
  asm volatile("cp.async.bulk.tensor.3d.global.shared::cta.bulk_group [%0, {%1, %2, %3}], [%4];" ::"l"(
                   reinterpret_cast<uint64_t>(map)),
               "r"(c0), "r"(c1), "r"(c2), "r"(src)
               : "memory");
}

__device__ __forceinline__ void tma_add_3d(const CUtensorMap* map, int c0, int c1, int c2, uint32_t src) {
  asm volatile("cp.reduce.async.bulk.tensor.3d.global.shared::cta.add.bulk_group [%0, {%1, %2, %3}], [%4];" ::"l"(
                   reinterpret_cast<uint64_t>(map)),
               "r"(c0), "r"(c1), "r"(c2), "r"(src)
               : "memory");
}

// A wgmma shared-memory matrix descriptor, 128-byte swizzle (the sm_90 layout: address, LBO and SBO in 16-byte units).
__device__ __forceinline__ uint64_t smem_descriptor(uint32_t address, uint32_t lbo, uint32_t sbo) {
  return uint64_t((address & 0x3FFFF) >> 4) | (uint64_t(lbo >> 4) << 16) | (uint64_t(sbo >> 4) << 32) | (1ull << 62);
}

// d (64 x 256, fp32, this warpgroup's fragment) += A (64 x 16) B (16 x 256); kTransA / kTransB: the operand is
// MN-major in shared memory.
template <int kTransA, int kTransB>
__device__ __forceinline__ void wgmma_m64n256k16(float (&d)[128], uint64_t a, uint64_t b) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, 1, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16 {"
      "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15,"
      "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31,"
      "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47,"
      "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63,"
      "%64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79,"
      "%80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95,"
      "%96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111,"
      "%112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127}, "
      "%128, %129, p, 1, 1, %130, %131;\n}\n"
      :
        "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
        "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
        "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
        "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),
        "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]),
        "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),
        "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
        "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]),
        "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]),
        "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79]),
        "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]),
        "+f"(d[88]), "+f"(d[89]), "+f"(d[90]), "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95]),
        "+f"(d[96]), "+f"(d[97]), "+f"(d[98]), "+f"(d[99]), "+f"(d[100]), "+f"(d[101]), "+f"(d[102]), "+f"(d[103]),
        "+f"(d[104]), "+f"(d[105]), "+f"(d[106]), "+f"(d[107]), "+f"(d[108]), "+f"(d[109]), "+f"(d[110]), "+f"(d[111]),
        "+f"(d[112]), "+f"(d[113]), "+f"(d[114]), "+f"(d[115]), "+f"(d[116]), "+f"(d[117]), "+f"(d[118]), "+f"(d[119]),
        "+f"(d[120]), "+f"(d[121]), "+f"(d[122]), "+f"(d[123]), "+f"(d[124]), "+f"(d[125]), "+f"(d[126]), "+f"(d[127])
      : "l"(a), "l"(b), "n"(kTransA), "n"(kTransB));
}

// One output tile of the persistent schedule: its expert's rows, where it starts and how many stages it reduces.
struct TileAt {
  HopperTile rows;
  int m0, n0, k_tiles;
};

template <HopperGemm kKind>
__device__ __forceinline__ TileAt tile_at(const HopperGemmLaunch& l, int index) {
  TileAt t;
  if constexpr (kKind == HopperGemm::weight_grad) {  // group-major, then output rows, then output columns
    const int per_group = l.m_tiles * l.n_tiles;
    t.rows = l.tiles[index / per_group];
    t.m0 = (index % per_group) / l.n_tiles * kHopperTileM;
    t.n0 = index % l.n_tiles * kHopperTileN;
    t.k_tiles = (t.rows.row_end - t.rows.row0 + kHopperTileK - 1) / kHopperTileK;
  } else {  // 128-row slice-major, then output columns (a slice's CTAs share its rows of x in L2)
    t.rows = l.tiles[index / l.n_tiles];
    t.m0 = t.rows.row0;
    t.n0 = index % l.n_tiles * kHopperTileN;
    t.k_tiles = l.k_tiles;
  }
  return t;
}

// Persistent: each CTA takes tiles blockIdx.x, blockIdx.x + gridDim.x, ...; the producer and the consumers walk the
// same tiles and count stages across them, so the ring fills with the next tile's operands during an epilogue.
template <HopperGemm kKind>
__global__ void __launch_bounds__(kThreads, 1)
    hopper_grouped_gemm_kernel(const __grid_constant__ CUtensorMap a_map, const __grid_constant__ CUtensorMap b_map,
                               const __grid_constant__ CUtensorMap out_map, const HopperGemmLaunch l) {
  constexpr bool kGrad = kKind == HopperGemm::weight_grad;
  extern __shared__ uint8_t raw_smem[];
  uint8_t* smem = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(raw_smem) + 1023) & ~uintptr_t(1023));
  const uint32_t ring = shared_address(smem);
  uint8_t* staging = smem + kStages * kStageBytes;  // the consumer warpgroups' output buffers
  const uint32_t full = ring + kStages * kStageBytes + 2 * kStagingBytes;  // kStages barriers, then the `empty` ones
  const uint32_t empty = full + kStages * 8;
  const int tile_rows = l.tile_count ? *l.tile_count : l.tile_rows;  // a schedule on the device: its length
  const int tiles = tile_rows * l.n_tiles * (kGrad ? l.m_tiles : 1);
  const int warpgroup = int(threadIdx.x) / 128;
  if (threadIdx.x == 0) {
    for (int s = 0; s < kStages; ++s) {
      barrier_init(full + 8 * s, 1);
      barrier_init(empty + 8 * s, kConsumerWarps);
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();

  if (warpgroup == 0) {  // the producer: one thread issues every load; its warpgroup gives registers to the consumers
    asm volatile("setmaxnreg.dec.sync.aligned.u32 40;" ::: "memory");
    if (threadIdx.x != 0) return;
    int step = 0;  // stages filled so far, over every tile of this CTA
    for (int index = int(blockIdx.x); index < tiles; index += int(gridDim.x)) {
      const TileAt t = tile_at<kKind>(l, index);
      for (int kt = 0; kt < t.k_tiles; ++kt, ++step) {
        const int s = step % kStages;
        barrier_wait(empty + 8 * s, ((step / kStages) & 1) ^ 1);
        const uint32_t bar = full + 8 * s, a = ring + s * kStageBytes, b = a + kABytes;
        barrier_expect_bytes(bar, kStageBytes);
        if constexpr (kGrad) {
          const int row = t.rows.row0 + kt * kHopperTileK;
          for (int i = 0; i < kHopperTileM / 64; ++i)
            tma_load_2d(a + i * kBlockBytes, &a_map, t.m0 + 64 * i, row, bar);
          for (int i = 0; i < kHopperTileN / 64; ++i)
            tma_load_2d(b + i * kBlockBytes, &b_map, t.n0 + 64 * i, row, bar);
        } else {
          tma_load_2d(a, &a_map, kt * kHopperTileK, t.m0, bar);
          if constexpr (kKind == HopperGemm::forward_trans_w) {
            tma_load_3d(b, &b_map, kt * kHopperTileK, t.n0, t.rows.expert, bar);
          } else {
            for (int i = 0; i < kHopperTileN / 64; ++i)
              tma_load_3d(b + i * kBlockBytes, &b_map, t.n0 + 64 * i, kt * kHopperTileK, t.rows.expert, bar);
          }
        }
      }
    }
    return;
  }

  // The consumers: warpgroup c multiplies output rows 64 c .. 64 c + 63 of each tile.
  asm volatile("setmaxnreg.inc.sync.aligned.u32 232;" ::: "memory");
  const int c = warpgroup - 1;
  const int lane = int(threadIdx.x) % 32, warp = (int(threadIdx.x) / 32) % 4;
  __nv_bfloat16* out = static_cast<__nv_bfloat16*>(l.out);
  int step = 0;
  for (int index = int(blockIdx.x); index < tiles; index += int(gridDim.x)) {
    const TileAt t = tile_at<kKind>(l, index);
    float d[128];
#pragma unroll
    for (int i = 0; i < 128; ++i) d[i] = 0.0f;
    for (int kt = 0; kt < t.k_tiles; ++kt, ++step) {
      const int s = step % kStages;
      barrier_wait(full + 8 * s, (step / kStages) & 1);
      uint8_t* stage = smem + s * kStageBytes;
      if constexpr (kGrad) {
        const int valid = t.rows.row_end - (t.rows.row0 + kt * kHopperTileK);
        if (valid < kHopperTileK) {  // the group's last rows: zero the rest of both operands (6 blocks)
          const int chunks_per_block = (kHopperTileK - valid) * 8;  // 16-byte chunks
          for (int i = int(threadIdx.x) - 128; i < 6 * chunks_per_block; i += 256) {
            const int block = i / chunks_per_block, rest = i % chunks_per_block;
            uint8_t* base = block < 2 ? stage + block * kBlockBytes : stage + kABytes + (block - 2) * kBlockBytes;
            *reinterpret_cast<uint4*>(base + (valid + rest / 8) * 128 + (rest % 8) * 16) = make_uint4(0, 0, 0, 0);
          }
          asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
          asm volatile("bar.sync 1, 256;" ::: "memory");
        }
      }
      const uint32_t a = shared_address(stage) + c * 64 * 128, b = shared_address(stage) + kABytes;
      asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
#pragma unroll
      for (int j = 0; j < kHopperTileK / 16; ++j) {
        if constexpr (kGrad) {
          wgmma_m64n256k16<1, 1>(d, smem_descriptor(a + 2048 * j, kBlockBytes, 1024),
                                 smem_descriptor(b + 2048 * j, kBlockBytes, 1024));
        } else if constexpr (kKind == HopperGemm::forward_trans_w) {
          wgmma_m64n256k16<0, 0>(d, smem_descriptor(a + 32 * j, 16, 1024), smem_descriptor(b + 32 * j, 16, 1024));
        } else {
          wgmma_m64n256k16<0, 1>(d, smem_descriptor(a + 32 * j, 16, 1024),
                                 smem_descriptor(b + 2048 * j, kBlockBytes, 1024));
        }
      }
      asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
      asm volatile("wgmma.wait_group.sync.aligned 0;" ::: "memory");
      __syncwarp();
      if (lane == 0) barrier_arrive(empty + 8 * s);
    }

    // The epilogue. This thread's fragment is rows rr and rr + 8 of its warp's 16, two columns in each 8 of the 256.
    // A whole 64-row half goes out through its warpgroup's staging buffer (4 boxes of 64 x 64, 128-byte swizzle: the
    // fragment's stores hit 32 distinct banks) by TMA, stored or, accumulating, added into dw, while the next tile's
    // mainloop runs. A forward half that runs past its expert's rows is written from registers, row by row.
    const int half_row0 = t.m0 + 64 * c;
    const int rr = warp * 16 + lane / 4;
    if (kGrad || half_row0 + 64 <= t.rows.row_end) {
      const bool leader = threadIdx.x % 128 == 0;
      if (leader) asm volatile("cp.async.bulk.wait_group.read 0;" ::: "memory");  // the last store has read it
      asm volatile("bar.sync %0, 128;" ::"r"(2 + c) : "memory");
      uint8_t* mine = staging + c * kStagingBytes;
#pragma unroll
      for (int h = 0; h < 2; ++h)
#pragma unroll
        for (int j = 0; j < 32; ++j) {
          const int row = rr + 8 * h;
          uint8_t* at = mine + (j / 8) * kBlockBytes + row * 128 + (((j % 8) ^ (row % 8)) * 16) + 4 * (lane % 4);
          *reinterpret_cast<__nv_bfloat162*>(at) = __floats2bfloat162_rn(d[4 * j + 2 * h], d[4 * j + 2 * h + 1]);
        }
      asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
      asm volatile("bar.sync %0, 128;" ::"r"(2 + c) : "memory");
      if (leader) {
        const uint32_t src = shared_address(mine);
        for (int i = 0; i < 4; ++i) {
          if constexpr (kGrad) {
            if (l.accumulate)
              tma_add_3d(&out_map, t.n0 + 64 * i, half_row0, t.rows.expert, src + i * kBlockBytes);
            else
              tma_store_3d(&out_map, t.n0 + 64 * i, half_row0, t.rows.expert, src + i * kBlockBytes);
          } else {
            tma_store_2d(&out_map, t.n0 + 64 * i, half_row0, src + i * kBlockBytes);
          }
        }
        asm volatile("cp.async.bulk.commit_group;" ::: "memory");
      }
    } else {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int row = half_row0 + rr + 8 * h;
        if (row >= t.rows.row_end) continue;
        __nv_bfloat162* pairs = reinterpret_cast<__nv_bfloat162*>(out + int64_t(row) * l.ld + t.n0 + 2 * (lane % 4));
#pragma unroll
        for (int j = 0; j < 32; ++j) pairs[4 * j] = __floats2bfloat162_rn(d[4 * j + 2 * h], d[4 * j + 2 * h + 1]);
      }
    }
  }
  if (threadIdx.x % 128 == 0) asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");  // stores done before exit
}

#else  // compiled for another architecture: never launched (the registry line asks for sm_90)

template <HopperGemm kKind>
__global__ void hopper_grouped_gemm_kernel(const __grid_constant__ CUtensorMap, const __grid_constant__ CUtensorMap,
                                           const __grid_constant__ CUtensorMap, const HopperGemmLaunch) {}

#endif

constexpr int kScheduleThreads = 1024;

// One block: the experts' clamped row counts in shared memory, each thread a run of consecutive experts, an inclusive
// scan of the runs' entry counts (Hillis-Steele) to place them. The weight grad's order is a rank: the entries that
// sort before an expert's (more rows, or as many and a lower index), counted over every expert.
__global__ void __launch_bounds__(kScheduleThreads)
    hopper_schedule_kernel(const int32_t* __restrict__ offsets, int experts, int rows, bool weight_grad,
                           bool with_empty, HopperTile* __restrict__ tiles, int* __restrict__ count) {
  __shared__ int sizes[kHopperScheduleMaxExperts];
  __shared__ int scan[kScheduleThreads];
  const int t = int(threadIdx.x);
  const auto begin_of = [&](int e) { return min(max(offsets[e], 0), rows); };
  for (int e = t; e < experts; e += kScheduleThreads) {
    const int begin = begin_of(e);
    sizes[e] = min(max(offsets[e + 1], begin), rows) - begin;
  }
  __syncthreads();
  const int chunk = (experts + kScheduleThreads - 1) / kScheduleThreads;
  const int e0 = min(t * chunk, experts), e1 = min(e0 + chunk, experts);
  const auto listed = [&](int e) { return sizes[e] > 0 || with_empty; };
  int mine = 0;
  for (int e = e0; e < e1; ++e)
    mine += weight_grad ? int(listed(e)) : (sizes[e] + kHopperTileM - 1) / kHopperTileM;
  scan[t] = mine;
  __syncthreads();
  for (int step = 1; step < kScheduleThreads; step *= 2) {
    const int add = t >= step ? scan[t - step] : 0;
    __syncthreads();
    scan[t] += add;
    __syncthreads();
  }
  if (t == kScheduleThreads - 1) *count = scan[t];
  int at = scan[t] - mine;
  for (int e = e0; e < e1; ++e) {
    const int begin = begin_of(e), end = begin + sizes[e];
    if (!weight_grad) {
      for (int row = begin; row < end; row += kHopperTileM) tiles[at++] = HopperTile{e, row, end, 0};
      continue;
    }
    if (!listed(e)) continue;
    int rank = 0;
    for (int f = 0; f < experts; ++f)
      rank += int(listed(f) && (sizes[f] > sizes[e] || (sizes[f] == sizes[e] && f < e)));
    tiles[rank] = HopperTile{e, begin, end, 0};
  }
}

template <HopperGemm kKind>
void launch(const HopperGemmLaunch& l, const CUtensorMap& a, const CUtensorMap& b, const CUtensorMap& out,
            cudaStream_t stream) {
  auto* kernel = hopper_grouped_gemm_kernel<kKind>;
  LATHE_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmemBytes));
  int device = 0, sms = 0;
  LATHE_CUDA_CHECK(cudaGetDevice(&device));
  LATHE_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  const int64_t tiles = int64_t(l.tile_rows) * l.n_tiles * (kKind == HopperGemm::weight_grad ? l.m_tiles : 1);
  kernel<<<unsigned(tiles < sms ? tiles : sms), kThreads, kSmemBytes, stream>>>(a, b, out, l);
  LATHE_CUDA_LAUNCH_CHECK("hopper_grouped_gemm");
}

}  // namespace

void launch_hopper_schedule(const int32_t* offsets, int experts, int rows, bool weight_grad, bool with_empty,
                            HopperTile* tiles, int* count, cudaStream_t stream) {
  hopper_schedule_kernel<<<1, kScheduleThreads, 0, stream>>>(offsets, experts, rows, weight_grad, with_empty, tiles,
                                                             count);
  LATHE_CUDA_LAUNCH_CHECK("hopper_schedule");
}

void launch_hopper_grouped_gemm(const HopperGemmLaunch& l, const CUtensorMap& a, const CUtensorMap& b,
                                const CUtensorMap& out, cudaStream_t stream) {
  if (l.tile_rows == 0) return;
  switch (l.kind) {
    case HopperGemm::forward_trans_w: launch<HopperGemm::forward_trans_w>(l, a, b, out, stream); break;
    case HopperGemm::forward: launch<HopperGemm::forward>(l, a, b, out, stream); break;
    case HopperGemm::weight_grad: launch<HopperGemm::weight_grad>(l, a, b, out, stream); break;
  }
}

}  // namespace lathe::cuda
