// The kernel registry: (op, device type, dtype) -> kernels, each with its own supports() predicate, plus
// composite fallbacks built from other ops. resolve() picks the first exact kernel whose predicate holds,
// else the first composite whose predicate holds, else throws an error naming op, device, dtype and every
// predicate that failed. Nothing is patched later: what resolve() returns is what runs.
// Covered by tests/unit/test_registry.cpp and, through every op, tests/ops.
#pragma once

#include <functional>
#include <string>
#include <vector>

#include "backend/backend.h"
#include "core/tensor.h"
#include "ops/op_table.h"

namespace lathe {

class KernelRegistry;
class OpProfiler;  // backend/profiler.h

// Everything one op invocation needs. Outputs are allocated by the caller (ops/ops.cpp or the op tests).
struct OpCall {
  OpId op;
  std::vector<Tensor> inputs;
  std::vector<Tensor> outputs;
  OpAttrs attrs;

  Device device() const { return outputs.at(0).device(); }
  // The dtype that selects kernels: that of the first input.
  DType key_dtype() const { return inputs.at(0).dtype(); }
  template <typename A> const A& attr() const { return std::get<A>(attrs); }
};

struct Resolution;

// Receives every resolution run_op makes (nested ones included), e.g. for kernel coverage or profiling.
using ResolutionObserver = std::function<void(const OpCall&, const Resolution&)>;

// Where an op runs: the device, its allocator and stream, and the registry for nested ops (composites).
struct ExecContext {
  const KernelRegistry& registry;
  DeviceBackend& backend;
  Device device;
  Allocator& allocator;
  Stream& stream;
  const ResolutionObserver* observer = nullptr;  // optional
  OpProfiler* profiler = nullptr;                 // optional: times every kernel run_op dispatches
  // GEMM kernels may time their candidate algorithms on the first call of a shape and keep the fastest
  // (Runtime::set_gemm_autotune): faster steps, but the choice may differ from one process to the next.
  bool gemm_autotune = false;
};

struct Support {
  bool ok = true;
  std::string reason;  // why not, when !ok
  static Support yes() { return {}; }
  static Support no(std::string why) { return {false, std::move(why)}; }
};

using SupportsFn = std::function<Support(const OpCall&)>;
using RunFn = std::function<void(const OpCall&, ExecContext&)>;

struct KernelDef {
  OpId op;
  DeviceType device;
  DType dtype;
  std::string name;  // "<backend>/<algorithm>", e.g. "cuda/cublaslt_gemm"
  SupportsFn supports;
  RunFn run;
};

// A composite runs on any device by calling other ops; its predicate sees the registry so it can require
// the ops it is made of.
struct CompositeDef {
  OpId op;
  std::string name;  // "composite/<how>"
  std::function<Support(const OpCall&, const KernelRegistry&)> supports;
  RunFn run;
};

struct Resolution {
  std::string name;      // kernel or composite name
  bool is_composite = false;
  std::string fallback_reason;  // for a composite: why no exact kernel was taken
  const RunFn* run = nullptr;
};

class KernelRegistry {
 public:
  void add(KernelDef kernel);
  void add(CompositeDef composite);

  Resolution resolve(const OpCall& call) const;  // throws lathe::Error when nothing fits
  // As resolve(), but returns false and fills `why` instead of throwing.
  bool try_resolve(const OpCall& call, Resolution* out, std::string* why) const;
  // True if an exact kernel for (op, device, dtype) exists and accepts `call`.
  bool has_exact(const OpCall& call) const;
  // True if some exact kernel is registered for (op, device type, dtype), whatever its predicate.
  bool has_kernel(OpId op, DeviceType device, DType dtype) const;
  // The exact kernel registered as `name` for (op, device type, dtype), or nullptr (benchmarks that time one kernel).
  const KernelDef* find(OpId op, DeviceType device, DType dtype, const std::string& name) const;

  const std::vector<KernelDef>& kernels() const { return kernels_; }
  const std::vector<CompositeDef>& composites() const { return composites_; }

 private:
  std::vector<KernelDef> kernels_;
  std::vector<CompositeDef> composites_;
};

// Predicates shared by kernels that index their tensors densely.
Support outputs_contiguous(const OpCall& call);  // every output contiguous
Support all_contiguous(const OpCall& call);      // every input and output contiguous
Support rows_layout(const OpCall& call);         // every input and output contiguous or 2-D with contiguous rows

// Resolves and runs one op call.
void run_op(ExecContext& ctx, const OpCall& call);

}  // namespace lathe
