// CPU reference of the Gated DeltaNet core (the gated delta rule), forward and backward, in two forms: the plain
// token-by-token recurrence and the chunked WY/UT form that the CUDA kernels implement (research note
// gated-deltanet.md §2.2, §3.2-3.5, whose symbols the code uses). Plain loops over host vectors, computed in T
// (float or double) with no fusion: the executable specification that GPU kernels are judged against.
// Conventions:
//  - per (document, value head h), with state S (d_k x d_v, HF/fla layout), alpha_t = e^{g_t}, s = query scale:
//        S <- alpha_t S;  u_t = beta_t (v_t - S^T k_t);  S <- S + k_t u_t^T;  o_t = S^T (s q_t)
//    i.e. decay first, then the delta correction, and the output reads the state AFTER the write;
//  - g is the log-decay (<= 0; the layer computes g = -exp(A_log) softplus(a + dt_bias)); beta = sigmoid(b);
//  - the L2 norm of q and k is the caller's job (done outside, as Megatron does; fla fuses it), but the query scale
//    (default d_k^{-1/2}, which HF/fla apply inside the kernel) is applied here;
//  - q and k come per KEY head, (T, H_k, d_k): value head h reads key head h / (H_v / H_k) (HF's repeat_interleave);
//    the repeat happens inside, so dq and dk come back summed over each group of H_v / H_k value heads;
//  - packed documents: the state starts from zero (or the given initial state) at every cu_seqlens boundary and
//    nothing crosses a boundary in either pass; chunks start at each document's first token (last chunk partial).
// Covered by tests/models/test_gdn_reference.cpp.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

namespace lathe {

inline constexpr int64_t kGdnChunk = 64;  // fla's and the CUDA kernels' chunk size

struct GdnDims {
  int64_t k_heads = 0;  // H_k (q and k heads)
  int64_t v_heads = 0;  // H_v, a multiple of H_k
  int64_t k_dim = 0;    // d_k
  int64_t v_dim = 0;    // d_v
  double scale = 0.0;   // query scale s; 0 = d_k^{-1/2}
};

// Views of the inputs (not owned). Row-major, token-major; N = cu_seqlens.size() - 1 documents.
template <typename T>
struct GdnInputs {
  std::span<const T> q;                 // (T, H_k, d_k), L2-normalised by the caller
  std::span<const T> k;                 // (T, H_k, d_k), L2-normalised by the caller
  std::span<const T> v;                 // (T, H_v, d_v)
  std::span<const T> g;                 // (T, H_v) log-decay, <= 0
  std::span<const T> beta;              // (T, H_v) write strength, sigmoid(b)
  std::span<const int32_t> cu_seqlens;  // (N + 1) from 0 to T, non-decreasing (empty documents allowed)
  std::span<const T> initial_state;     // (N, H_v, d_k, d_v), or empty for zero states
};

template <typename T>
struct GdnOutputs {
  std::vector<T> o;            // (T, H_v, d_v)
  std::vector<T> final_state;  // (N, H_v, d_k, d_v): the state after each document's last token
  // (T / kGdnChunk + N, H_v, d_k, d_v): the state before each kGdnChunk-token chunk, chunks starting at each
  // document's first token and numbered document by document; zero past the last chunk (gdn_recurrent_forward only:
  // the saved states of the gated_delta_rule op).
  std::vector<T> chunk_states;
};

template <typename T>
struct GdnGrads {
  std::vector<T> dq, dk;             // (T, H_k, d_k), summed over the value heads of each key head
  std::vector<T> dv;                 // (T, H_v, d_v)
  std::vector<T> dg, dbeta;          // (T, H_v)
  std::vector<T> d_initial_state;    // (N, H_v, d_k, d_v), also when the initial state was empty (zeros)
};

// Token by token, exactly the recurrence above. A document of one token with an initial state is a decoding step.
template <typename T>
GdnOutputs<T> gdn_recurrent_forward(const GdnDims& dims, const GdnInputs<T>& in);

// Reverse mode through the recurrence (the states are recomputed and kept per document). `d_o`: (T, H_v, d_v);
// `d_final_state`: (N, H_v, d_k, d_v) or empty for zero.
template <typename T>
GdnGrads<T> gdn_recurrent_backward(const GdnDims& dims, const GdnInputs<T>& in, std::span<const T> d_o,
                                   std::span<const T> d_final_state);

// The chunked form (§3.2): per chunk of `chunk` tokens the WY matrices R = (I + L)^{-1}, W, U, then one sequential
// scan of chunk states, then the outputs. Equals the recurrence up to rounding for any chunk >= 1.
template <typename T>
GdnOutputs<T> gdn_chunked_forward(const GdnDims& dims, const GdnInputs<T>& in, int64_t chunk = kGdnChunk);

// The chunked backward of §3.5: recompute R, W, U and the chunk-start states H[c]; one reverse scan for the
// chunk-end state gradients dH[c] and dDelta; then per chunk (independent) dq, dk, db through the output and state
// terms, the WY backward, and dg as the reverse cumsum of db inside each chunk.
template <typename T>
GdnGrads<T> gdn_chunked_backward(const GdnDims& dims, const GdnInputs<T>& in, std::span<const T> d_o,
                                 std::span<const T> d_final_state, int64_t chunk = kGdnChunk);

}  // namespace lathe
