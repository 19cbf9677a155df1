// AdamW over a list of parameters, with fp32 master weights for low-precision parameters: bf16/f16 parameters get
// an f32 master copy that the update runs on, and the same adamw kernel writes the new master, rounded, into the
// parameter (bitwise what a cast would write); f32 and f64 parameters are their own masters. Moments m and v have the
// master's dtype. With AdamWConfig::state_dtype = bf16 (Hugging Face's "bf16 parameters" recipe), bf16 parameters get
// no master: the parameter is updated in place with bf16 moments (f32 arithmetic, each value rounded to bf16 on store,
// so updates below half a bf16 ulp of a weight are lost); f32/f64 parameters are unaffected. The update is the
// `adamw` op (ops/op_table.h: torch.optim.AdamW semantics), so it runs on whatever device the parameters live on.
// Like torch, a parameter without a gradient (undefined Parameter::grad) is skipped: no decay, no moment update,
// and its own step count (bias correction) does not advance.
// State files: safetensors with <param>.exp_avg, <param>.exp_avg_sq and, for parameters with a master,
// <param>.master, plus metadata {"format": "lathe.adamw", "step": N}. Covered by tests/unit/test_optim.cpp.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "backend/runtime.h"
#include "core/parameter.h"

namespace lathe {

// Weight decay goes to every parameter except the excluded kinds below. The defaults follow nanoGPT, Megatron
// and Hugging Face: no decay for norm gains and biases, decay for matrices including the embedding (which is
// also the LM head when tied).
struct AdamWConfig {
  double beta1 = 0.9;
  double beta2 = 0.999;
  double eps = 1e-8;
  double weight_decay = 0.0;
  bool decay_norms = false;       // 1-D parameters other than biases: RMSNorm gains (and per-head scales)
  bool decay_biases = false;      // parameters whose name ends in "bias"
  bool decay_embeddings = true;   // parameters whose name contains "embed_tokens"
  std::vector<std::string> no_decay;  // further exclusions: names containing any of these strings
  // f32: bf16/f16 parameters get an f32 master and f32 moments. bf16: bf16 parameters are their own masters with bf16
  // moments (f16 parameters are refused: use f32). f32 and f64 parameters keep their own dtype either way.
  DType state_dtype = DType::F32;
};

// Bytes of optimizer state (master and moments) per element of a parameter of `param` dtype under `state_dtype`:
// 12 for bf16/f16 with f32 states, 4 for bf16 with bf16 states, 8 for f32, 16 for f64.
size_t adamw_state_bytes_per_element(DType param, DType state_dtype);

// Whether `config` applies weight decay to a parameter of this name and shape (false when weight_decay is 0).
bool weight_decay_applies(const AdamWConfig& config, const std::string& name, const Shape& shape);

class AdamW {
 public:
  // Every parameter must be contiguous and on one device; the pointers must outlive the optimizer.
  AdamW(Runtime& rt, std::vector<Parameter*> params, AdamWConfig config);
  AdamW(Runtime& rt, std::vector<Parameter>& params, AdamWConfig config);

  // One update of every parameter that has a gradient. `grad_scale` multiplies the gradients (e.g.
  // 1/accumulation times the clipping factor). Bias correction uses each parameter's own step count.
  void step(double lr, double grad_scale = 1.0);

  // The same update in two halves: prepare() builds and checks the update's ops from the gradients as they are now
  // (host work: about a millisecond for a few hundred parameters), so a trainer can do it while the device still
  // computes the gradient norm; step(prepared, lr, grad_scale) then only sets the learning rate and scale and queues
  // them. Nothing changes until step runs; a prepared update that is not run (a skipped step) is dropped. The
  // gradients, parameters and states must not be replaced in between. step(lr, s) is step(prepare(), lr, s).
  //
  // Segments: with `segment_of` (one entry per parameter, non-decreasing), no call mixes two segments and the calls
  // run in segment order; step calls `segment_done(s)` once the last call of segment s is queued (a segment without a
  // gradient to update has no calls and no report). ZeRO all-gathers a bucket's updated ranges while the update of the
  // next buckets runs (parallel/zero.h).
  struct Prepared {
    std::vector<OpCall> calls;    // adamw_list calls; attrs' lr and grad_scale set by step
    std::vector<size_t> segment;  // per call: its segment (0 without segments)
    std::vector<size_t> slots;    // the slots the calls update (their step counts advance)
    int64_t for_step = -1;        // step_count() when prepared
  };
  Prepared prepare(const std::vector<size_t>& segment_of = {}) const;
  void step(Prepared prepared, double lr, double grad_scale = 1.0,
            const std::function<void(size_t segment)>& segment_done = {});

  int64_t step_count() const { return step_count_; }  // calls of step() (or the loaded value)
  const AdamWConfig& config() const { return config_; }
  size_t size() const { return slots_.size(); }
  const Parameter& parameter(size_t i) const { return *slots_[i].param; }
  bool decays(size_t i) const { return slots_[i].decay; }
  bool has_master(size_t i) const { return slots_[i].master.defined(); }
  // The f32 master a low-precision parameter is updated through (the parameter itself otherwise: f32/f64 parameters,
  // and bf16 ones with bf16 states), m and v.
  const Tensor& master(size_t i) const;
  const Tensor& exp_avg(size_t i) const { return slots_[i].m; }
  const Tensor& exp_avg_sq(size_t i) const { return slots_[i].v; }
  size_t state_bytes() const;  // masters and moments
  // The colocated RL handover: offload() moves the masters and moments to host memory (their device memory goes back
  // to the allocator, for the rollout's cache) and restore() brings them back, bit for bit; step(), prepare(), save()
  // and load() need them restored. Both return the bytes moved; a second offload() (or a restore() without one) moves
  // nothing. The host memory (pinned for a GPU: asynchronous copies, one wait a move) is kept for the next offload.
  size_t offload();
  size_t restore();
  bool offloaded() const { return offloaded_; }

  // Writes the state atomically (safetensors). Tensors are stored in their own dtype; a piece of a sharded parameter
  // (ZeRO) records where it sits in the whole (metadata "shard.<name>": global shape, offset, flat_begin, group).
  void save(const std::string& path) const;
  // Reads a state written by save(). Every parameter must have its exp_avg and exp_avg_sq, with its shape;
  // names the optimizer does not know are an error, and so is a piece saved as another piece (or whole). Masters
  // cross precisions: a <param>.master onto an f32
  // parameter is copied into the parameter; a bf16 parameter without one (state saved from f32 parameters)
  // takes its master from the parameter's current value. Moments cross f32 and f64 (they follow the parameters'
  // dtype), but bf16 moments where this optimizer keeps f32/f64 ones, or the reverse, are an error naming the tensor
  // and both dtypes: the state dtype is a setting (state_dtype), and a silent switch would change the numerics.
  void load(const std::string& path);

 private:
  struct Slot {
    Parameter* param;
    Tensor master;  // f32; undefined when the parameter is its own master (f32/f64, or bf16 with bf16 states)
    Tensor m, v;
    int64_t steps = 0;
    bool decay = false;
  };

  Runtime* rt_;
  Device device_;
  AdamWConfig config_;
  std::vector<Slot> slots_;
  int64_t step_count_ = 0;
  bool offloaded_ = false;
  std::vector<Tensor> host_;  // offload()'s host copies (master, m, v per slot), kept for the next move
};

}  // namespace lathe
