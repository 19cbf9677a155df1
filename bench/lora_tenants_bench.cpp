// Multi-tenant LoRA throughput: one frozen Qwen3 base (random weights, shape from the flags; default the
// Qwen3-0.6B shape), K adapters of rank r over all linear modules, a fixed total batch of `--sequences` documents of
// `--seq` tokens split evenly between the K tenants (each tenant's rows a segment of its adapter), and a full
// training step per iteration: forward, backward into the adapters, each tenant's AdamW step. Times the steps after
// warm-up with the device synchronised, and prints one JSON line per K:
//   {"k": K, "tokens_per_s": ..., "step_ms": ..., "peak_mib": ..., "trainable": ..., "card": ...}
// Run: lora_tenants_bench --device cuda --k 1,2,4,8   (bench/run_lora_tenants.sh records it with the card name)
#include <fmt/format.h>

#include <chrono>
#include <random>
#include <string>
#include <vector>

#include "model/lora.h"
#include "model/qwen3.h"
#include "optim/adamw.h"
#include "optim/clip.h"

using namespace lathe;

namespace {

std::vector<int> parse_list(const std::string& s) {
  std::vector<int> out;
  size_t p = 0;
  while (p <= s.size()) {
    const size_t q = s.find(',', p);
    out.push_back(std::stoi(s.substr(p, q == std::string::npos ? std::string::npos : q - p)));
    if (q == std::string::npos) break;
    p = q + 1;
  }
  return out;
}

}  // namespace

int main(int argc, char** argv) {
  std::string device_name = "cuda", ks = "1,2,4,8";
  int64_t seq = 2048, sequences = 8, rank = 16, layers = 28, steps = 6, warmup = 2;
  bool recompute = false;
  for (int i = 1; i + 1 < argc || (i < argc && std::string(argv[i]) == "--recompute"); ++i) {
    const std::string a = argv[i];
    if (a == "--recompute") {
      recompute = true;
      continue;
    }
    const std::string v = argv[++i];
    if (a == "--device") device_name = v;
    else if (a == "--k") ks = v;
    else if (a == "--seq") seq = std::stoll(v);
    else if (a == "--sequences") sequences = std::stoll(v);
    else if (a == "--rank") rank = std::stoll(v);
    else if (a == "--layers") layers = std::stoll(v);
    else if (a == "--steps") steps = std::stoll(v);
    else if (a == "--warmup") warmup = std::stoll(v);
    else {
      fmt::print(stderr, "lora_tenants_bench: unknown flag {}\n", a);
      return 2;
    }
  }
  try {
    Runtime rt;
    const Device device = parse_device(device_name);
    rt.check_device(device);
    const nlohmann::json cfg = {{"model_type", "qwen3"},       {"vocab_size", 151936},     {"hidden_size", 1024},
                                {"intermediate_size", 3072},   {"num_hidden_layers", layers}, {"num_attention_heads", 16},
                                {"num_key_value_heads", 8},    {"head_dim", 128},          {"rms_norm_eps", 1e-6},
                                {"rope_theta", 1000000.0},     {"tie_word_embeddings", true}, {"max_position_embeddings", 40960}};
    ModelOptions mo;
    mo.device = device;
    mo.dtype = device.is_cpu() ? DType::F32 : DType::BF16;
    mo.train_base = false;
    mo.recompute = recompute;
    Qwen3Model model = Qwen3Model::random(rt, parse_model_config(cfg, "bench"), mo, 1);
    const std::string card = rt.backend(device.type).info(device.index).name;
    std::mt19937 rng(7);
    for (int k : parse_list(ks)) {
      if (k <= 0 || sequences % k != 0) {
        fmt::print(stderr, "lora_tenants_bench: --sequences {} must be a multiple of k={}\n", sequences, k);
        return 2;
      }
      LoraConfig lc;
      lc.rank = rank;
      lc.alpha = 2.0 * double(rank);
      LoraBank bank(rt, model.config(), device, mo.dtype, std::vector<LoraConfig>(size_t(k), lc));
      std::vector<std::unique_ptr<AdamW>> opts;
      for (int a = 0; a < k; ++a) {
        bank.init(a, uint64_t(a));
        opts.push_back(std::make_unique<AdamW>(rt, bank.flat_parameter(a), AdamWConfig{}));
      }
      model.attach_lora(&bank);
      // The same total batch for every K: `sequences` documents of `seq` tokens, sequences / k per tenant.
      std::vector<int32_t> ids(size_t(sequences * seq)), cu = {0};
      for (int32_t& x : ids) x = int32_t(rng() % 151000u);
      for (int64_t s = 0; s < sequences; ++s) cu.push_back(int32_t((s + 1) * seq));
      PackedBatch b = make_packed_batch(rt, device, ids, cu, next_token_labels(ids, cu), 151936);
      std::vector<BatchSegment> segs;
      for (int a = 0; a < k; ++a) segs.push_back({int64_t(a + 1) * (sequences / k) * seq, a, 1.0, uint64_t(a)});
      set_segments(b, segs);
      ExecContext ctx = rt.context(device);
      double total_s = 0;
      for (int64_t it = 0; it < warmup + steps; ++it) {
        rt.synchronize(device);
        const auto t0 = std::chrono::steady_clock::now();
        bank.zero_grads();
        model.loss(b, true);
        for (int a = 0; a < k; ++a) opts[size_t(a)]->step(1e-4, clip_factor(global_grad_norm(ctx, bank.flat_parameter(a)), 1.0));
        rt.synchronize(device);
        if (it >= warmup) total_s += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      }
      model.attach_lora(nullptr);
      const double step_s = total_s / double(steps);
      const double peak = device.is_cuda() ? double(rt.backend(device.type).allocator(device.index).stats().peak_allocated) / 1048576.0 : 0.0;
      int64_t trainable = 0;
      for (int a = 0; a < k; ++a) trainable += bank.parameter_count(a);
      fmt::print("{}\n", nlohmann::json{{"k", k}, {"tokens_per_s", double(b.tokens()) / step_s}, {"step_ms", 1e3 * step_s},
                                        {"tokens_per_step", b.tokens()}, {"rank", rank}, {"layers", layers}, {"seq", seq},
                                        {"recompute", recompute}, {"peak_mib", peak}, {"trainable", trainable}, {"card", card}}
                             .dump());
      std::fflush(stdout);
    }
  } catch (const std::exception& e) {
    fmt::print(stderr, "lora_tenants_bench: {}\n", e.what());
    return 1;
  }
  return 0;
}
