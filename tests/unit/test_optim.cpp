// The optimizer: AdamW against an independent double-precision loop written from the paper (Loshchilov & Hutter,
// "Decoupled Weight Decay Regularization", Algorithm 2), masters of bf16 parameters, bf16 optimizer states (no masters:
// bitwise against a scalar reference with its own round-to-nearest-even, the op's bf16 key as the f32 key then a cast,
// the lost-update caveat, state bytes, save/load and the state-dtype mismatch error), skipped parameters,
// weight-decay exclusions, state save/load (resume is bitwise, bad files give clear errors), the adamw op's rounded
// parameter output (bitwise adamw + cast, hand-checked ties), the global gradient norm (sum_squares over mixed,
// empty, 0-d and strided gradients, hand-computed) and clipping factor, the learning-rate schedules (hand-computed
// values), and on a GPU the CUDA kernels (bf16 gradients, rounded parameters, bf16 states, sum_squares) against the
// CPU ones.
// The ops themselves are also checked by the adamw and sum_squares op-check cases.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <functional>
#include <random>

#include "backend/runtime.h"
#include "io/safetensors.h"
#include "ops/ops.h"
#include "optim/adamw.h"
#include "optim/clip.h"
#include "optim/schedule.h"

using namespace lathe;

namespace {

Runtime& runtime() {
  static Runtime rt;
  return rt;
}

std::vector<double> random_vector(std::mt19937_64& rng, size_t n, double lo = -1.0, double hi = 1.0) {
  std::vector<double> v(n);
  for (double& x : v) x = std::uniform_real_distribution<double>(lo, hi)(rng);
  return v;
}

// A tensor of `dtype` holding `values` (rounded to the dtype).
Tensor make(const std::vector<double>& values, const Shape& shape, DType dtype, Device device = Device::cpu()) {
  std::vector<uint8_t> bytes(values.size() * dtype_size(dtype));
  for (size_t i = 0; i < values.size(); ++i) store_from_double(bytes.data(), dtype, int64_t(i), values[i]);
  return runtime().from_host(bytes.data(), shape, dtype, device);
}

std::vector<double> values(const Tensor& t) {
  const Tensor h = runtime().copy_to(t, Device::cpu());
  std::vector<double> v(size_t(h.numel()));
  for (int64_t i = 0; i < h.numel(); ++i) v[size_t(i)] = load_as_double(h.data_ptr(), h.dtype(), i);
  return v;
}

double rounded(double x, DType dtype) {
  uint8_t b[8];
  store_from_double(b, dtype, 0, x);
  return load_as_double(b, dtype, 0);
}

// Algorithm 2 of the paper with the schedule multiplier eta_t = 1, alpha = lr and lambda = lr * weight_decay
// (torch.optim.AdamW couples the decay to lr this way): one parameter tensor over `grads.size()` steps.
struct PaperAdamW {
  double alpha, beta1, beta2, eps, lambda;
  std::vector<double> theta, m, v;
  int t = 0;

  void step(const std::vector<double>& g) {
    ++t;
    for (size_t i = 0; i < theta.size(); ++i) {
      m[i] = beta1 * m[i] + (1 - beta1) * g[i];
      v[i] = beta2 * v[i] + (1 - beta2) * g[i] * g[i];
      const double m_hat = m[i] / (1 - std::pow(beta1, t));
      const double v_hat = v[i] / (1 - std::pow(beta2, t));
      theta[i] = theta[i] - (alpha * m_hat / (std::sqrt(v_hat) + eps) + lambda * theta[i]);
    }
  }
};

void expect_near_rel(const std::vector<double>& got, const std::vector<double>& want, double tol, const char* what) {
  ASSERT_EQ(got.size(), want.size());
  for (size_t i = 0; i < got.size(); ++i)
    ASSERT_NEAR(got[i], want[i], tol * std::max(1.0, std::abs(want[i]))) << what << " element " << i;
}

// The resume scenario both state settings are checked on: a bf16 matrix and an f32 norm (without a gradient at step 2)
// trained 4 steps straight, and 2 steps, saved to a file, loaded into a fresh optimizer over the saved parameters (as a
// checkpoint would hold them) and 2 more steps. The two runs' parameters, masters and moments must agree bitwise.
// `saved` inspects the file; `loaded` sees the optimizer right after load and the one that saved.
void expect_resume_bitwise(const AdamWConfig& cfg, uint64_t seed, double lr, const std::string& name,
                           const std::function<void(const io::SafetensorsFile&)>& saved,
                           const std::function<void(const AdamW& loaded, const AdamW& saver)>& loaded) {
  const std::string dir = ::testing::TempDir() + "/" + name;
  std::filesystem::create_directories(dir);
  const std::string path = dir + "/optimizer.safetensors";
  std::mt19937_64 rng(seed);
  const std::vector<double> w0 = random_vector(rng, 12), u0 = random_vector(rng, 5);
  std::vector<std::vector<double>> grads;
  for (int s = 0; s < 4; ++s) grads.push_back(random_vector(rng, 17));
  auto make_params = [&](const std::vector<double>& w, const std::vector<double>& u) {
    return std::vector<Parameter>{{"model.embed_tokens.weight", make(w, {3, 4}, DType::BF16), {}},
                                  {"model.norm.weight", make(u, {5}, DType::F32), {}}};
  };
  auto set_grads = [&](std::vector<Parameter>& p, int s) {
    const std::vector<double>& g = grads[size_t(s)];
    p[0].grad = make(std::vector<double>(g.begin(), g.begin() + 12), {3, 4}, DType::BF16);
    p[1].grad = s == 1 ? Tensor() : make(std::vector<double>(g.begin() + 12, g.end()), {5}, DType::F32);
  };
  std::vector<Parameter> full = make_params(w0, u0);
  AdamW opt_full(runtime(), full, cfg);
  for (int s = 0; s < 4; ++s) {
    set_grads(full, s);
    opt_full.step(lr, 0.5);
  }
  std::vector<Parameter> first = make_params(w0, u0);
  AdamW opt_first(runtime(), first, cfg);
  for (int s = 0; s < 2; ++s) {
    set_grads(first, s);
    opt_first.step(lr, 0.5);
  }
  opt_first.save(path);
  saved(io::SafetensorsFile::open(path));
  std::vector<Parameter> second = make_params(values(first[0].value), values(first[1].value));
  AdamW opt_second(runtime(), second, cfg);
  opt_second.load(path);
  loaded(opt_second, opt_first);
  for (int s = 2; s < 4; ++s) {
    set_grads(second, s);
    opt_second.step(lr, 0.5);
  }
  for (size_t i = 0; i < 2; ++i) {
    EXPECT_EQ(values(second[i].value), values(full[i].value)) << i;
    EXPECT_EQ(values(opt_second.master(i)), values(opt_full.master(i))) << i;
    EXPECT_EQ(values(opt_second.exp_avg(i)), values(opt_full.exp_avg(i))) << i;
    EXPECT_EQ(values(opt_second.exp_avg_sq(i)), values(opt_full.exp_avg_sq(i))) << i;
  }
}

}  // namespace

TEST(AdamW, MatchesThePaperInF64AndF32) {
  for (DType dtype : {DType::F64, DType::F32}) {
    std::mt19937_64 rng(7);
    const size_t n = 37;
    const double lr = 0.02, wd = 0.1;
    const std::vector<double> w0 = random_vector(rng, n);
    std::vector<Parameter> params = {{"model.layers.0.mlp.up_proj.weight", make(w0, {37, 1}, dtype), {}},
                                     {"model.norm.weight", make(w0, {37}, dtype), {}}};
    AdamWConfig cfg;
    cfg.beta1 = 0.9;
    cfg.beta2 = 0.99;
    cfg.eps = 1e-8;
    cfg.weight_decay = wd;
    AdamW opt(runtime(), params, cfg);
    ASSERT_TRUE(opt.decays(0));
    ASSERT_FALSE(opt.decays(1));  // a norm gain
    ASSERT_FALSE(opt.has_master(0));

    PaperAdamW ref_decay{lr, 0.9, 0.99, 1e-8, lr * wd, {}, std::vector<double>(n), std::vector<double>(n)};
    PaperAdamW ref_plain{lr, 0.9, 0.99, 1e-8, 0.0, {}, std::vector<double>(n), std::vector<double>(n)};
    ref_decay.theta = ref_plain.theta = values(params[0].value);
    for (int s = 0; s < 6; ++s) {
      const std::vector<double> g = random_vector(rng, n, -3.0, 3.0);
      const double grad_scale = s == 2 ? 0.25 : 1.0;  // a clipped step
      params[0].grad = make(g, {37, 1}, dtype);
      params[1].grad = make(g, {37}, dtype);
      std::vector<double> g_used = values(params[0].grad);
      for (double& x : g_used) x *= grad_scale;
      opt.step(lr, grad_scale);
      ref_decay.step(g_used);
      ref_plain.step(g_used);
    }
    EXPECT_EQ(opt.step_count(), 6);
    const double tol = dtype == DType::F64 ? 1e-13 : 3e-6;
    expect_near_rel(values(params[0].value), ref_decay.theta, tol, "decayed weight");
    expect_near_rel(values(opt.exp_avg(0)), ref_decay.m, tol, "m");
    expect_near_rel(values(opt.exp_avg_sq(0)), ref_decay.v, tol, "v");
    expect_near_rel(values(params[1].value), ref_plain.theta, tol, "undecayed weight");
  }
}

TEST(AdamW, Bf16ParametersUpdateAnF32Master) {
  std::mt19937_64 rng(11);
  const size_t n = 64;
  const std::vector<double> w0 = random_vector(rng, n);
  std::vector<Parameter> params = {{"w", make(w0, {8, 8}, DType::BF16), {}}};
  AdamWConfig cfg;
  cfg.weight_decay = 0.01;
  AdamW opt(runtime(), params, cfg);
  ASSERT_TRUE(opt.has_master(0));
  EXPECT_EQ(opt.master(0).dtype(), DType::F32);
  EXPECT_EQ(opt.exp_avg(0).dtype(), DType::F32);
  PaperAdamW ref{1e-3, 0.9, 0.999, 1e-8, 1e-3 * 0.01, values(params[0].value), std::vector<double>(n),
                 std::vector<double>(n)};
  for (int s = 0; s < 4; ++s) {
    params[0].grad = make(random_vector(rng, n), {8, 8}, DType::BF16);
    ref.step(values(params[0].grad));
    opt.step(1e-3);
  }
  const std::vector<double> master = values(opt.master(0));
  expect_near_rel(master, ref.theta, 1e-6, "master");
  // Updates of ~1e-3 are below bf16's resolution near 1: only the master keeps them; the parameter is its rounding.
  const std::vector<double> w = values(params[0].value);
  for (size_t i = 0; i < n; ++i) ASSERT_EQ(w[i], rounded(master[i], DType::BF16)) << i;
}

// The RL handover: an optimizer whose state goes to the host and back between its steps (bf16 parameters with f32
// masters, and f32 ones) ends bitwise where one that kept its state ends; offload() moves the masters and moments
// (and only once), restore() brings them back; an update, a save or a load while offloaded is refused.
TEST(AdamW, OffloadAndRestoreBetweenStepsChangeNothing) {
  std::mt19937_64 rng(5);
  const size_t n = 48;
  const std::vector<double> w0 = random_vector(rng, n), w1 = random_vector(rng, n);
  const auto params = [&] {
    return std::vector<Parameter>{{"a", make(w0, {6, 8}, DType::BF16), {}}, {"b", make(w1, {48}, DType::F32), {}}};
  };
  std::vector<Parameter> kept = params(), moved = params();
  AdamWConfig cfg;
  cfg.weight_decay = 0.01;
  AdamW a(runtime(), kept, cfg), b(runtime(), moved, cfg);
  const size_t state = b.state_bytes();
  EXPECT_EQ(state, size_t(48 * 4 * 3 + 48 * 4 * 2));  // a: f32 master, m, v; b: m, v (its own master)
  for (int s = 0; s < 4; ++s) {
    const std::vector<double> g = random_vector(rng, n);
    kept[0].grad = moved[0].grad = make(g, {6, 8}, DType::BF16);
    kept[1].grad = moved[1].grad = make(g, {48}, DType::F32);
    a.step(1e-2);
    EXPECT_EQ(b.offload(), state);
    EXPECT_EQ(b.offload(), 0u);  // already on the host
    EXPECT_TRUE(b.offloaded());
    EXPECT_TRUE(b.exp_avg(0).device().is_cpu());
    EXPECT_THROW(b.step(1e-2), Error);
    EXPECT_THROW(b.save((std::filesystem::temp_directory_path() / "never.safetensors").string()), Error);
    EXPECT_EQ(b.restore(), state);
    EXPECT_EQ(b.restore(), 0u);
    b.step(1e-2);
  }
  for (size_t i = 0; i < 2; ++i) {
    EXPECT_EQ(values(kept[i].value), values(moved[i].value)) << i;
    EXPECT_EQ(values(a.exp_avg(i)), values(b.exp_avg(i))) << i;
    EXPECT_EQ(values(a.exp_avg_sq(i)), values(b.exp_avg_sq(i))) << i;
    EXPECT_EQ(values(a.master(i)), values(b.master(i))) << i;
  }
}

TEST(AdamW, SkipsParametersWithoutGradient) {
  std::vector<Parameter> params = {{"a", make({1.0, 2.0}, {2}, DType::F64), {}},
                                   {"b", make({3.0, 4.0}, {2}, DType::F64), {}}};
  AdamW opt(runtime(), params, {});
  params[0].grad = make({0.5, -0.5}, {2}, DType::F64);
  opt.step(0.1);
  EXPECT_EQ(values(params[1].value), (std::vector<double>{3.0, 4.0}));
  EXPECT_EQ(values(opt.exp_avg(1)), (std::vector<double>{0.0, 0.0}));
  // First step of Adam moves by lr * sign(g) (up to eps).
  EXPECT_NEAR(values(params[0].value)[0], 0.9, 1e-7);
  EXPECT_NEAR(values(params[0].value)[1], 2.1, 1e-7);
}

// The two-half update as the trainer runs it (prepare, drop or run) against the one-call step. step(lr, s) is itself
// prepare + run, so the arithmetic is the paper-reference tests' business; this one checks that a prepared update that
// is dropped (a skipped step) changes nothing, bitwise, over three steps with a bf16 parameter (master) and an f32 one
// without a gradient at step 2, and that an update prepared before another step ran is refused.
TEST(AdamW, PreparedUpdateIsTheStepBitwise) {
  std::mt19937_64 rng(17);
  const std::vector<double> w0 = random_vector(rng, 48), u0 = random_vector(rng, 6);
  std::vector<std::vector<double>> grads_w, grads_u;
  for (int s = 0; s < 3; ++s) grads_w.push_back(random_vector(rng, 48)), grads_u.push_back(random_vector(rng, 6));
  AdamWConfig cfg;
  cfg.weight_decay = 0.1;
  auto make_params = [&] {
    return std::vector<Parameter>{{"w", make(w0, {6, 8}, DType::BF16), {}}, {"u", make(u0, {6}, DType::F32), {}}};
  };
  std::vector<Parameter> one = make_params(), two = make_params();
  AdamW a(runtime(), one, cfg), b(runtime(), two, cfg);
  for (int s = 0; s < 3; ++s) {
    for (std::vector<Parameter>* ps : {&one, &two}) {
      (*ps)[0].grad = make(grads_w[size_t(s)], {6, 8}, DType::BF16);
      (*ps)[1].grad = s == 1 ? Tensor() : make(grads_u[size_t(s)], {6}, DType::F32);
    }
    const double lr = 1e-2 * (s + 1), scale = 0.5 + 0.25 * s;
    a.step(lr, scale);
    AdamW::Prepared dropped = b.prepare();  // a skipped step: never run
    (void)dropped;
    AdamW::Prepared update = b.prepare();
    b.step(std::move(update), lr, scale);
  }
  EXPECT_EQ(a.step_count(), b.step_count());
  for (size_t i = 0; i < 2; ++i) {
    EXPECT_EQ(values(one[i].value), values(two[i].value)) << i;
    EXPECT_EQ(values(a.master(i)), values(b.master(i))) << i;
    EXPECT_EQ(values(a.exp_avg(i)), values(b.exp_avg(i))) << i;
    EXPECT_EQ(values(a.exp_avg_sq(i)), values(b.exp_avg_sq(i))) << i;
  }
  AdamW::Prepared stale = b.prepare();
  b.step(1e-3);
  EXPECT_THROW(b.step(std::move(stale), 1e-3), Error);
}

// Segments (ZeRO's buckets): an update prepared in segments is the one-call step bitwise, no call mixes segments, and
// each segment that has a gradient is reported once, in order, after its last call is queued: here segments
// {0, 0, 1, 2, 2, 3} where segment 1's one parameter has no gradient (no call, no report) and segment 2 mixes a decayed
// matrix and an undecayed norm (two calls, one report). Out-of-order or miscounted segments are refused.
TEST(AdamW, SegmentsReportEachOnceAfterItsLastCall) {
  std::mt19937_64 rng(23);
  AdamWConfig cfg;
  cfg.weight_decay = 0.1;
  const std::vector<std::pair<std::string, Shape>> shapes = {
      {"a.weight", {4, 3}}, {"b.weight", {3, 3}}, {"c.weight", {5, 2}}, {"d.weight", {2, 6}}, {"d.norm.weight", {6}},
      {"e.weight", {3, 4}}};
  std::vector<std::vector<double>> init, grads;
  for (const auto& [name, shape] : shapes) {
    init.push_back(random_vector(rng, size_t(shape_numel(shape))));
    grads.push_back(random_vector(rng, size_t(shape_numel(shape))));
  }
  auto make_params = [&] {
    std::vector<Parameter> ps;
    for (size_t i = 0; i < shapes.size(); ++i)
      ps.push_back({shapes[i].first, make(init[i], shapes[i].second, DType::F32), {}});
    for (size_t i = 0; i < shapes.size(); ++i)
      if (i != 2) ps[i].grad = make(grads[i], shapes[i].second, DType::F32);
    return ps;
  };
  std::vector<Parameter> one = make_params(), two = make_params();
  AdamW a(runtime(), one, cfg), b(runtime(), two, cfg);
  const std::vector<size_t> segments = {0, 0, 1, 2, 2, 3};
  AdamW::Prepared update = b.prepare(segments);
  std::vector<size_t> reported;
  b.step(std::move(update), 1e-2, 0.5, [&](size_t s) { reported.push_back(s); });
  a.step(1e-2, 0.5);
  EXPECT_EQ(reported, (std::vector<size_t>{0, 2, 3}));
  AdamW::Prepared again = b.prepare(segments);
  EXPECT_EQ(again.segment, (std::vector<size_t>{0, 2, 2, 3}));  // segment 2: decayed and undecayed, two calls
  for (size_t i = 0; i < one.size(); ++i) {
    EXPECT_EQ(values(one[i].value), values(two[i].value)) << i;
    EXPECT_EQ(values(a.exp_avg_sq(i)), values(b.exp_avg_sq(i))) << i;
  }
  EXPECT_THROW(b.prepare({0, 1, 0, 2, 2, 3}), Error);
  EXPECT_THROW(b.prepare({0, 1}), Error);
}

TEST(AdamW, WeightDecayExclusions) {
  AdamWConfig c;
  c.weight_decay = 0.1;
  EXPECT_TRUE(weight_decay_applies(c, "model.layers.0.self_attn.q_proj.weight", {8, 4}));
  EXPECT_TRUE(weight_decay_applies(c, "model.embed_tokens.weight", {100, 4}));
  EXPECT_TRUE(weight_decay_applies(c, "lm_head.weight", {100, 4}));
  EXPECT_FALSE(weight_decay_applies(c, "model.layers.0.input_layernorm.weight", {4}));
  EXPECT_FALSE(weight_decay_applies(c, "model.layers.0.self_attn.q_proj.bias", {8}));
  c.decay_embeddings = false;
  EXPECT_FALSE(weight_decay_applies(c, "model.embed_tokens.weight", {100, 4}));
  c.decay_norms = c.decay_biases = true;
  EXPECT_TRUE(weight_decay_applies(c, "model.norm.weight", {4}));
  EXPECT_TRUE(weight_decay_applies(c, "model.layers.0.self_attn.q_proj.bias", {8}));
  c.no_decay = {"q_proj"};
  EXPECT_FALSE(weight_decay_applies(c, "model.layers.0.self_attn.q_proj.weight", {8, 4}));
  c.weight_decay = 0;
  EXPECT_FALSE(weight_decay_applies(c, "lm_head.weight", {100, 4}));
}

// A piece's place as checkpoints record it ("shard.<name>" metadata) reads back as written, with and without sections
// and flat_begin; text that does not place a tensor is refused, not half-read.
TEST(ShardMetadata, ReadsBackWhatItWrites) {
  ShardLayout l;
  l.global_shape = {12, 8};
  l.offset = {4, 0};
  l.group = "tp";
  l.sections = {4, 4, 4};
  const std::optional<ShardLayout> back = parse_shard_metadata(shard_metadata(l));
  ASSERT_TRUE(back.has_value());
  EXPECT_EQ(back->global_shape, l.global_shape);
  EXPECT_EQ(back->offset, l.offset);
  EXPECT_EQ(back->group, "tp");
  EXPECT_EQ(back->sections, l.sections);
  EXPECT_EQ(back->flat_begin, -1);
  l.sections.clear();
  l.group = "dp";
  l.flat_begin = 17;
  const std::optional<ShardLayout> zero = parse_shard_metadata(shard_metadata(l));
  ASSERT_TRUE(zero.has_value());
  EXPECT_EQ(zero->flat_begin, 17);
  EXPECT_TRUE(zero->sections.empty());
  for (const char* bad : {"", "[1, 2]", "{\"offset\": [0]}", "{\"global_shape\": [4, 2], \"offset\": [0]}",
                          "{\"global_shape\": [4], \"offset\": [\"x\"]}", "{\"global_shape\": 4, \"offset\": 0}"})
    EXPECT_FALSE(parse_shard_metadata(bad).has_value()) << bad;
}

TEST(AdamW, APieceOfAShardedMatrixDecaysLikeTheMatrix) {
  // A ZeRO slice of a 2 x 4 matrix is a 1-D tensor, but it is not a norm gain: its decay follows the global shape.
  std::vector<Parameter> params(2);
  params[0] = {"model.layers.0.mlp.up_proj.weight", make({1, 2, 3}, {3}, DType::F32), {}, {{2, 4}, {0, 0}, 2, "dp"}};
  params[1] = {"model.layers.0.input_layernorm.weight", make({1, 2, 3}, {3}, DType::F32), {}, {}};
  AdamWConfig c;
  c.weight_decay = 0.1;
  const AdamW opt(runtime(), params, c);
  EXPECT_TRUE(opt.decays(0));
  EXPECT_FALSE(opt.decays(1));
  EXPECT_EQ(params[0].global_shape(), (Shape{2, 4}));
  EXPECT_FALSE(params[0].whole());
}

TEST(AdamW, RejectsBadOpInputs) {
  ExecContext ctx = runtime().context(Device::cpu());
  Tensor w = make({1, 2}, {2}, DType::F32), m = make({0, 0}, {2}, DType::F64), v = make({0, 0}, {2}, DType::F32);
  const Tensor g = make({1, 1}, {2}, DType::BF16);
  EXPECT_THROW(adamw_update(ctx, w, g, m, v, {}), Error);  // m's dtype differs from the master's
  m = make({0, 0}, {2}, DType::F32);
  AdamWAttrs a;
  a.step = 0;
  EXPECT_THROW(adamw_update(ctx, w, g, m, v, a), Error);
  EXPECT_NO_THROW(adamw_update(ctx, w, g, m, v, {}));  // bf16 gradient, f32 master
  const Tensor g3 = make({1, 1, 1}, {3}, DType::F32);
  EXPECT_THROW(adamw_update(ctx, w, g3, m, v, {}), Error);
  // The rounded parameter: bf16/f16 only, the master's shape, contiguous; rounded_to without a parameter is refused.
  EXPECT_NO_THROW(adamw_update(ctx, w, g, m, v, {}, make({0, 0}, {2}, DType::F16)));
  EXPECT_THROW(adamw_update(ctx, w, g, m, v, {}, make({0, 0}, {2}, DType::F32)), Error);
  EXPECT_THROW(adamw_update(ctx, w, g, m, v, {}, make({0, 0, 0}, {3}, DType::BF16)), Error);
  EXPECT_THROW(adamw_update(ctx, w, g, m, v, {}, make({0}, {1}, DType::BF16).expand({2})), Error);  // stride 0
  AdamWAttrs r;
  r.rounded_to = DType::BF16;
  EXPECT_THROW(adamw_update(ctx, w, g, m, v, r), Error);
  // A bf16 key (bf16 states): bf16 moments, bf16 or f32 gradients, and no rounded parameter (it is its own master).
  Tensor w16 = make({1, 2}, {2}, DType::BF16), m16 = make({0, 0}, {2}, DType::BF16), v16 = make({0, 0}, {2}, DType::BF16);
  EXPECT_NO_THROW(adamw_update(ctx, w16, g, m16, v16, {}));
  EXPECT_NO_THROW(adamw_update(ctx, w16, make({1, 1}, {2}, DType::F32), m16, v16, {}));
  EXPECT_THROW(adamw_update(ctx, w16, g, m, v16, {}), Error);  // f32 m beside a bf16 master
  try {
    adamw_update(ctx, w16, g, m16, v16, {}, make({0, 0}, {2}, DType::BF16));
    FAIL() << "no error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("bf16 master"), std::string::npos) << e.what();
  }
}

// adamw with the rounded parameter output against adamw followed by the cast op, bit for bit, on every device.
TEST(AdamW, RoundedParameterOutputIsAdamWThenCast) {
  std::vector<Device> devices = {Device::cpu()};
  if (runtime().has_device(Device::cuda(0))) devices.push_back(Device::cuda(0));
  for (Device d : devices) {
    for (DType low : {DType::BF16, DType::F16}) {
      ExecContext ctx = runtime().context(d);
      std::mt19937_64 rng(13);
      const size_t n = 5003;
      const std::vector<double> w0 = random_vector(rng, n), g = random_vector(rng, n, -3.0, 3.0);
      const std::vector<double> m0 = random_vector(rng, n, -0.1, 0.1), v0 = random_vector(rng, n, 0.0, 0.01);
      const AdamWAttrs a{1e-2, 0.9, 0.95, 1e-8, 0.1, 3, 0.5, std::nullopt};
      Tensor w1 = make(w0, {int64_t(n)}, DType::F32, d), m1 = make(m0, {int64_t(n)}, DType::F32, d),
             v1 = make(v0, {int64_t(n)}, DType::F32, d);
      Tensor w2 = make(w0, {int64_t(n)}, DType::F32, d), m2 = make(m0, {int64_t(n)}, DType::F32, d),
             v2 = make(v0, {int64_t(n)}, DType::F32, d);
      const Tensor grad = make(g, {int64_t(n)}, DType::BF16, d);
      adamw_update(ctx, w1, grad, m1, v1, a);
      const Tensor cast_param = cast(ctx, w1, low);
      const Tensor fused_param = make(std::vector<double>(n, 7.0), {int64_t(n)}, low, d);
      adamw_update(ctx, w2, grad, m2, v2, a, fused_param);
      const Tensor h1 = runtime().copy_to(cast_param, Device::cpu()), h2 = runtime().copy_to(fused_param, Device::cpu());
      ASSERT_EQ(std::memcmp(h1.data_ptr(), h2.data_ptr(), h1.nbytes()), 0) << d.str() << " " << dtype_name(low);
      EXPECT_EQ(values(w1), values(w2)) << d.str();
      EXPECT_EQ(values(v1), values(v2)) << d.str();
    }
  }
}

// lr = 0 leaves the master as it is, so masters placed on rounding ties show the rounding: to nearest, ties to even.
TEST(AdamW, RoundedParameterRoundsTiesToEven) {
  ExecContext ctx = runtime().context(Device::cpu());
  const double b = std::ldexp(1.0, -8), h = std::ldexp(1.0, -11);  // half a bf16 / f16 step at 1
  struct Case {
    DType low;
    std::vector<double> master, want;
  };
  const std::vector<Case> cases = {
      {DType::BF16, {1 + b, 1 + 3 * b, -(1 + b), 1 + 1.5 * b}, {1.0, 1 + 4 * b, -1.0, 1 + 2 * b}},
      {DType::F16, {1 + h, 1 + 3 * h, -(1 + h), 1 + 0.5 * h}, {1.0, 1 + 4 * h, -1.0, 1.0}}};
  for (const Case& c : cases) {
    Tensor w = make(c.master, {4}, DType::F32), m = make({0, 0, 0, 0}, {4}, DType::F32),
           v = make({0, 0, 0, 0}, {4}, DType::F32);
    const Tensor p = make({0, 0, 0, 0}, {4}, c.low);
    AdamWAttrs a;
    a.lr = 0.0;
    adamw_update(ctx, w, make({1, -1, 1, -1}, {4}, DType::F32), m, v, a, p);
    EXPECT_EQ(values(w), c.master);
    EXPECT_EQ(values(p), c.want) << dtype_name(c.low);
  }
}

// Save after 2 steps, load into a fresh optimizer over fresh parameters, run 2 more: bitwise equal to 4 steps.
TEST(AdamW, SaveLoadResumesBitwise) {
  AdamWConfig cfg;
  cfg.weight_decay = 0.05;
  expect_resume_bitwise(
      cfg, 3, 0.01, "lathe_optim_state",
      [](const io::SafetensorsFile& f) {
        EXPECT_EQ(f.metadata().at("step"), "2");
        EXPECT_EQ(f.metadata().at("step.model.norm.weight"), "1");
        EXPECT_NE(f.find("model.embed_tokens.weight.master"), nullptr);
        EXPECT_EQ(f.find("model.norm.weight.master"), nullptr);  // f32: its own master
        EXPECT_NE(f.find("model.norm.weight.exp_avg_sq"), nullptr);
      },
      [](const AdamW& loaded, const AdamW&) { EXPECT_EQ(loaded.step_count(), 2); });
}

TEST(AdamW, LoadReportsMismatches) {
  const std::string dir = ::testing::TempDir() + "/lathe_optim_bad";
  std::filesystem::create_directories(dir);
  std::vector<Parameter> a = {{"x", make({1, 2, 3, 4}, {2, 2}, DType::F32), {}},
                              {"y", make({1, 2}, {2}, DType::F32), {}}};
  AdamW(runtime(), a, {}).save(dir + "/a.safetensors");

  std::vector<Parameter> b = {{"x", make({1, 2, 3, 4}, {4}, DType::F32), {}},
                              {"z", make({1, 2}, {2}, DType::F32), {}}};
  AdamW opt(runtime(), b, {});
  try {
    opt.load(dir + "/a.safetensors");
    FAIL() << "no error";
  } catch (const Error& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("x.exp_avg has shape [2, 2], the parameter [4]"), std::string::npos) << msg;
    EXPECT_NE(msg.find("z.exp_avg is missing"), std::string::npos) << msg;
    EXPECT_NE(msg.find("y.exp_avg_sq belongs to no parameter"), std::string::npos) << msg;
  }
  const float zero = 0;
  io::write_safetensors(dir + "/model.safetensors", {{"x", DType::F32, {1}, &zero, 4}});
  EXPECT_THROW(opt.load(dir + "/model.safetensors"), Error);  // not an optimizer state
}

// A piece of a sharded parameter records its place in the file; loading it into another piece, or into the whole
// tensor, is an error naming both; the same piece loads.
TEST(AdamW, APieceLoadsOnlyIntoTheSamePiece) {
  const std::string dir = ::testing::TempDir() + "/lathe_optim_piece";
  std::filesystem::create_directories(dir);
  std::vector<Parameter> a = {{"w", make({1, 2, 3}, {3}, DType::F32), {}, {{2, 4}, {0, 0}, 2, "dp"}}};
  AdamW(runtime(), a, {}).save(dir + "/a.safetensors");
  const io::SafetensorsFile file = io::SafetensorsFile::open(dir + "/a.safetensors");
  EXPECT_EQ(file.metadata().at("shard.w"), R"({"global_shape": [2, 4], "offset": [0, 0], "flat_begin": 2, "group": "dp"})");
  std::vector<Parameter> same = {{"w", make({1, 2, 3}, {3}, DType::F32), {}, {{2, 4}, {0, 0}, 2, "dp"}}};
  AdamW(runtime(), same, {}).load(dir + "/a.safetensors");
  std::vector<Parameter> other = {{"w", make({1, 2, 3}, {3}, DType::F32), {}, {{2, 4}, {0, 0}, 5, "dp"}}};
  std::vector<Parameter> whole = {{"w", make({1, 2, 3}, {3}, DType::F32), {}, {}}};
  for (std::vector<Parameter>* into : {&other, &whole}) {
    AdamW opt(runtime(), *into, {});
    try {
      opt.load(dir + "/a.safetensors");
      FAIL() << "no error";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("w was saved as the piece {\"global_shape\": [2, 4], \"offset\": [0, 0], "
                                           "\"flat_begin\": 2"), std::string::npos) << e.what();
    }
  }
}

// ---- bf16 optimizer states (AdamWConfig::state_dtype = bf16): no masters, bf16 moments, parameters updated in place.

namespace {

// Round to nearest, ties to even, onto bf16's 8 significant bits, written independently of core/dtype.h: scale the
// value so that its last kept bit is the units digit, round with nearbyint (the default mode is to nearest even),
// scale back. Normal, finite values only (all these tests use).
double bf16_rne(double x) {
  if (x == 0) return x;
  int e = 0;
  std::frexp(x, &e);  // x = f 2^e, 0.5 <= |f| < 1
  return std::ldexp(std::nearbyint(std::ldexp(x, 8 - e)), e - 8);
}

// The update of one bf16 tensor with bf16 states, written from the formula at AdamWAttrs (ops/op_table.h) in double,
// each stored value kept as the op defines it: the f32 result, rounded to bf16. theta, m and v hold bf16 values.
struct Bf16StateReference {
  double beta1, beta2, eps, weight_decay;
  std::vector<double> theta, m, v;
  int t = 0;

  void step(const std::vector<double>& grad, double lr, double grad_scale) {
    ++t;
    const double b1t = 1 - std::pow(beta1, t), b2t = 1 - std::pow(beta2, t);
    for (size_t i = 0; i < theta.size(); ++i) {
      const double g = grad_scale * grad[i];
      const double m1 = beta1 * m[i] + (1 - beta1) * g;
      const double v1 = beta2 * v[i] + (1 - beta2) * g * g;
      const double w1 = theta[i] - lr * weight_decay * theta[i] - (lr / b1t) * m1 / (std::sqrt(v1) / std::sqrt(b2t) + eps);
      theta[i] = bf16_rne(float(w1));
      m[i] = bf16_rne(float(m1));
      v[i] = bf16_rne(float(v1));
    }
  }
};

AdamWConfig bf16_states_config() {
  AdamWConfig c;
  c.beta1 = 0.9;
  c.beta2 = 0.95;
  c.weight_decay = 0.1;
  c.state_dtype = DType::BF16;
  return c;
}

}  // namespace

TEST(AdamWBf16States, RoundingHelperRoundsTiesToEven) {
  const double u = std::ldexp(1.0, -7);  // a bf16 step at 1
  EXPECT_EQ(bf16_rne(1 + u / 2), 1.0);            // tie, down to even
  EXPECT_EQ(bf16_rne(1 + 3 * u / 2), 1 + 2 * u);  // tie, up to even
  EXPECT_EQ(bf16_rne(1 + u / 2 + 1e-9), 1 + u);
  EXPECT_EQ(bf16_rne(-(1 + u / 2)), -1.0);
  EXPECT_EQ(bf16_rne(2 - u / 4), 2.0);            // carries into the next binade
  std::mt19937_64 rng(1);
  for (double x : random_vector(rng, 1000, -50.0, 50.0)) ASSERT_EQ(bf16_rne(float(x)), rounded(x, DType::BF16)) << x;
}

// One step, then five more (a clipped one, an f32 gradient), of bf16 parameters with bf16 states against the scalar
// reference, bit for bit after every step; an f32 parameter beside them keeps f32 states.
TEST(AdamWBf16States, StepsMatchTheScalarReferenceBitwise) {
  std::mt19937_64 rng(21);
  const size_t n = 16 * 33;
  const std::vector<double> w0 = random_vector(rng, n), u0 = random_vector(rng, 33, 0.5, 1.5);
  std::vector<Parameter> params = {{"model.layers.0.mlp.up_proj.weight", make(w0, {16, 33}, DType::BF16), {}},
                                   {"model.norm.weight", make(u0, {33}, DType::BF16), {}},
                                   {"model.layers.0.mlp.gate.weight", make(u0, {33}, DType::F32), {}}};
  const AdamWConfig cfg = bf16_states_config();
  AdamW opt(runtime(), params, cfg);
  for (size_t i = 0; i < 2; ++i) {
    EXPECT_FALSE(opt.has_master(i));
    EXPECT_EQ(opt.master(i).data_ptr(), params[i].value.data_ptr()) << "the parameter is its own master";
    EXPECT_EQ(opt.exp_avg(i).dtype(), DType::BF16);
    EXPECT_EQ(opt.exp_avg_sq(i).dtype(), DType::BF16);
  }
  EXPECT_FALSE(opt.has_master(2));
  EXPECT_EQ(opt.exp_avg(2).dtype(), DType::F32);
  ASSERT_TRUE(opt.decays(0));
  ASSERT_FALSE(opt.decays(1));

  Bf16StateReference ref_w{0.9, 0.95, 1e-8, 0.1, values(params[0].value), std::vector<double>(n), std::vector<double>(n)};
  Bf16StateReference ref_u{0.9, 0.95, 1e-8, 0.0, values(params[1].value), std::vector<double>(33), std::vector<double>(33)};
  PaperAdamW ref_f32{0.02, 0.9, 0.95, 1e-8, 0.0, values(params[2].value), std::vector<double>(33), std::vector<double>(33)};
  for (int s = 0; s < 6; ++s) {
    const double lr = 0.02, grad_scale = s == 2 ? 0.25 : 1.0;
    const DType gdt = s == 4 ? DType::F32 : DType::BF16;  // bf16 states take f32 gradients too
    params[0].grad = make(random_vector(rng, n, -3.0, 3.0), {16, 33}, gdt);
    params[1].grad = make(random_vector(rng, 33, -3.0, 3.0), {33}, gdt);
    params[2].grad = make(random_vector(rng, 33, -3.0, 3.0), {33}, DType::F32);
    opt.step(lr, grad_scale);
    ref_w.step(values(params[0].grad), lr, grad_scale);
    ref_u.step(values(params[1].grad), lr, grad_scale);
    std::vector<double> g2 = values(params[2].grad);
    for (double& x : g2) x *= grad_scale;
    ref_f32.step(g2);
    EXPECT_EQ(values(params[0].value), ref_w.theta) << "step " << s + 1;
    EXPECT_EQ(values(opt.exp_avg(0)), ref_w.m) << "step " << s + 1;
    EXPECT_EQ(values(opt.exp_avg_sq(0)), ref_w.v) << "step " << s + 1;
    EXPECT_EQ(values(params[1].value), ref_u.theta) << "step " << s + 1;
    EXPECT_EQ(values(opt.exp_avg(1)), ref_u.m) << "step " << s + 1;
    EXPECT_EQ(values(opt.exp_avg_sq(1)), ref_u.v) << "step " << s + 1;
    if (s == 0) {  // the first step moves every weight by about lr, well above half a bf16 step of these weights
      const std::vector<double> w = values(params[0].value);
      for (size_t i = 0; i < n; ++i) ASSERT_NE(w[i], rounded(w0[i], DType::BF16)) << i;
    }
  }
  expect_near_rel(values(params[2].value), ref_f32.theta, 3e-6, "f32 parameter");
}

// The op with a bf16 key is the f32-key op on the same (widened) values, each output cast to bf16: bit for bit, on
// every device, with bf16 and f32 gradients.
TEST(AdamWBf16States, Bf16KeyIsTheF32KeyThenCast) {
  std::vector<Device> devices = {Device::cpu()};
  if (runtime().has_device(Device::cuda(0))) devices.push_back(Device::cuda(0));
  for (Device d : devices) {
    for (DType gdt : {DType::BF16, DType::F32}) {
      ExecContext ctx = runtime().context(d);
      std::mt19937_64 rng(23);
      const int64_t n = 5003;  // the CUDA kernel's 8-element packs and a tail
      const std::vector<double> w0 = random_vector(rng, size_t(n)), g = random_vector(rng, size_t(n), -3.0, 3.0);
      const std::vector<double> m0 = random_vector(rng, size_t(n), -0.1, 0.1), v0 = random_vector(rng, size_t(n), 0.0, 0.01);
      const AdamWAttrs a{1e-2, 0.9, 0.95, 1e-8, 0.1, 3, 0.5, std::nullopt};
      const Tensor grad = make(g, {n}, gdt, d);
      Tensor w16 = make(w0, {n}, DType::BF16, d), m16 = make(m0, {n}, DType::BF16, d), v16 = make(v0, {n}, DType::BF16, d);
      Tensor w32 = cast(ctx, w16, DType::F32), m32 = cast(ctx, m16, DType::F32), v32 = cast(ctx, v16, DType::F32);
      adamw_update(ctx, w16, grad, m16, v16, a);
      adamw_update(ctx, w32, grad, m32, v32, a);
      const std::pair<const Tensor*, const Tensor*> pairs[] = {{&w16, &w32}, {&m16, &m32}, {&v16, &v32}};
      const char* names[] = {"w", "m", "v"};
      for (int k = 0; k < 3; ++k) {
        const Tensor h1 = runtime().copy_to(*pairs[k].first, Device::cpu());
        const Tensor h2 = runtime().copy_to(cast(ctx, *pairs[k].second, DType::BF16), Device::cpu());
        const auto* b1 = static_cast<const uint16_t*>(h1.data_ptr());
        const auto* b2 = static_cast<const uint16_t*>(h2.data_ptr());
        int64_t differ = 0, first = -1;
        for (int64_t i = 0; i < n; ++i)
          if (b1[i] != b2[i]) first = first < 0 ? i : first, ++differ;
        EXPECT_EQ(differ, 0) << d.str() << " grad " << dtype_name(gdt) << ": " << names[k] << " differs in " << differ
                             << " of " << n << " values, first at " << first << " (" << (first >= 0 ? b1[first] : 0)
                             << " vs " << (first >= 0 ? b2[first] : 0) << ")";
      }
    }
  }
}

// The caveat: an update below half a bf16 step of the weight is lost with bf16 states, while an f32 master keeps
// accumulating it until the rounded parameter moves.
TEST(AdamWBf16States, UpdatesBelowHalfAnUlpAreLost) {
  for (DType states : {DType::BF16, DType::F32}) {
    std::vector<Parameter> p = {{"w", make({1.0, 64.0}, {2}, DType::BF16), {}}};
    AdamWConfig cfg;
    cfg.state_dtype = states;
    AdamW opt(runtime(), p, cfg);
    for (int s = 0; s < 10; ++s) {
      p[0].grad = make({1.0, -1.0}, {2}, DType::BF16);
      opt.step(1e-3);  // Adam moves each weight by about lr = 1e-3 a step
    }
    const std::vector<double> w = values(p[0].value);
    if (states == DType::BF16) {
      EXPECT_EQ(w[0], 1.0);   // the next bf16 below 1 is 1 - 2^-8: 1 - 1e-3 rounds back to 1, every step
      EXPECT_EQ(w[1], 64.0);  // the next above 64 is 64.5
    } else {
      EXPECT_LT(w[0], 1.0);   // the master went to ~0.99; its rounding moved
      EXPECT_EQ(w[1], 64.0);
      EXPECT_NEAR(values(opt.master(0))[0], 0.99, 1e-4);
    }
  }
}

TEST(AdamWBf16States, StateBytes) {
  std::vector<Parameter> params = {{"a", make(std::vector<double>(12, 0.5), {3, 4}, DType::BF16), {}},
                                   {"b", make(std::vector<double>(5, 0.5), {5}, DType::F32), {}}};
  AdamWConfig cfg;
  EXPECT_EQ(AdamW(runtime(), params, cfg).state_bytes(), 12u * 12 + 8u * 5);  // f32 master, m, v; f32 m, v
  cfg.state_dtype = DType::BF16;
  EXPECT_EQ(AdamW(runtime(), params, cfg).state_bytes(), 4u * 12 + 8u * 5);   // bf16 m, v; the f32 one unchanged
  EXPECT_EQ(adamw_state_bytes_per_element(DType::BF16, DType::BF16), 4u);
  EXPECT_EQ(adamw_state_bytes_per_element(DType::BF16, DType::F32), 12u);
  EXPECT_EQ(adamw_state_bytes_per_element(DType::F16, DType::F32), 12u);
  EXPECT_EQ(adamw_state_bytes_per_element(DType::F32, DType::BF16), 8u);
  EXPECT_EQ(adamw_state_bytes_per_element(DType::F64, DType::F32), 16u);
  // f16 parameters have no bf16-state recipe; other state dtypes are not settings.
  std::vector<Parameter> f16 = {{"h", make({1, 2}, {2}, DType::F16), {}}};
  EXPECT_THROW(AdamW(runtime(), f16, cfg), Error);
  cfg.state_dtype = DType::F16;
  EXPECT_THROW(AdamW(runtime(), params, cfg), Error);
}

// Save after 2 steps, load into a fresh optimizer over the saved parameters, run 2 more: bitwise the 4-step run. The
// file holds bf16 moments and no masters.
TEST(AdamWBf16States, SaveLoadResumesBitwise) {
  expect_resume_bitwise(
      bf16_states_config(), 31, 0.05, "lathe_optim_bf16_state",
      [](const io::SafetensorsFile& f) {
        EXPECT_EQ(f.metadata().at("state_dtype"), "bf16");
        EXPECT_EQ(f.find("model.embed_tokens.weight.master"), nullptr);
        ASSERT_NE(f.find("model.embed_tokens.weight.exp_avg"), nullptr);
        EXPECT_EQ(f.find("model.embed_tokens.weight.exp_avg")->dtype, DType::BF16);
        EXPECT_EQ(f.find("model.embed_tokens.weight.exp_avg_sq")->dtype, DType::BF16);
        EXPECT_EQ(f.find("model.norm.weight.exp_avg")->dtype, DType::F32);
      },
      [](const AdamW& loaded, const AdamW& saver) {
        EXPECT_EQ(values(loaded.exp_avg(0)), values(saver.exp_avg(0)));
      });
}

// A state saved with the other state dtype is refused, naming the tensor and both dtypes (f32 and f64 moments still
// cross, as they follow the parameters' dtype); nothing is changed.
TEST(AdamWBf16States, LoadRefusesTheOtherStateDtype) {
  const std::string dir = ::testing::TempDir() + "/lathe_optim_bf16_mismatch";
  std::filesystem::create_directories(dir);
  auto params = [] {
    return std::vector<Parameter>{{"w", make({1, 2, 3, 4}, {2, 2}, DType::BF16), {}},
                                  {"b", make({1, 2}, {2}, DType::F32), {}}};
  };
  AdamWConfig f32_cfg, bf16_cfg;
  bf16_cfg.state_dtype = DType::BF16;
  std::vector<Parameter> a = params(), b = params();
  AdamW(runtime(), a, f32_cfg).save(dir + "/f32.safetensors");
  AdamW(runtime(), b, bf16_cfg).save(dir + "/bf16.safetensors");

  std::vector<Parameter> c = params();
  AdamW want_bf16(runtime(), c, bf16_cfg);
  try {
    want_bf16.load(dir + "/f32.safetensors");
    FAIL() << "no error";
  } catch (const Error& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("w.exp_avg is f32 in the file, but this optimizer keeps it in bf16"), std::string::npos) << msg;
    EXPECT_NE(msg.find("w.exp_avg_sq is f32 in the file"), std::string::npos) << msg;
    EXPECT_NE(msg.find("this optimizer keeps bf16 states"), std::string::npos) << msg;
    EXPECT_EQ(msg.find("b.exp_avg"), std::string::npos) << "the f32 parameter's state matches: " << msg;
  }
  std::vector<Parameter> d = params();
  AdamW want_f32(runtime(), d, f32_cfg);
  try {
    want_f32.load(dir + "/bf16.safetensors");
    FAIL() << "no error";
  } catch (const Error& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("w.exp_avg is bf16 in the file, but this optimizer keeps it in f32"), std::string::npos) << msg;
  }
  EXPECT_EQ(values(want_f32.master(0)), (std::vector<double>{1, 2, 3, 4}));  // unchanged
  // Each loads into its own kind.
  EXPECT_NO_THROW(want_bf16.load(dir + "/bf16.safetensors"));
  EXPECT_NO_THROW(want_f32.load(dir + "/f32.safetensors"));
  // f64 moments (an f64 run) still load into f32 ones.
  std::vector<Parameter> f64 = {{"w", make({1, 2, 3, 4}, {2, 2}, DType::F64), {}}, {"b", make({1, 2}, {2}, DType::F64), {}}};
  AdamW(runtime(), f64, f32_cfg).save(dir + "/f64.safetensors");
  EXPECT_NO_THROW(want_f32.load(dir + "/f64.safetensors"));
}

// The CUDA kernel with bf16 states (bf16 and f32 gradients) against the CPU kernel over several steps. CUDA computes
// in float, the CPU in double, so a value near a bf16 rounding boundary may round the other way: nearly all values are
// the same bits and the rest are close.
TEST(AdamWBf16States, CudaMatchesCpu) {
  std::string why;
  if (!runtime().has_device(Device::cuda(0), &why)) GTEST_SKIP() << "no CUDA device: " << why;
  std::mt19937_64 rng(29);
  const size_t n = 4099;
  const std::vector<double> w0 = random_vector(rng, n);
  std::vector<std::vector<double>> grads;
  for (int s = 0; s < 5; ++s) grads.push_back(random_vector(rng, n));
  AdamWConfig cfg = bf16_states_config();
  cfg.decay_norms = true;  // 1-D here
  std::vector<std::vector<std::vector<double>>> got;  // device -> {w, m, v}
  for (Device d : {Device::cpu(), Device::cuda(0)}) {
    std::vector<Parameter> p = {{"w", make(w0, {int64_t(n)}, DType::BF16, d), {}}};
    AdamW opt(runtime(), p, cfg);
    for (int s = 0; s < 5; ++s) {
      p[0].grad = make(grads[size_t(s)], {int64_t(n)}, s == 3 ? DType::F32 : DType::BF16, d);
      opt.step(0.01, 0.7);
    }
    got.push_back({values(p[0].value), values(opt.exp_avg(0)), values(opt.exp_avg_sq(0))});
  }
  const char* names[] = {"w", "m", "v"};
  for (size_t k = 0; k < 3; ++k) {
    const std::vector<double>&cpu = got[0][k], &gpu = got[1][k];
    double err = 0, norm = 0;
    size_t differ = 0;
    for (size_t i = 0; i < n; ++i) {
      err += (gpu[i] - cpu[i]) * (gpu[i] - cpu[i]);
      norm += cpu[i] * cpu[i];
      differ += gpu[i] != cpu[i];
    }
    EXPECT_LE(err / norm, 1e-6) << names[k];
    EXPECT_LE(differ, n / 100) << names[k] << ": " << differ << " of " << n << " values differ";
  }
}

TEST(GradNorm, MatchesDoubleAndFlagsNonFinite) {
  ExecContext ctx = runtime().context(Device::cpu());
  std::mt19937_64 rng(5);
  const std::vector<double> g1 = random_vector(rng, 300), g2 = random_vector(rng, 7);
  std::vector<Parameter> params = {{"a", make(g1, {10, 30}, DType::BF16), make(g1, {10, 30}, DType::BF16)},
                                   {"b", make(g2, {7}, DType::F32), make(g2, {7}, DType::F32)},
                                   {"c", make(g2, {7}, DType::F32), {}}};
  double want = 0;
  for (double x : values(params[0].grad)) want += x * x;
  for (double x : values(params[1].grad)) want += x * x;
  EXPECT_NEAR(global_grad_norm(ctx, params), std::sqrt(want), 1e-5 * std::sqrt(want));

  std::vector<Parameter> f64 = {{"a", make(g1, {300}, DType::F64), make(g1, {3, 100}, DType::F64)}};
  double w64 = 0;
  for (double x : g1) w64 += x * x;
  EXPECT_NEAR(global_grad_norm(ctx, f64), std::sqrt(w64), 1e-12);

  std::vector<double> bad = g2;
  bad[3] = std::nan("");
  params[1].grad = make(bad, {7}, DType::F32);
  EXPECT_TRUE(std::isnan(global_grad_norm(ctx, params)));
  bad[3] = INFINITY;
  params[1].grad = make(bad, {7}, DType::BF16);
  EXPECT_FALSE(std::isfinite(global_grad_norm(ctx, params)));

  std::vector<Parameter> none = {{"a", make(g2, {7}, DType::F32), {}}};
  EXPECT_EQ(global_grad_norm(ctx, none), 0.0);

  // Launched, then read: the same norm, read once.
  params[1].grad = make(g2, {7}, DType::F32);
  PendingGradNorm pending = launch_grad_norm(ctx, params);
  EXPECT_EQ(pending.read(), global_grad_norm(ctx, params));
  EXPECT_THROW(pending.read(), Error);
  EXPECT_EQ(launch_grad_norm(ctx, none).read(), 0.0);

  EXPECT_EQ(clip_factor(0.5, 1.0), 1.0);
  EXPECT_DOUBLE_EQ(clip_factor(4.0, 1.0), 1.0 / (4.0 + 1e-6));
  EXPECT_EQ(clip_factor(4.0, 0.0), 1.0);  // clipping off
  EXPECT_THROW(clip_factor(NAN, 1.0), Error);
}

// Hand-computed sums over exactly representable values: a bf16 gradient next to an f32 one, a transposed (non-contiguous)
// gradient, an empty one, a 0-d one; sum_squares itself, and its bad inputs.
TEST(GradNorm, MixedEmptyZeroDimAndStridedGradients) {
  ExecContext ctx = runtime().context(Device::cpu());
  // The first 3 columns of a (2, 4), seen as their (3, 2) transpose: a view that skips elements of its storage, so a
  // kernel that ignored the strides would read 7 instead of 3.
  const Tensor strided = make({0.5, -1.5, 2, 7, 3, -0.25, 1, 9}, {2, 4}, DType::F32).narrow(1, 0, 3).transpose(0, 1);
  ASSERT_FALSE(strided.is_contiguous());
  std::vector<Parameter> params = {
      {"a", make({1, 2, 3}, {3}, DType::BF16), make({1, -2, 3}, {3}, DType::BF16)},                 // 14
      {"b", make({0, 0, 0, 0, 0, 0}, {3, 2}, DType::F32), strided},                                 // 16.5625
      {"c", make({}, {0, 4}, DType::F32), make({}, {0, 4}, DType::BF16)},                          // 0
      {"d", make({0}, {}, DType::F32), make({-4}, {}, DType::F32)},                                // 16
      {"e", make({1}, {1}, DType::F32), {}}};                                                      // no gradient
  EXPECT_EQ(global_grad_norm(ctx, params), std::sqrt(14 + 16.5625 + 16));
  EXPECT_EQ(values(sum_squares(ctx, strided)), std::vector<double>{16.5625});
  EXPECT_EQ(sum_squares(ctx, strided).dtype(), DType::F32);
  EXPECT_EQ(sum_squares(ctx, params[0].grad).dtype(), DType::F32);
  EXPECT_EQ(values(sum_squares(ctx, params[2].grad)), std::vector<double>{0.0});
  const Tensor f64 = make({1.5, -2.5}, {2}, DType::F64);
  EXPECT_EQ(sum_squares(ctx, f64).dtype(), DType::F64);
  EXPECT_EQ(values(sum_squares(ctx, f64)), std::vector<double>{8.5});
  // An f64 gradient among f32 ones is summed in f64 and stored in the f32 total.
  params[4].grad = make({1.5, -2.5}, {1, 2}, DType::F64).view({2}).narrow(0, 0, 1);
  EXPECT_EQ(global_grad_norm(ctx, params), std::sqrt(14 + 16.5625 + 16 + 2.25));

  EXPECT_THROW(sum_squares(ctx, make({1, 2}, {2}, DType::I32)), Error);
  const Tensor wrong = make({0}, {}, DType::F64);
  EXPECT_THROW(sum_squares_into(ctx, params[0].grad, wrong), Error);         // bf16 input: the total is f32
  EXPECT_THROW(sum_squares_into(ctx, f64, make({0}, {1}, DType::F64)), Error);  // not 0-d
}

TEST(Schedule, HandComputedValues) {
  ScheduleConfig c;
  c.lr = 1e-3;
  c.warmup_steps = 10;
  c.total_steps = 110;
  c.kind = ScheduleKind::Constant;
  EXPECT_EQ(learning_rate(c, 0), 0.0);
  EXPECT_DOUBLE_EQ(learning_rate(c, 1), 1e-4);
  EXPECT_DOUBLE_EQ(learning_rate(c, 5), 5e-4);
  EXPECT_DOUBLE_EQ(learning_rate(c, 10), 1e-3);
  EXPECT_DOUBLE_EQ(learning_rate(c, 1000), 1e-3);

  c.kind = ScheduleKind::Linear;
  EXPECT_DOUBLE_EQ(learning_rate(c, 3), 3e-4);
  EXPECT_DOUBLE_EQ(learning_rate(c, 10), 1e-3);
  EXPECT_DOUBLE_EQ(learning_rate(c, 35), 7.5e-4);   // a quarter of the way down
  EXPECT_DOUBLE_EQ(learning_rate(c, 60), 5e-4);
  EXPECT_DOUBLE_EQ(learning_rate(c, 110), 0.0);
  EXPECT_DOUBLE_EQ(learning_rate(c, 500), 0.0);
  c.min_lr = 1e-4;
  EXPECT_DOUBLE_EQ(learning_rate(c, 60), 1e-4 + 9e-4 * 0.5);
  EXPECT_DOUBLE_EQ(learning_rate(c, 110), 1e-4);
  EXPECT_DOUBLE_EQ(learning_rate(c, 5), 5e-4);  // the warmup rises from 0, not from min_lr

  c.kind = ScheduleKind::Cosine;
  c.min_lr.reset();
  c.min_lr_ratio = 0.1;  // floor 1e-4
  EXPECT_DOUBLE_EQ(learning_rate(c, 10), 1e-3);
  EXPECT_DOUBLE_EQ(learning_rate(c, 35), 1e-4 + 9e-4 * 0.5 * (1 + std::sqrt(0.5)));  // cos(pi/4)
  EXPECT_DOUBLE_EQ(learning_rate(c, 60), 1e-4 + 9e-4 * 0.5);                      // cos(pi/2) = 0
  EXPECT_DOUBLE_EQ(learning_rate(c, 85), 1e-4 + 9e-4 * 0.5 * (1 - std::sqrt(0.5)));
  EXPECT_DOUBLE_EQ(learning_rate(c, 110), 1e-4);
  EXPECT_DOUBLE_EQ(learning_rate(c, 111), 1e-4);

  c.warmup_steps = 0;  // no warmup: step 1 is already on the curve
  c.total_steps = 4;
  c.min_lr_ratio.reset();
  EXPECT_DOUBLE_EQ(learning_rate(c, 0), 1e-3);
  EXPECT_DOUBLE_EQ(learning_rate(c, 2), 5e-4);
  EXPECT_DOUBLE_EQ(learning_rate(c, 4), 0.0);
}

TEST(Schedule, ValidationReportsEveryProblem) {
  ScheduleConfig c;
  c.kind = ScheduleKind::Cosine;
  c.lr = -1;
  c.warmup_steps = -2;
  c.total_steps = 0;
  c.min_lr = 0.5;
  c.min_lr_ratio = 2;
  const std::vector<std::string> p = validate_schedule(c);
  EXPECT_EQ(p.size(), 6u);  // lr, warmup, both floors, min_lr > lr, ratio > 1, no total_steps
  for (const std::string& s : p) EXPECT_EQ(s.rfind("schedule:", 0), 0u) << s;
  EXPECT_THROW(learning_rate(c, 1), Error);
  EXPECT_EQ(schedule_kind_from_name("linear"), ScheduleKind::Linear);
  EXPECT_THROW(schedule_kind_from_name("cosin"), Error);
  ScheduleConfig w;
  w.kind = ScheduleKind::Linear;
  w.warmup_steps = 20;
  w.total_steps = 10;
  EXPECT_EQ(validate_schedule(w).size(), 1u);
  w.kind = ScheduleKind::Constant;  // constant needs no total_steps
  EXPECT_TRUE(validate_schedule(w).empty());
}

// The CUDA kernel with bf16 parameters and gradients (the production path, which the op check's single-dtype
// cases do not reach) against the CPU kernel.
TEST(AdamW, CudaBf16GradientsMatchCpu) {
  std::string why;
  if (!runtime().has_device(Device::cuda(0), &why)) GTEST_SKIP() << "no CUDA device: " << why;
  std::mt19937_64 rng(9);
  const size_t n = 4099;
  const std::vector<double> w0 = random_vector(rng, n);
  std::vector<std::vector<double>> grads;
  for (int s = 0; s < 5; ++s) grads.push_back(random_vector(rng, n));
  AdamWConfig cfg;
  cfg.weight_decay = 0.1;
  std::vector<std::vector<double>> master, param;
  for (Device d : {Device::cpu(), Device::cuda(0)}) {
    std::vector<Parameter> p = {{"w", make(w0, {int64_t(n)}, DType::BF16, d), {}}};
    cfg.decay_norms = true;  // 1-D here
    AdamW opt(runtime(), p, cfg);
    for (int s = 0; s < 5; ++s) {
      p[0].grad = make(grads[size_t(s)], {int64_t(n)}, DType::BF16, d);
      opt.step(0.01, 0.7);
    }
    master.push_back(values(opt.master(0)));
    param.push_back(values(p[0].value));
  }
  expect_near_rel(master[1], master[0], 2e-6, "cuda master");
  for (size_t i = 0; i < n; ++i) ASSERT_EQ(param[1][i], rounded(master[1][i], DType::BF16)) << i;
}

// The CUDA sum_squares (block partials, then one block) against the f64 sum of the same bf16 values, on sizes with
// one block and with many, contiguous and strided (all but the last column, transposed); the result is the same bits
// on every run (no atomics).
TEST(GradNorm, CudaSumSquaresMatchesAndIsDeterministic) {
  std::string why;
  if (!runtime().has_device(Device::cuda(0), &why)) GTEST_SKIP() << "no CUDA device: " << why;
  ExecContext ctx = runtime().context(Device::cuda(0));
  std::mt19937_64 rng(17);
  for (const Shape& s : {Shape{3, 1365}, Shape{2049, 1031}, Shape{3, 1000, 999}}) {
    const std::vector<double> v = random_vector(rng, size_t(shape_numel(s)));
    for (bool strided : {false, true}) {
      double want = 0;  // the order does not matter to the exact sum
      for (size_t i = 0; i < v.size(); ++i)
        if (!strided || int64_t(i) % s.back() != s.back() - 1) want += rounded(v[i], DType::BF16) * rounded(v[i], DType::BF16);
      Tensor g = make(v, s, DType::BF16, Device::cuda(0));
      if (strided) g = g.narrow(-1, 0, s.back() - 1).transpose(-1, -2);
      const double first = values(sum_squares(ctx, g))[0];
      EXPECT_NEAR(first, want, 1e-5 * want) << shape_str(s) << (strided ? " strided" : "");
      for (int r = 0; r < 3; ++r) ASSERT_EQ(values(sum_squares(ctx, g))[0], first) << shape_str(s);
    }
  }
}

// adamw_list (one op for many tensors; one launch on CUDA, chunks of 65,536 elements) gives each tensor bitwise what
// adamw gives it alone: f32 masters with the rounded bf16 parameter, and bf16 states; sizes with chunk and pack tails.
TEST(AdamW, ListIsBitwiseThePerTensorUpdate) {
  std::vector<Device> devices = {Device::cpu()};
  if (runtime().has_device(Device::cuda(0))) devices.push_back(Device::cuda(0));
  for (Device d : devices) {
    ExecContext ctx = runtime().context(d);
    for (const bool bf16_states : {false, true}) {
      std::mt19937_64 rng(29);
      const DType state = bf16_states ? DType::BF16 : DType::F32;
      const AdamWAttrs a{1e-2, 0.9, 0.95, 1e-8, 0.1, 4, 0.5, std::nullopt};
      std::vector<AdamWGroup> list, single;
      for (int64_t n : {int64_t(131073), int64_t(7), int64_t(1), int64_t(65536)}) {
        const std::vector<double> w0 = random_vector(rng, size_t(n)), g = random_vector(rng, size_t(n), -3.0, 3.0);
        const std::vector<double> m0 = random_vector(rng, size_t(n), -0.1, 0.1);
        const std::vector<double> v0 = random_vector(rng, size_t(n), 0.0, 0.01);
        for (std::vector<AdamWGroup>* into : {&list, &single})
          into->push_back({make(w0, {n}, state, d), make(g, {n}, DType::BF16, d), make(m0, {n}, state, d),
                           make(v0, {n}, state, d), bf16_states ? Tensor() : make(w0, {n}, DType::BF16, d)});
      }
      adamw_update_list(ctx, list, a);
      for (AdamWGroup& s : single) adamw_update(ctx, s.master, s.grad, s.m, s.v, a, s.param);
      for (size_t i = 0; i < list.size(); ++i) {
        const std::string where = d.str() + (bf16_states ? " bf16 states" : " f32 masters") + " tensor " +
                                  std::to_string(i);
        EXPECT_EQ(values(list[i].master), values(single[i].master)) << where;
        EXPECT_EQ(values(list[i].m), values(single[i].m)) << where;
        EXPECT_EQ(values(list[i].v), values(single[i].v)) << where;
        if (!bf16_states) EXPECT_EQ(values(list[i].param), values(single[i].param)) << where;
      }
    }
  }
}

// sum_squares_list on CUDA (chunks of 65,536 elements, then each tensor's chunks in order) against the f64 sums of the
// same bf16 values, and the same bits on every run.
TEST(GradNorm, CudaSumSquaresListMatchesAndIsDeterministic) {
  std::string why;
  if (!runtime().has_device(Device::cuda(0), &why)) GTEST_SKIP() << "no CUDA device: " << why;
  ExecContext ctx = runtime().context(Device::cuda(0));
  std::mt19937_64 rng(31);
  std::vector<Tensor> xs;
  std::vector<double> want;
  for (const Shape& s : {Shape{3, 1365}, Shape{0}, Shape{2049, 1031}, Shape{1}, Shape{65536}}) {
    const std::vector<double> v = random_vector(rng, size_t(shape_numel(s)));
    double sum = 0;
    for (double x : v) sum += rounded(x, DType::BF16) * rounded(x, DType::BF16);
    want.push_back(sum);
    xs.push_back(make(v, s, DType::BF16, Device::cuda(0)));
  }
  const Tensor out = Tensor::empty({int64_t(xs.size())}, DType::F32, ctx.allocator);
  sum_squares_list_into(ctx, xs, out);
  const std::vector<double> first = values(out);
  for (size_t i = 0; i < want.size(); ++i) EXPECT_NEAR(first[i], want[i], 1e-5 * want[i] + 1e-30) << i;
  for (int r = 0; r < 3; ++r) {
    sum_squares_list_into(ctx, xs, out);
    ASSERT_EQ(values(out), first);
  }
}
