// Launcher of the Hopper grouped GEMM (hopper_grouped_gemm.cu, compiled for sm_90a only): the MoE experts'
// grouped_matmul and grouped_matmul_weight_grad in bf16 through TMA loads and wgmma, registered in grouped_gemm.cpp
// as cuda/hopper_grouped_gemm, and the routed ops' (groups on the device). The tensor maps are built there, on the
// host, and so is the tile table for host groups; for groups on the device it is built there by
// launch_hopper_schedule. Free of fmt for nvcc.
#pragma once

#include <cuda.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace lathe::cuda {

// The CTA tile: 128 output rows (two consumer warpgroups of 64) by 256 output columns, 64 reduced elements a stage.
inline constexpr int kHopperTileM = 128;
inline constexpr int kHopperTileN = 256;
inline constexpr int kHopperTileK = 64;

// The three products (row-major terms; formulas at GroupedMatmulAttrs in ops/op_table.h):
//   forward_trans_w  y (P, N) = x_e (rows, K) w_e^T, w (E, N, K)   A = x K-major, B = w K-major
//   forward          y (P, N) = x_e (rows, K) w_e,   w (E, K, N)   A = x K-major, B = w N-major
//   weight_grad      dw_e (N, K) (+)= dy_e^T x_e                   A = dy M-major, B = x N-major, reduced over rows
enum class HopperGemm { forward_trans_w, forward, weight_grad };

// One CTA row of tiles: the forward's 128-row slice [row0, min(row0 + 128, row_end)) of expert `expert`, or the weight
// grad's whole group [row0, row_end).
struct HopperTile {
  int32_t expert, row0, row_end, unused;
};

// What the kernel needs besides the tensor maps (built by the caller: bf16, 128-byte swizzle; A's box 64 x 128
// (K-major) or 64 x 64 (M-major), B's 64 x 256 x 1 (K-major) or 64 x 64 (x 1) (N-major), the output's 64 x 64: y as
// (P, N), dw as (E, N, K) with its block stride).
struct HopperGemmLaunch {
  HopperGemm kind;
  const HopperTile* tiles;  // on the device: `tile_rows` entries, or *tile_count when that is set
  int tile_rows;            // rows of tiles (forward: 128-row slices; weight grad: non-empty groups); with
                            // tile_count, the most there can be (the grid's size)
  const int* tile_count;    // on the device, or nullptr: the rows of tiles launch_hopper_schedule wrote
  int n_tiles;              // output columns / 256
  int m_tiles;              // weight grad: output rows (N) / 128
  int k_tiles;              // forward: K / 64 (the weight grad's follow each group's rows)
  void* out;                // forward: y (P, N), bf16, for the 64-row halves that run past their expert
  int64_t ld;               // forward: y's row length N
  bool accumulate;          // weight grad: dw += instead of =
};

// The most experts launch_hopper_schedule takes (their row counts sit in shared memory).
inline constexpr int kHopperScheduleMaxExperts = 8192;

// Writes the tile table of moe_route's offsets (E + 2, i32, on the device; ranges clamped to [0, rows]) into `tiles`
// and its length into *count, on the device: the forward's 128-row slices of each expert in expert order, or (weight
// grad) the experts with rows, the most rows first (ties: the lower expert), then, `with_empty`, those without, whose
// tiles reduce nothing and so store zero blocks. Room: ceil(rows / 128) + E entries (forward), E (weight grad).
void launch_hopper_schedule(const int32_t* offsets, int experts, int rows, bool weight_grad, bool with_empty,
                            HopperTile* tiles, int* count, cudaStream_t stream);

// Launches the kernel on `stream`, one persistent CTA per SM at most (checks the launch).
void launch_hopper_grouped_gemm(const HopperGemmLaunch& l, const CUtensorMap& a, const CUtensorMap& b,
                                const CUtensorMap& out, cudaStream_t stream);

}  // namespace lathe::cuda
