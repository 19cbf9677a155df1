// Context parallelism for Gated DeltaNet layers whose heads are too few for the head all-to-all (each rank a cp-th of
// the value heads over every row; docs/parallel.md, "Gated DeltaNet by passing states"): each rank runs the layer on
// its own rows, and what a document carries from one rank's rows into the next rank's is passed along the cp group:
// the causal conv's history (the W - 1 pre-conv rows before a rank's first row, all-gathered) and the delta rule's
// state (sent from rank r to rank r + 1 after r's rows, in rank order; the gradients back in reverse order). The
// recurrence composes: a document's state after rank r's rows is where rank r + 1's rows start.
//
// The rule's backward with a state coming in and a state gradient coming back reuses the zero-state backward op:
// d_k "writer" tokens put the incoming state in place (key e_i, beta 1, no decay, value = the state's row i: each
// sets row i of a zero state), and d_k "reader" tokens read the outgoing state out (query e_j, beta 0, no decay:
// output j is the state's row j times the query scale) — so the incoming state's gradient is the writers' value
// gradient, and the outgoing state's gradient enters as the readers' output gradient. Covered by
// tests/parallel/test_tensor_parallel.cpp (ContextParallelEqualsTheWholeModel: configs whose heads the all-to-all
// cannot split).
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "backend/registry.h"
#include "comm/communicator.h"

namespace lathe {

class Runtime;

// Where a cp rank's rows [first, first + rows) (the batch's first `real` of them, the rest zero padding) meet the
// batch's documents.
struct CpChain {
  int rank = 0, ranks = 1;
  int64_t first = 0, rows = 0, real = 0;
  int64_t doc_start = 0;          // the global row where the rank's first document began
  bool from_prev = false;         // that document began on an earlier rank (a state comes in)
  bool to_next = false;           // the rank's last document of the batch goes on in the next rank's rows
  std::vector<int32_t> cu;        // the rank's documents as offsets into its rows (the padding rows: one more)
  int64_t last_real_doc() const;  // the index (in cu) of the rank's last document of batch rows, or -1
};

// The chain position of rank `rank` of `ranks`, each holding `rows` rows of the batch whose document offsets are
// `host_cu` (its last entry the batch's tokens).
CpChain cp_chain(std::span<const int32_t> host_cu, int64_t rows, int rank, int ranks);

// The causal conv's input over the rank's rows: (history + rows, C), the `history` rows before the rank's first (zero
// where they are not its first document's; every rank's last `history` rows all-gathered over `cp`) then x. With
// conv_offsets (cu with its first document widened by the history rows) the conv over it equals the one-process
// conv's rows.
Tensor conv_input_with_history(ExecContext& cx, Communicator& cp, const CpChain& ch, const Tensor& x, int64_t history);
std::vector<int32_t> conv_offsets(const CpChain& ch, int64_t history);
// conv_input_with_history's backward: the history rows' gradient (history, C) added to the ranks that hold those rows
// (an all-reduce of ranks x history x C over `cp`), into each rank's d_x (rows, C).
void add_history_grad(ExecContext& cx, Communicator& cp, const CpChain& ch, const Tensor& d_history, Tensor& d_x);

// gated_delta_rule over the rank's rows (q, k (rows, H_k, d_k), v (rows, H_v, d_v), g, beta (rows, H_v)) with the
// documents of ch.cu (`cu`, on the device), the first starting from the state received from rank - 1 when it began
// there; the last's final state sent to rank + 1 when it goes on. {o (rows, H_v, d_v), the state received (H_v, d_k,
// d_v) in gdn_state_dtype, undefined when none}.
std::vector<Tensor> rule_over_chain(ExecContext& cx, Communicator& cp, const CpChain& ch, const Tensor& q,
                                    const Tensor& k, const Tensor& v, const Tensor& g, const Tensor& beta,
                                    const Tensor& cu);
// Its backward: receives the gradient of the state sent to rank + 1 (when it was), sends that of the state received to
// rank - 1. {dq, dk, dv, dg, dbeta} over the rank's rows.
std::vector<Tensor> rule_over_chain_backward(Runtime& rt, ExecContext& cx, Communicator& cp, const CpChain& ch,
                                             const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& g,
                                             const Tensor& beta, const Tensor& d_o, const Tensor& state_in);

}  // namespace lathe
