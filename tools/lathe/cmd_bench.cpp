// `lathe bench --shape 0.6b|1.7b|4b|q35-0.8b|CONFIG.json [--seq 4096] [--micro-batch 4] [--steps 10] [--warmup 3]
//  [--device cuda] [--lora-rank 16] [--recompute] [--nondeterministic] [--gemm-autotune]
//  [--optimizer-states f32|bf16] [--profile]`:
// training throughput of a Qwen3 (or Qwen3.5: q35-0.8b or a qwen3_5_text config.json, random-initialised by the
// family) of a given shape with random weights (BenchWeights below) on a synthetic packed batch (micro-batch documents
// of seq random tokens, next-token labels). Each timed step is a whole training step — zero grads, loss forward +
// backward, global grad norm, AdamW (fp32 masters for bf16 parameters, the trainer's default; or bf16 states without
// masters, --optimizer-states bf16) — between two device synchronisations. Prints one human line and one JSON line
// (tokens/s, MFU by train/flops.h, peak memory, ms/step, card), and where a timed step recorded the memory plan (fewer
// than 2 warm-up steps) a line of the other timed steps' figures ("steady"). With --profile, one more step runs with an
// OpProfiler (backend/profiler.h) and the per-kernel table of that step follows, with the share of the step that no
// kernel covers. bench/hf_side_by_side.py runs it beside the Hugging Face baseline.
// Covered by tests/e2e/test_bench.cpp; the range checks of its numeric options by tests/e2e/test_cli_outputs.cpp.
#include <fmt/format.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <chrono>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <numeric>
#include <optional>
#include <random>

#include "backend/profiler.h"
#include "train/step_profile.h"
#include "cli_support.h"
#include "commands.h"
#include "model/lora.h"
#include "model/causal_lm.h"
#include "optim/adamw.h"
#include "optim/clip.h"
#include "train/flops.h"

namespace lathe::cli {

namespace {

using Clock = std::chrono::steady_clock;

struct Args {
  std::string shape, device = "cuda", dtype, optimizer_states = "f32";
  int64_t seq = 4096, micro_batch = 4, steps = 10, warmup = 3, lora_rank = 0, layers = 0, grad_accum = 1;
  int64_t recompute_layers = -1;
  uint64_t seed = 1;
  bool recompute = false, keeps_attention = false, keeps_gdn = false, profile = false, nondeterministic = false, gemm_autotune = false;
  bool moe_host_groups = false;
  bool no_memory_plan = false;
  bool memory_report = false;
  double moe_padded_max_waste = ModelOptions{}.moe_padded_max_waste;
};

// The Qwen3 dense shapes of the baseline (HF config.json of Qwen/Qwen3-0.6B, -1.7B, -4B).
nlohmann::json shape_config(const std::string& shape) {
  struct Dims {
    int64_t layers, hidden, ffn, heads;
  };
  static const std::map<std::string, Dims> kShapes = {
      {"0.6b", {28, 1024, 3072, 16}}, {"1.7b", {28, 2048, 6144, 16}}, {"4b", {36, 2560, 9728, 32}}};
  std::string key = shape;
  std::transform(key.begin(), key.end(), key.begin(), [](unsigned char c) { return char(std::tolower(c)); });
  if (const auto it = kShapes.find(key); it != kShapes.end()) {
    const Dims& d = it->second;
    return {{"model_type", "qwen3"},          {"vocab_size", 151936},          {"hidden_size", d.hidden},
            {"intermediate_size", d.ffn},     {"num_hidden_layers", d.layers}, {"num_attention_heads", d.heads},
            {"num_key_value_heads", 8},       {"head_dim", 128},               {"rms_norm_eps", 1e-6},
            {"rope_theta", 1000000.0},        {"tie_word_embeddings", true},   {"max_position_embeddings", 40960}};
  }
  if (key == "q35-0.8b") {  // the Qwen3.5-0.8B shape of issue 8 (research/gated-deltanet.md sec. 1.1)
    nlohmann::json layer_types = nlohmann::json::array();
    for (int i = 0; i < 24; ++i) layer_types.push_back((i + 1) % 4 == 0 ? "full_attention" : "linear_attention");
    return {{"model_type", "qwen3_5_text"},    {"vocab_size", 248320},         {"hidden_size", 1024},
            {"intermediate_size", 3584},       {"num_hidden_layers", 24},      {"num_attention_heads", 8},
            {"num_key_value_heads", 2},        {"head_dim", 256},              {"rms_norm_eps", 1e-6},
            {"linear_num_key_heads", 16},      {"linear_num_value_heads", 16}, {"linear_key_head_dim", 128},
            {"linear_value_head_dim", 128},    {"linear_conv_kernel_dim", 4},  {"layer_types", layer_types},
            {"hidden_act", "silu"},            {"tie_word_embeddings", true},  {"max_position_embeddings", 32768},
            {"rope_parameters", {{"rope_type", "default"}, {"rope_theta", 1e7}, {"partial_rotary_factor", 0.25}}}};
  }
  if (key == "30b-a3b") {  // Qwen3-30B-A3B (issue 9), cut to --layers layers (bench_config sets them)
    return {{"model_type", "qwen3_moe"},       {"vocab_size", 151936},        {"hidden_size", 2048},
            {"intermediate_size", 6144},       {"num_hidden_layers", 48},     {"num_attention_heads", 32},
            {"num_key_value_heads", 4},        {"head_dim", 128},             {"rms_norm_eps", 1e-6},
            {"num_experts", 128},              {"num_experts_per_tok", 8},    {"moe_intermediate_size", 768},
            {"norm_topk_prob", true},          {"decoder_sparse_step", 1},    {"mlp_only_layers", nlohmann::json::array()},
            {"router_aux_loss_coef", 0.001},   {"output_router_logits", false}, {"rope_theta", 1000000.0},
            {"tie_word_embeddings", false},    {"max_position_embeddings", 40960}};
  }
  namespace fs = std::filesystem;
  const fs::path path = fs::is_directory(shape) ? fs::path(shape) / "config.json" : fs::path(shape);
  LATHE_CHECK(fs::is_regular_file(path), "bench: --shape {}: not one of 0.6b, 1.7b, 4b, q35-0.8b, 30b-a3b and no "
              "config.json there", shape);
  std::ifstream f(path);
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(f);
  } catch (const nlohmann::json::exception& e) {
    LATHE_FAIL("bench: {}: invalid JSON: {}", path.string(), e.what());
  }
  if (j.is_object() && !j.contains("model_type")) j["model_type"] = "qwen3";
  return j;
}


// Benchmark weights. Qwen3Model::random draws one normal sample per weight on one thread (minutes at 4B), and
// the values do not change the work, so the bench writes a temporary model folder instead: hashed uniform values of
// the same std (0.02), unit norm gains, f32 (the loader's copy-only path), written in parallel (to /dev/shm when it
// has room), then loaded by Qwen3Model::load and removed. Names and shapes are the Hugging Face checkpoint's; the loader refuses any mismatch.
class BenchWeights {
 public:
  BenchWeights(const nlohmann::json& config, const ModelConfig& c, uint64_t seed) {
    namespace fs = std::filesystem;
    std::vector<std::pair<std::string, std::vector<int64_t>>> specs = {{"model.embed_tokens.weight", {c.vocab_size, c.hidden_size}}};
    const int64_t q = c.num_heads * c.head_dim, kv = c.num_kv_heads * c.head_dim;
    for (int64_t i = 0; i < c.num_layers; ++i) {
      const std::string p = fmt::format("model.layers.{}.", i);
      for (auto& [name, shape] : std::vector<std::pair<std::string, std::vector<int64_t>>>{
               {"input_layernorm.weight", {c.hidden_size}},          {"self_attn.q_proj.weight", {q, c.hidden_size}},
               {"self_attn.k_proj.weight", {kv, c.hidden_size}},     {"self_attn.v_proj.weight", {kv, c.hidden_size}},
               {"self_attn.o_proj.weight", {c.hidden_size, q}},      {"self_attn.q_norm.weight", {c.head_dim}},
               {"self_attn.k_norm.weight", {c.head_dim}},            {"post_attention_layernorm.weight", {c.hidden_size}},
           })
        specs.push_back({p + name, shape});
      const int64_t e = c.num_experts, in = c.moe_intermediate_size;
      if (c.sparse_layer(i)) {  // the fused expert layout (model/moe_layer.h)
        specs.push_back({p + "mlp.gate.weight", {e, c.hidden_size}});
        specs.push_back({p + "mlp.experts.gate_up_proj", {e, 2 * in, c.hidden_size}});
        specs.push_back({p + "mlp.experts.down_proj", {e, c.hidden_size, in}});
      } else {
        specs.push_back({p + "mlp.gate_proj.weight", {c.intermediate_size, c.hidden_size}});
        specs.push_back({p + "mlp.up_proj.weight", {c.intermediate_size, c.hidden_size}});
        specs.push_back({p + "mlp.down_proj.weight", {c.hidden_size, c.intermediate_size}});
      }
    }
    specs.push_back({"model.norm.weight", {c.hidden_size}});
    if (!c.tie_word_embeddings) specs.push_back({"lm_head.weight", {c.vocab_size, c.hidden_size}});
    uint64_t bytes = 0;
    for (const auto& [name, shape] : specs) bytes += 4 * uint64_t(std::accumulate(shape.begin(), shape.end(), int64_t(1), std::multiplies<>()));
    std::error_code ec;
    const fs::space_info shm = fs::space("/dev/shm", ec);
    const fs::path root = !ec && shm.available > bytes + bytes / 4 + (1ull << 30) ? fs::path("/dev/shm") : fs::temp_directory_path();
    dir_ = root / fmt::format("lathe-bench-{}", getpid());
    fs::remove_all(dir_);
    fs::create_directories(dir_);
    std::ofstream(dir_ / "config.json") << config.dump(2);
    // safetensors: 8-byte header length, JSON header, then the tensors' bytes in header order.
    nlohmann::ordered_json header = nlohmann::ordered_json::object();
    uint64_t offset = 0;
    for (const auto& [name, shape] : specs) {
      const uint64_t n = 4 * uint64_t(std::accumulate(shape.begin(), shape.end(), int64_t(1), std::multiplies<>()));
      header[name] = {{"dtype", "F32"}, {"shape", shape}, {"data_offsets", {offset, offset + n}}};
      offset += n;
    }
    std::string h = header.dump();
    h.resize((h.size() + 7) / 8 * 8, ' ');
    std::ofstream f(dir_ / "model.safetensors", std::ios::binary);
    const uint64_t hlen = h.size();
    f.write(reinterpret_cast<const char*>(&hlen), 8);
    f.write(h.data(), std::streamsize(h.size()));
    const float bound = 0.02f * std::sqrt(3.0f);  // uniform(-b, b) has std 0.02
    std::vector<float> buf;
    for (size_t t = 0; t < specs.size(); ++t) {
      const auto& shape = specs[t].second;
      buf.resize(size_t(std::accumulate(shape.begin(), shape.end(), int64_t(1), std::multiplies<>())));
      const bool gain = shape.size() == 1;
      const int64_t n = int64_t(buf.size());
#pragma omp parallel for schedule(static)
      for (int64_t i = 0; i < n; ++i) {
        uint64_t z = seed * 0x9E3779B97F4A7C15ull + (uint64_t(t) << 40) + uint64_t(i);  // splitmix64
        z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
        z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
        z ^= z >> 31;
        buf[size_t(i)] = gain ? 1.0f : (float(z >> 40) * (1.0f / 16777216.0f) * 2.0f - 1.0f) * bound;
      }
      f.write(reinterpret_cast<const char*>(buf.data()), std::streamsize(buf.size() * 4));
    }
    f.close();
    LATHE_CHECK(f.good(), "bench: cannot write the temporary weights under {} ({} bytes)", dir_.string(), bytes);
  }
  ~BenchWeights() {
    std::error_code ec;
    std::filesystem::remove_all(dir_, ec);
  }
  BenchWeights(const BenchWeights&) = delete;
  BenchWeights& operator=(const BenchWeights&) = delete;
  std::string dir() const { return dir_.string(); }

 private:
  std::filesystem::path dir_;
};

// --memory-report: the recorded step's peak (the blocks alive then, grouped by size, largest first) and what lived
// outside the step as it began, so that memory beyond parameters, gradients and optimizer states can be traced.
void print_memory_report(const PlannedAllocator& plan, const std::vector<Parameter>& params, const AdamW& opt) {
  const PeakReport r = plan.peak_report();
  if (r.event < 0) {
    fmt::print("memory report: no recorded step was planned\n");
    return;
  }
  constexpr double kMiB = 1048576.0;
  double param_bytes = 0, at_peak = 0;  // the trained parameters (a LoRA run's adapters); their gradients alike
  for (const Parameter& p : params) param_bytes += double(p.value.numel() * int64_t(p.value.itemsize()));
  for (const AllocationRecord& b : r.blocks) at_peak += double(b.bytes);
  const double states = double(opt.state_bytes());
  const double live = double(r.at_begin.allocated), asked = double(r.at_begin.requested);
  fmt::print("memory report: as the recorded step began, {:.1f} MiB were live outside it: trained parameters {:.1f}, "
             "optimizer states {:.1f}, other tensors {:.1f}, and {:.1f} in blocks larger than their tensors asked for\n",
             live / kMiB, param_bytes / kMiB, states / kMiB, (asked - param_bytes - states) / kMiB, (live - asked) / kMiB);
  fmt::print("memory report: the step peaks at event {} of {} with {:.1f} MiB alive in {} blocks (the gradients, if all "
             "alive, {:.1f} MiB); by size:\n", r.event, r.events, at_peak / kMiB, r.blocks.size(), param_bytes / kMiB);
  std::vector<std::pair<size_t, std::vector<const AllocationRecord*>>> by_size;  // largest first, as r.blocks
  for (const AllocationRecord& b : r.blocks) {
    if (by_size.empty() || by_size.back().first != b.bytes) by_size.push_back({b.bytes, {}});
    by_size.back().second.push_back(&b);
  }
  for (size_t i = 0; i < by_size.size() && i < 24; ++i) {
    const auto& [bytes, blocks] = by_size[i];
    std::string lives;  // the lifetimes of the first few, in order of birth (as peak_report lists a size's blocks)
    for (size_t k = 0; k < blocks.size() && k < 8; ++k)
      lives += fmt::format(" {}-{}", blocks[k]->born, blocks[k]->died);
    fmt::print("  {:>12} bytes x {:>4} = {:>9.1f} MiB; alive over events{}{}\n", bytes, blocks.size(),
               double(bytes) * double(blocks.size()) / kMiB, lives, blocks.size() > 8 ? " ..." : "");
  }
}

void run(const Args& a) {
  LATHE_CHECK(a.seq >= 2 && a.micro_batch >= 1 && a.steps >= 1 && a.warmup >= 0 && a.lora_rank >= 0,
              "bench: need --seq >= 2, --micro-batch >= 1, --steps >= 1, --warmup >= 0, --lora-rank >= 0");
  LATHE_CHECK(a.seq * a.micro_batch < (int64_t(1) << 31), "bench: --seq x --micro-batch must stay below 2^31 tokens");
  LATHE_CHECK(a.recompute_layers < 0 || a.recompute, "bench: --recompute-layers {} needs --recompute",
              a.recompute_layers);
  Runtime rt;
  rt.set_gemm_autotune(a.gemm_autotune);
  const Device device = parse_device(a.device);
  rt.check_device(device);
  PlannedAllocator* const plan = a.no_memory_plan ? nullptr : &rt.enable_memory_plan(device);
  const DType dtype = !a.dtype.empty() ? dtype_from_name(a.dtype) : device.is_cpu() ? DType::F32 : DType::BF16;
  LATHE_CHECK(a.optimizer_states == "f32" || a.optimizer_states == "bf16",
              "bench: --optimizer-states {}: expected f32 or bf16", a.optimizer_states);
  const DType state_dtype = dtype_from_name(a.optimizer_states);
  LATHE_CHECK(state_dtype == DType::F32 || dtype == DType::BF16,
              "bench: --optimizer-states bf16 keeps bf16 parameters without masters, but the parameters are {} "
              "(--dtype bf16, the default on CUDA)", dtype_name(dtype));
  nlohmann::json config_json = shape_config(a.shape);
  if (a.layers > 0) {  // a cut of the shape: its first --layers layers
    config_json["num_hidden_layers"] = a.layers;
    if (config_json.contains("layer_types"))
      config_json["layer_types"] = std::vector<nlohmann::json>(config_json["layer_types"].begin(),
                                                               config_json["layer_types"].begin() + a.layers);
  }
  const ModelConfig mc = parse_model_config(config_json, "bench --shape " + a.shape);
  const bool lora = a.lora_rank > 0;
  ModelOptions mo;
  mo.device = device;
  mo.dtype = dtype;
  mo.recompute = a.recompute;
  mo.recompute_layers = a.recompute_layers;
  mo.recompute_keeps_attention = a.keeps_attention;
  mo.recompute_keeps_gdn = a.keeps_gdn;
  mo.deterministic = !a.nondeterministic;
  mo.train_base = !lora;
  mo.moe_padded_max_waste = a.moe_padded_max_waste;
  mo.moe_host_groups = a.moe_host_groups;
  const auto t_init = Clock::now();
  std::unique_ptr<CausalLm> loaded;
  double write_s = 0;
  if (mc.is_hybrid()) {  // the family's own initialisation (one thread; seconds at 0.8B)
    loaded = random_causal_lm(rt, mc, mo, a.seed);
  } else {
    const BenchWeights weights(mc.raw, mc, a.seed);
    write_s = std::chrono::duration<double>(Clock::now() - t_init).count();
    loaded = load_causal_lm(rt, weights.dir(), mo);
  }
  CausalLm& model = *loaded;
  const double init_s = std::chrono::duration<double>(Clock::now() - t_init).count();
  std::unique_ptr<LoraBank> bank;
  if (lora) {  // one adapter on every linear module, as bench/lora_tenants_bench.cpp
    LoraConfig lc;
    lc.rank = a.lora_rank;
    lc.alpha = 2.0 * double(a.lora_rank);
    lc.validate("bench", mc);
    bank = std::make_unique<LoraBank>(rt, mc, device, dtype, std::vector<LoraConfig>{lc});
    bank->init(0, a.seed);
    model.attach_lora(bank.get());
  }
  std::vector<Parameter>& params = lora ? bank->flat_parameter(0) : model.parameters();
  AdamWConfig acfg;
  acfg.state_dtype = state_dtype;
  AdamW opt(rt, params, acfg);

  // micro-batch documents of seq random tokens each, next-token labels (the last position of each has none).
  std::mt19937_64 rng(a.seed);
  std::vector<int32_t> ids(size_t(a.micro_batch * a.seq)), cu = {0};
  for (int32_t& x : ids) x = int32_t(rng() % uint64_t(mc.vocab_size));
  for (int64_t s = 0; s < a.micro_batch; ++s) cu.push_back(int32_t((s + 1) * a.seq));
  const double adapter_params = lora ? double(bank->parameter_count(0)) : 0.0;
  const double fpt = lora ? lora_flops_per_token(mc, adapter_params, cu) : flops_per_token(mc, cu);
  double attention_fwd = 0;  // forward FLOPs of one layer's attention over the batch: 2 S^2 Hq D per document
  for (size_t i = 0; i + 1 < cu.size(); ++i) attention_fwd += 2.0 * double(cu[i + 1] - cu[i]) * double(cu[i + 1] - cu[i]);
  attention_fwd *= double(mc.num_heads * mc.head_dim);
  PackedBatch batch = make_packed_batch(rt, device, ids, cu, next_token_labels(ids, cu), mc.vocab_size);
  if (lora) set_segments(batch, {{batch.tokens(), 0, 1.0, a.seed}});
  const double tokens = double(batch.tokens() * a.grad_accum);  // a step's: grad_accum micro-batches

  std::vector<double> losses;
  double expert_load = 0;  // MoE: the largest max / mean of tokens per expert over the layers (1: balanced)
  auto step = [&] {  // one memory plan window, as in the trainer: the gradients die inside it
    const MemoryPlanWindow window(plan);
    if (lora) bank->zero_grads();
    else model.zero_grads();
    ExecContext ctx = rt.context(device);  // made here so that a profiler set on the runtime reaches it
    std::optional<PendingGradNorm> pending;
    std::optional<AdamW::Prepared> update;
    BackwardHooks hooks;
    hooks.queued = [&] {  // queued before the host waits for the loss
      pending.emplace(launch_grad_norm(ctx, params));
      update.emplace(opt.prepare());  // host work while the device sums the squares
    };
    for (int64_t m = 0; m < a.grad_accum; ++m) {  // the step's micro-batches, the last one queueing the optimizer
      const LossResult r = model.loss(batch, true, 1.0 / double(a.grad_accum),
                                      m + 1 == a.grad_accum ? hooks : BackwardHooks{});
      losses.push_back(r.loss);
      for (const ExpertLoadStat& s : r.expert_load) expert_load = std::max(expert_load, s.max_over_mean);
    }
    if (!pending) {  // a model that does not call hooks.queued
      pending.emplace(launch_grad_norm(ctx, params));
      update.emplace(opt.prepare());
    }
    const double norm = pending->read();
    opt.step(std::move(*update), 1e-5, std::isfinite(norm) ? clip_factor(norm, 1.0) : 0.0);
    if (!lora) model.zero_grads();
  };
  auto timed_step = [&] {
    rt.synchronize(device);
    const auto t0 = Clock::now();
    step();
    rt.synchronize(device);
    return std::chrono::duration<double>(Clock::now() - t0).count();
  };
  for (int64_t i = 0; i < a.warmup; ++i) timed_step();
  Allocator& device_memory = rt.backend(device.type).allocator(device.index);
  device_memory.reset_peak();  // steady_peak_mib: the timed steps only
  std::vector<double> times;
  const int64_t downloads_before = rt.downloads();
  // The memory plan is recorded in one step (the second by default): that step allocates block by block and then lays
  // out the arena, so it is slower than the steps after it. Where it falls among the timed steps (--warmup below 2),
  // the steady figures leave it out.
  int64_t recording_step = -1;
  for (int64_t i = 0; i < a.steps; ++i) {
    const bool planned_before = plan && plan->plan_stats().planned;
    times.push_back(timed_step());
    if (plan && !planned_before && plan->plan_stats().planned) recording_step = i;
  }
  // The step's waits for the device's queued work to read results back (losses, the gradient norm, MoE routing).
  const double reads_per_step = double(rt.downloads() - downloads_before) / double(a.steps);
  double total = 0;
  for (double t : times) total += t;
  const double step_s = total / double(times.size());
  const bool steady_apart = recording_step >= 0 && times.size() > 1;
  const double steady_s =
      steady_apart ? (total - times[size_t(recording_step)]) / double(times.size() - 1) : step_s;
  const double min_s = *std::min_element(times.begin(), times.end());
  const double peak_mib = peak_memory_mib(rt, device);
  const AllocatorStats memory = device_memory.stats();
  const PlanStats ps = plan ? plan->plan_stats() : PlanStats{};
  const std::string card = rt.backend(device.type).info(device.index).name;
  const double peak = device.is_cuda() ? peak_flops(card) : 0.0;
  const double tps = tokens / step_s;
  // The model FLOP utilisation of a step of `seconds` (where the device has a peak figure).
  const auto mfu = [&](double seconds) { return fpt * (tokens / seconds) / peak; };
  std::string flop_model = lora ? "4N (frozen base: forward + input gradient) + 6N_adapter + causal attention 6*L*Hq*D*S"
                                : "6N + causal attention 6*L*Hq*D*S";
  if (mc.is_hybrid())
    flop_model += " over the full-attention layers + chunked GDN core per GDN layer and value head "
                  "(22 dk dv + 24 C dk + 14 C dv + 4 C^2, C = 64)";
  const std::string what = lora ? fmt::format("LoRA r{} all-linear ({} trainable)", a.lora_rank, human(adapter_params))
                                : "full fine-tuning";
  // What the optimizer keeps, in words: f32/f64 parameters are their own masters whatever the setting.
  std::string states = " with fp32 AdamW masters";
  if (dtype == DType::F32 || dtype == DType::F64) states = fmt::format(" with {} AdamW states", dtype_name(dtype));
  else if (state_dtype == DType::BF16) states = " with bf16 AdamW states (no fp32 masters)";
  fmt::print("bench: {} {} ({} matmul weights), seq {} x micro-batch {} = {} tokens/step, {}, {}{} on {} ({}): "
             "{:.1f} ms/step (min {:.1f}), {} tokens/s, {}peak {:.0f} MiB [{:.4g} GFLOP/token = {}]\n",
             mc.model_type, a.shape, human(matmul_parameter_count(mc)), a.seq, a.micro_batch, int64_t(tokens), what,
             dtype_name(dtype), states, device.str(), card,
             1e3 * step_s, 1e3 * min_s, human(tps), peak > 0 ? fmt::format("MFU {:.1f}%, ", 100.0 * mfu(step_s)) : "",
             peak_mib, fpt / 1e9, flop_model);
  if (steady_apart)
    fmt::print("steady: {:.1f} ms/step, {} tokens/s{} without timed step {} (it recorded the memory plan)\n",
               1e3 * steady_s, human(tokens / steady_s),
               peak > 0 ? fmt::format(", MFU {:.1f}%", 100.0 * mfu(steady_s)) : "", recording_step + 1);
  fmt::print("reads back: {:.1f} a step (each a wait for the device's queued work)\n", reads_per_step);
  fmt::print("memory: {:.0f} MiB peak over the timed steps, {:.0f} MiB reserved at the end; {}\n",
             double(memory.peak_allocated) / 1048576.0, double(memory.reserved) / 1048576.0,
             !plan ? "no memory plan (--no-memory-plan)"
             : ps.planned ? fmt::format("memory plan: arena {:.0f} MiB (peak live {:.0f} MiB) for {} of {} blocks a "
                                        "step, {} hits, {} misses", double(ps.arena_bytes) / 1048576.0,
                                        double(ps.peak_live_bytes) / 1048576.0, ps.planned_blocks, ps.recorded_blocks,
                                        ps.hits, ps.misses)
                          : fmt::format("no memory plan: {}", ps.not_planned.empty() ? "fewer than 2 steps" : ps.not_planned));
  if (a.memory_report && plan) print_memory_report(*plan, params, opt);
  if (a.memory_report && !plan) fmt::print("memory report: none without the memory plan (--no-memory-plan)\n");
  nlohmann::json j = {{"shape", a.shape},
                      {"layers", mc.num_layers},
                      {"seq", a.seq},
                      {"micro_batch", a.micro_batch},
                      {"grad_accum", a.grad_accum},
                      {"tokens_per_step", int64_t(tokens)},
                      {"tokens_per_s", tps},
                      {"mfu", peak > 0 ? nlohmann::json(mfu(step_s)) : nlohmann::json(nullptr)},
                      {"peak_mib", peak_mib},
                      {"step_ms", 1e3 * step_s},
                      {"step_ms_min", 1e3 * min_s},
                      // the timed steps but the memory plan's recording one, where there are others (recording_step:
                      // its index among the timed steps, -1 where a warm-up step recorded it or none did)
                      {"steady_step_ms", 1e3 * steady_s},
                      {"steady_mfu", peak > 0 ? nlohmann::json(mfu(steady_s)) : nlohmann::json(nullptr)},
                      {"recording_step", recording_step},
                      {"reads_per_step", reads_per_step},
                      {"moe_host_groups", a.moe_host_groups},
                      {"step_ms_each", [&] {
                         std::vector<double> ms;
                         for (double t : times) ms.push_back(1e3 * t);
                         return ms;
                       }()},
                      {"steps", a.steps},
                      {"warmup", a.warmup},
                      {"card", card},
                      {"device", device.str()},
                      {"dtype", dtype_name(dtype)},
                      {"lora_rank", a.lora_rank},
                      {"recompute", a.recompute},
                      {"recompute_layers", a.recompute_layers},
                      {"recompute_keeps_attention", a.keeps_attention},
                      {"recompute_keeps_gdn", a.keeps_gdn},
                      {"deterministic", !a.nondeterministic},
                      {"gemm_autotune", a.gemm_autotune},
                      {"optimizer_states", a.optimizer_states},
                      {"optimizer_state_mib", double(opt.state_bytes()) / 1048576.0},
                      {"flops_per_token", fpt},
                      {"flop_model", flop_model},
                      {"peak_flops", peak},
                      {"init_s", init_s},
                      {"init_write_s", write_s},
                      {"loss_first", losses.front()},
                      {"loss_last", losses.back()},
                      {"moe_expert_load_max_over_mean", expert_load},
                      {"steady_peak_mib", double(memory.peak_allocated) / 1048576.0},
                      {"reserved_mib", double(memory.reserved) / 1048576.0},
                      {"memory_plan", plan ? nlohmann::json{{"planned", ps.planned},
                                                            {"not_planned", ps.not_planned},
                                                            {"arena_mib", double(ps.arena_bytes) / 1048576.0},
                                                            {"peak_live_mib", double(ps.peak_live_bytes) / 1048576.0},
                                                            {"planned_blocks", ps.planned_blocks},
                                                            {"recorded_blocks", ps.recorded_blocks},
                                                            {"hits", ps.hits},
                                                            {"misses", ps.misses}}
                                           : nlohmann::json(nullptr)}};
  if (a.profile) {
    OpProfiler profiler(rt.backend(device.type), device);
    rt.set_profiler(&profiler);
    double wall_s = 0;
    try {
      wall_s = timed_step();
    } catch (...) {
      rt.set_profiler(nullptr);
      throw;
    }
    rt.set_profiler(nullptr);
    j["profile"] = print_step_profile(profiler.collect(), 1e3 * wall_s, tokens, fpt * tokens, attention_fwd, peak);
  }
  fmt::print("{}\n", j.dump());
  std::fflush(stdout);
}

}  // namespace

void add_bench_command(CLI::App& app, int& exit_code) {
  auto* cmd = app.add_subcommand("bench", "Training throughput of a random-init Qwen3 shape on a synthetic batch (tokens/s, "
                                          "MFU, peak memory; --profile: time per kernel of one step)");
  auto a = std::make_shared<Args>();
  cmd->add_option("--shape", a->shape, "0.6b, 1.7b, 4b (Qwen3 shapes), q35-0.8b (Qwen3.5), 30b-a3b (Qwen3-MoE) or a "
                  "config.json (or a folder holding one)")
      ->required();
  cmd->add_option("--seq", a->seq, "tokens per document")
      ->capture_default_str()
      ->check(number_in(2, double(int64_t(1) << 31)));
  cmd->add_option("--layers", a->layers, "keep only the first N layers of the shape (0: all); 30b-a3b needs a cut to fit "
                  "one GPU")
      ->check(number_in(0));
  cmd->add_option("--micro-batch", a->micro_batch, "documents per step")
      ->capture_default_str()
      ->check(number_in(1, double(int64_t(1) << 31)));
  cmd->add_option("--grad-accum", a->grad_accum, "micro-batches a step (the optimizer once a step)")
      ->capture_default_str()
      ->check(number_in(1));
  cmd->add_option("--steps", a->steps, "timed steps")->capture_default_str()->check(number_in(1));
  cmd->add_option("--warmup", a->warmup, "untimed steps first")->capture_default_str()->check(number_in(0));
  cmd->add_option("--device", a->device, "cpu or cuda[:N]")->capture_default_str();
  cmd->add_option("--dtype", a->dtype, "parameter dtype (default bf16 on CUDA, f32 on the CPU)");
  cmd->add_option("--lora-rank", a->lora_rank, "0: full fine-tuning; r: one rank-r LoRA adapter (alpha 2r) on every linear "
                                               "module of a frozen base")
      ->capture_default_str()
      ->check(number_in(0));
  cmd->add_option("--seed", a->seed, "weights and token ids")->capture_default_str();
  cmd->add_flag("--recompute", a->recompute, "recompute layer activations in the backward pass");
  cmd->add_option("--recompute-layers", a->recompute_layers,
                  "train.recompute_layers: under --recompute, only the first N layers recompute (-1: all)")
      ->capture_default_str()
      ->check(CLI::Range(int64_t(-1), int64_t(1) << 20));
  cmd->add_flag("--recompute-keeps-attention", a->keeps_attention,
                "train.recompute_keeps_attention: under --recompute, keep each attention layer's output for the "
                "backward");
  cmd->add_flag("--recompute-keeps-gdn", a->keeps_gdn,
                "train.recompute_keeps_gdn: under --recompute, keep each Gated DeltaNet layer's delta rule results "
                "for the backward");
  cmd->add_flag("--nondeterministic", a->nondeterministic,
                "train.deterministic false: the attention backward may sum dQ in any order (faster, not bitwise "
                "repeatable)");
  cmd->add_flag("--gemm-autotune", a->gemm_autotune,
                "train.gemm_autotune: time cuBLASLt's candidate algorithms on each GEMM shape's first call, keep the "
                "fastest");
  cmd->add_option("--optimizer-states", a->optimizer_states, "AdamW state dtype: f32 (fp32 masters and moments for "
                  "bf16 parameters) or bf16 (no masters: bf16 parameters updated in place, bf16 moments)")
      ->capture_default_str();
  cmd->add_flag("--no-memory-plan", a->no_memory_plan, "train.memory_plan false: allocate each step's activations "
                "block by block from the caching allocator instead of the arena planned from the second step");
  cmd->add_flag("--memory-report", a->memory_report, "print what made the memory plan's recorded step peak: the "
                "largest blocks alive then, and what was live outside the step as it began");
  cmd->add_flag("--profile", a->profile, "after the timed steps, time every kernel of one more step and print the table");
  cmd->add_flag("--moe-host-groups", a->moe_host_groups, "MoE: each sparse layer reads its expert groups on the host "
                "as it is routed (a wait per layer; the padded form needs it) instead of leaving them on the device");
  cmd->add_option("--moe-padded-max-waste", a->moe_padded_max_waste, "MoE, with --moe-host-groups: batched expert "
                  "GEMMs over experts padded to the largest count while E x that count <= this x the routed rows (0: "
                  "grouped GEMMs always)")
      ->capture_default_str()
      ->check(number_in(0));
  cmd->callback([a, &exit_code] {
    run(*a);
    exit_code = 0;
  });
}

}  // namespace lathe::cli
