#include "testing/op_check.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <random>
#include <set>

#include "ops/ops.h"

namespace lathe {

namespace {

constexpr size_t kGuardBytes = 256;  // keeps the output 256-byte aligned, as cuBLASLt likes
constexpr uint8_t kPoison = 0xFF;    // NaN in f32, bf16 and f16

using Values = std::vector<double>;

// Input values already rounded to `dtype`, so the reference sees exactly what the device sees.
// Integers are drawn from [1, 100], so every cast between integer types (and to u8) is defined.
Values random_values(std::mt19937_64& rng, int64_t n, DType dtype, bool nonnegative = false,
                     std::pair<double, double> range = {-2.0, 2.0}) {
  Values v(static_cast<size_t>(n));
  std::vector<uint8_t> tmp(dtype_size(dtype));
  if (nonnegative) range.first = std::max(range.first, 0.0);
  for (double& x : v) {
    if (is_floating(dtype)) {
      do x = std::uniform_real_distribution<double>(range.first, range.second)(rng); while (std::abs(x) < 1e-3);
    } else if (dtype == DType::Bool) {
      x = double(rng() % 2);
    } else {
      x = double(1 + rng() % 100);
    }
    store_from_double(tmp.data(), dtype, 0, x);
    x = load_as_double(tmp.data(), dtype, 0);
  }
  return v;
}

std::vector<uint8_t> encode(const Values& v, DType dtype) {
  std::vector<uint8_t> bytes(v.size() * dtype_size(dtype));
  for (size_t i = 0; i < v.size(); ++i) store_from_double(bytes.data(), dtype, int64_t(i), v[i]);
  return bytes;
}

Values to_values(Runtime& rt, const Tensor& t) {
  const Tensor host = rt.copy_to(t, Device::cpu());
  Values v(static_cast<size_t>(host.numel()));
  for (int64_t i = 0; i < host.numel(); ++i) v[size_t(i)] = load_as_double(host.data_ptr(), host.dtype(), i);
  return v;
}

// Uploads contiguous values of `shape`; with `transpose`, the values fill a tensor of the last two dims
// swapped, which is then transposed back into a non-contiguous view of `shape`.
Tensor make_input(Runtime& rt, const Values& v, Shape shape, DType dtype, Device device, bool transpose) {
  if (!transpose) return rt.from_host(encode(v, dtype).data(), shape, dtype, device);
  std::swap(shape[shape.size() - 1], shape[shape.size() - 2]);
  return rt.from_host(encode(v, dtype).data(), shape, dtype, device).transpose(-1, -2);
}

// Values of a (possibly strided) input as the op sees them, in logical order of its shape.
Values logical_values(const Values& stored, const Shape& shape, bool transpose) {
  if (!transpose) return stored;
  const int64_t rows = shape[shape.size() - 2], cols = shape.back();
  const int64_t batch = shape_numel(shape) / (rows * cols);
  Values out(stored.size());
  for (int64_t b = 0; b < batch; ++b)
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t c = 0; c < cols; ++c) out[size_t(b * rows * cols + r * cols + c)] = stored[size_t(b * rows * cols + c * rows + r)];
  return out;
}

Tensor guarded_output(ExecContext& ctx, const TensorSpec& spec) {
  const size_t bytes = size_t(shape_numel(spec.shape)) * dtype_size(spec.dtype);
  auto storage = std::make_shared<Storage>(ctx.allocator, bytes + 2 * kGuardBytes);
  ctx.backend.fill_bytes(storage->data(), kPoison, bytes + 2 * kGuardBytes, ctx.stream);
  return Tensor(storage, spec.shape, contiguous_strides(spec.shape), int64_t(kGuardBytes / dtype_size(spec.dtype)),
                spec.dtype);
}

// Empty string when the guard bytes around `t` are intact.
std::string check_guards(Runtime& rt, const Tensor& t) {
  const Storage& s = *t.storage();
  std::vector<uint8_t> host(s.nbytes());
  ExecContext ctx = rt.context(t.device());
  ctx.stream.synchronize();
  ctx.backend.copy(host.data(), Device::cpu(), s.data(), t.device(), s.nbytes(), ctx.stream);
  ctx.stream.synchronize();
  for (size_t i = 0; i < kGuardBytes; ++i) {
    if (host[i] != kPoison) return fmt::format("write before the output (guard byte {})", i);
    if (host[host.size() - 1 - i] != kPoison) return fmt::format("write past the output (guard byte {})", i);
  }
  return {};
}

struct Compare {
  double nmse = 0;
  int64_t non_finite = 0;
};

Compare compare(const Values& got, const Values& ref) {
  double err = 0, norm = 0;
  Compare c;
  for (size_t i = 0; i < ref.size(); ++i) {
    if (!std::isfinite(got[i])) ++c.non_finite;
    err += (got[i] - ref[i]) * (got[i] - ref[i]);
    norm += ref[i] * ref[i];
  }
  c.nmse = norm > 0 ? err / norm : err;
  return c;
}

// Reference values of the inputs on the CPU: f64, or i32 for index inputs.
std::vector<Tensor> reference_inputs(Runtime& rt, const std::vector<Values>& logical, const OpCase& oc) {
  std::vector<Tensor> out;
  for (size_t i = 0; i < logical.size(); ++i) {
    const bool is_index = i < oc.index_values.size() && !oc.index_values[i].empty();
    const DType dt = is_index ? DType::I32 : DType::F64;
    out.push_back(rt.from_host(encode(logical[i], dt).data(), oc.inputs[i], dt, Device::cpu()));
  }
  return out;
}

// The op's first output on the CPU (the loss is its dot with R).
Values output_of(Runtime& rt, ExecContext& cpu, const OpCase& oc, const std::vector<Tensor>& in) {
  OpAttrs attrs = oc.attrs;
  if (auto* mm = std::get_if<MatmulAttrs>(&attrs)) mm->beta = 0.0f;  // beta * C0 is constant in the inputs
  return to_values(rt, call_op(cpu, oc.op, in, attrs)[0]);
}

// Central finite differences of L = sum(op(x) * R) against the analytic gradients, in f64 on the CPU. The difference
// L(x + h) - L(x - h) is summed from the outputs' differences, not taken between the two sums: over a large output
// the sums' rounding would otherwise swamp it.
std::string finite_difference_check(Runtime& rt, const OpCase& oc, const std::vector<Values>& logical,
                                    const Values& r, const std::vector<Tensor>& grads, double* max_err) {
  ExecContext cpu = rt.context(Device::cpu());
  const double h = 1e-6;
  *max_err = 0;
  for (size_t i = 0; i < logical.size(); ++i) {
    if (!grads[i].defined()) continue;
    const Values g = to_values(rt, grads[i]);
    const int64_t n = int64_t(logical[i].size());
    const int64_t step = std::max<int64_t>(1, n / 48);  // at most ~48 elements per input
    for (int64_t j = 0; j < n; j += step) {
      std::vector<Values> plus = logical, minus = logical;
      plus[i][size_t(j)] += h;
      minus[i][size_t(j)] -= h;
      const Values yp = output_of(rt, cpu, oc, reference_inputs(rt, plus, oc));
      const Values ym = output_of(rt, cpu, oc, reference_inputs(rt, minus, oc));
      double diff = 0;
      for (size_t k = 0; k < yp.size(); ++k) diff += (yp[k] - ym[k]) * r[k];
      const double numeric = diff / (2 * h);
      const double err = std::abs(numeric - g[size_t(j)]) / std::max(1.0, std::abs(numeric));
      *max_err = std::max(*max_err, err);
      if (err > 1e-6)
        return fmt::format("finite differences: input {} element {}: analytic {:.9g}, numeric {:.9g}", i, j,
                           g[size_t(j)], numeric);
    }
  }
  return {};
}

bool matches(const OpCase& oc, const OpCheckOptions& o) {
  if (!o.op.empty() && o.op != op_name(oc.op)) return false;
  return o.params.empty() || oc.params.find(o.params) != std::string::npos;
}

struct KernelKey {
  std::string name;
  OpId op;
  DeviceType device;
  DType dtype;
  auto operator<=>(const KernelKey&) const = default;
};

}  // namespace

DType op_case_input_dtype(const OpCase& c, size_t i, DType row) {
  const bool accum = std::find(c.accumulation_inputs.begin(), c.accumulation_inputs.end(), i) !=
                     c.accumulation_inputs.end();
  return accum ? (row == DType::F64 ? DType::F64 : DType::F32) : row;
}

double nmse_threshold(DType t) {
  switch (t) {
    case DType::F64: return 1e-24;
    case DType::F32: return 1e-10;
    case DType::F16: return 1e-5;
    case DType::BF16: return 1e-4;
    default: return 0.0;  // integer results must be exact
  }
}

namespace {

// Checks one case on one device and dtype; fills `res` and records the exact kernels that ran.
void check_row(Runtime& rt, const OpCase& oc, size_t case_index, Device device, DType dtype,
               const OpCheckOptions& options, const ResolutionObserver* observer, OpCheckResult& res) {
  std::mt19937_64 rng(options.seed ^ (case_index * 0x9E3779B97F4A7C15ull) ^ (uint64_t(dtype) << 56));
  ExecContext ctx = rt.context(device);
  ctx.observer = observer;
  ExecContext cpu = rt.context(Device::cpu());

  // Inputs: the stored values (what the device gets) and the logical values (what the reference sees).
  std::vector<Values> logical;
  std::vector<Tensor> dev_in, ref_in;
  for (size_t i = 0; i < oc.inputs.size(); ++i) {
    const bool is_index = i < oc.index_values.size() && !oc.index_values[i].empty();
    if (is_index) {
      logical.push_back(oc.index_values[i]);
      dev_in.push_back(rt.from_host(encode(logical.back(), DType::I32).data(), oc.inputs[i], DType::I32, device));
      ref_in.push_back(rt.from_host(encode(logical.back(), DType::I32).data(), oc.inputs[i], DType::I32, Device::cpu()));
      continue;
    }
    // Casting a negative float to u8 is undefined: draw non-negative values for that case.
    const bool to_unsigned = oc.op == OpId::cast && std::get<CastAttrs>(oc.attrs).to == DType::U8;
    const bool ranged = i < oc.value_ranges.size() && oc.value_ranges[i].first < oc.value_ranges[i].second;
    const DType in_dtype = op_case_input_dtype(oc, i, dtype);
    const bool fixed = i < oc.fixed_values.size() && !oc.fixed_values[i].empty();
    const Values stored = fixed ? oc.fixed_values[i]
                                : random_values(rng, shape_numel(oc.inputs[i]), in_dtype, to_unsigned,
                                                ranged ? oc.value_ranges[i] : std::pair<double, double>{-2.0, 2.0});
    const bool tr = oc.transpose_first && i == 0;
    logical.push_back(logical_values(stored, oc.inputs[i], tr));
    dev_in.push_back(make_input(rt, stored, oc.inputs[i], in_dtype, device, tr));
    ref_in.push_back(rt.from_host(logical.back().data(), oc.inputs[i], DType::F64, Device::cpu()));
  }

  const std::vector<TensorSpec> specs = infer_outputs(oc.op, dev_in, oc.attrs);
  OpCall call{oc.op, dev_in, {}, oc.attrs};
  for (const TensorSpec& spec : specs) call.outputs.push_back(guarded_output(ctx, spec));
  const bool accumulate = oc.op == OpId::matmul && std::get<MatmulAttrs>(oc.attrs).beta != 0.0f;
  Values initial;
  if (accumulate) {  // beta != 0 reads the output: start it from random values instead of poison
    initial = random_values(rng, shape_numel(specs[0].shape), specs[0].dtype);
    const std::vector<uint8_t> bytes = encode(initial, specs[0].dtype);
    ctx.backend.copy(call.outputs[0].data_ptr(), device, bytes.data(), Device::cpu(), bytes.size(), ctx.stream);
  }
  Resolution resolution;
  std::string why;
  if (!ctx.registry.try_resolve(call, &resolution, &why)) {
    res.status = OpCheckResult::Status::Skip;
    res.detail = why;
    return;
  }
  res.kernel = resolution.name;
  if (observer) (*observer)(call, resolution);
  (*resolution.run)(call, ctx);
  ctx.stream.synchronize();

  // Reference outputs: the CPU f64 kernels (cast: the host conversion, rounded to the target dtype).
  std::vector<Tensor> ref_out;
  if (oc.op == OpId::cast) {
    const DType to = std::get<CastAttrs>(oc.attrs).to;
    Values ref = logical[0];
    std::vector<uint8_t> tmp(dtype_size(to));
    for (double& x : ref) {
      store_from_double(tmp.data(), to, 0, x);
      x = load_as_double(tmp.data(), to, 0);
    }
    ref_out.push_back(rt.from_host(ref.data(), specs[0].shape, DType::F64, Device::cpu()));
  } else if (accumulate) {
    ref_out.push_back(rt.from_host(initial.data(), specs[0].shape, DType::F64, Device::cpu()));
    matmul_into(cpu, ref_in[0], ref_in[1], ref_out[0], std::get<MatmulAttrs>(oc.attrs));
  } else {
    ref_out = call_op(cpu, oc.op, ref_in, oc.attrs);
  }

  const double thr = nmse_threshold(dtype);
  std::vector<std::string> problems;
  std::vector<std::string> figures;
  for (size_t o = 0; o < specs.size(); ++o) {
    if (is_opaque_output(oc.op, o)) continue;  // a kernel's own cache (e.g. the GDN chunk cache): nothing to compare
    if (std::string g = check_guards(rt, call.outputs[o]); !g.empty()) problems.push_back(fmt::format("output {}: {}", o, g));
    const Compare c = compare(to_values(rt, call.outputs[o]), to_values(rt, ref_out[o]));
    const double t = std::max(thr, nmse_threshold(specs[o].dtype));
    if (c.non_finite) problems.push_back(fmt::format("output {}: {} non-finite values (unwritten?)", o, c.non_finite));
    if (!(c.nmse <= t)) problems.push_back(fmt::format("output {}: nmse {:.3g} > {:.1g}", o, c.nmse, t));
    figures.push_back(fmt::format("nmse {:.2g}", c.nmse));
  }
  res.detail = fmt::format("{}", fmt::join(figures, ", "));

  if (oc.differentiable && options.backward && is_floating(dtype)) {
    const Values r = random_values(rng, shape_numel(specs[0].shape), dtype);
    const Tensor dy_dev = rt.from_host(encode(r, dtype).data(), specs[0].shape, dtype, device);
    const Tensor dy_ref = rt.from_host(r.data(), specs[0].shape, DType::F64, Device::cpu());
    const std::vector<Tensor> g_dev = op_backward(ctx, oc.op, dev_in, oc.attrs, call.outputs, dy_dev);
    const std::vector<Tensor> g_ref = op_backward(cpu, oc.op, ref_in, oc.attrs, ref_out, dy_ref);
    double worst = 0;
    for (size_t i = 0; i < g_ref.size(); ++i) {
      if (!g_ref[i].defined()) continue;
      LATHE_CHECK(g_dev[i].defined() && g_dev[i].shape() == oc.inputs[i], "op-check: bad gradient {}", i);
      const Compare b = compare(to_values(rt, g_dev[i]), to_values(rt, g_ref[i]));
      worst = std::max(worst, b.nmse);
      if (b.non_finite || !(b.nmse <= thr)) problems.push_back(fmt::format("grad {} nmse {:.3g} > {:.1g}", i, b.nmse, thr));
    }
    res.detail += fmt::format(", grad nmse {:.2g}", worst);
    if (options.finite_differences && device.is_cpu() && dtype == DType::F64) {
      double fd_err = 0;
      if (std::string fd = finite_difference_check(rt, oc, logical, r, g_ref, &fd_err); !fd.empty()) problems.push_back(fd);
      res.detail += fmt::format(", fd err {:.2g}", fd_err);
    }
  }
  if (!problems.empty()) {
    res.status = OpCheckResult::Status::Fail;
    res.detail = fmt::format("{}", fmt::join(problems, "; "));
  }
}

}  // namespace

std::vector<OpCheckResult> run_op_check(Runtime& rt, const OpCheckOptions& options,
                                        const std::function<void(const OpCheckResult&)>& report) {
  std::vector<Device> devices = options.devices;
  if (devices.empty()) {
    devices.push_back(Device::cpu());
    if (rt.cuda_built())
      for (int i = 0; i < rt.backend(DeviceType::CUDA).device_count(); ++i) devices.push_back(Device::cuda(i));
  }
  std::vector<OpCheckResult> results;
  std::set<KernelKey> exercised;
  const ResolutionObserver observer = [&](const OpCall& call, const Resolution& r) {
    if (!r.is_composite) exercised.insert({r.name, call.op, call.device().type, call.key_dtype()});
  };
  auto emit = [&](OpCheckResult r) {
    if (report) report(r);
    results.push_back(std::move(r));
  };
  const std::vector<OpCase> cases = all_op_cases();
  for (size_t ci = 0; ci < cases.size(); ++ci) {
    const OpCase& oc = cases[ci];
    if (!matches(oc, options)) continue;
    for (const Device& device : devices) {
      for (DType dtype : options.dtypes.empty() ? oc.dtypes : options.dtypes) {
        if (std::find(oc.dtypes.begin(), oc.dtypes.end(), dtype) == oc.dtypes.end()) continue;
        OpCheckResult res{OpCheckResult::Status::Pass, std::string(op_name(oc.op)), oc.params, device.str(),
                          std::string(dtype_name(dtype)), "", ""};
        try {
          check_row(rt, oc, ci, device, dtype, options, &observer, res);
        } catch (const std::exception& e) {
          res.status = OpCheckResult::Status::Fail;
          res.detail = e.what();
        }
        emit(res);
      }
    }
  }
  // Coverage: every registered kernel of a checked device type must have run at least once (directly or
  // inside a composite or a backward).
  if (options.op.empty() && options.params.empty() && options.dtypes.empty() && options.backward) {
    std::set<DeviceType> types;
    for (const Device& d : devices) types.insert(d.type);
    for (const KernelDef& k : rt.registry().kernels()) {
      if (!types.count(k.device) || exercised.count({k.name, k.op, k.device, k.dtype})) continue;
      emit({OpCheckResult::Status::Fail, std::string(op_name(k.op)), "coverage", device_type_name(k.device),
            std::string(dtype_name(k.dtype)), k.name, "no op-check case exercises this kernel"});
    }
  }
  return results;
}

}  // namespace lathe
