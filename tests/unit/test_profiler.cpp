// The per-op profiler (backend/profiler.h) on the CPU: kernels are timed and counted by name, matmul FLOPs come from
// the shapes, composites are counted but timed through their ops, an op nested in an exact kernel counts in that
// kernel only, a kernel that throws leaves the profiler usable, contexts without a profiler are not timed, and the host
// time inside a run function lies within its interval; the time between timed ops is attributed to the pair of
// kernels around it.
// Also the FLOP model of train/flops.h against the Qwen3-0.6B figures of research/perf-anchors.md.
#include <gtest/gtest.h>

#include <algorithm>

#include "backend/profiler.h"
#include "backend/runtime.h"
#include "ops/ops.h"
#include "train/flops.h"

using namespace lathe;

namespace {

Tensor filled(ExecContext& ctx, const Shape& shape, float v) {
  Tensor t = Tensor::empty(shape, DType::F32, ctx.allocator);
  std::fill(t.data<float>(), t.data<float>() + t.numel(), v);
  return t;
}

const OpProfiler::Total* find(const std::vector<OpProfiler::Total>& v, const std::string& name) {
  for (const auto& t : v)
    if (t.name == name) return &t;
  return nullptr;
}

// A kernel for `mul` (f32) that runs another op inside it, and one for `scale` that throws.
void plant(KernelRegistry& r) {
  r.add(KernelDef{OpId::mul, DeviceType::CPU, DType::F32, "test/nests_add", [](const OpCall&) { return Support::yes(); },
                  [](const OpCall& call, ExecContext& ctx) { add(ctx, call.inputs[0], call.inputs[1]); }});
  r.add(KernelDef{OpId::scale, DeviceType::CPU, DType::F32, "test/throws", [](const OpCall&) { return Support::yes(); },
                  [](const OpCall&, ExecContext&) { LATHE_FAIL("planted failure"); }});
}

}  // namespace

TEST(Profiler, TimesKernelsByNameWithoutCountingTwice) {
  Runtime rt(plant);
  ExecContext before = rt.context(Device::cpu());
  OpProfiler prof(rt.backend(DeviceType::CPU), Device::cpu());
  rt.set_profiler(&prof);
  ExecContext ctx = rt.context(Device::cpu());
  ASSERT_EQ(ctx.profiler, &prof);
  EXPECT_EQ(before.profiler, nullptr);

  const Tensor a = filled(ctx, {64, 32}, 0.5f), b = filled(ctx, {48, 32}, 0.25f);
  matmul(ctx, a, b, MatmulAttrs{false, true});
  matmul(ctx, a, b, MatmulAttrs{false, true});
  mul(ctx, a, a);                                      // test/nests_add: the add inside is not timed apart
  EXPECT_THROW(scale(ctx, a, 2.0), Error);             // the throwing kernel's interval is closed
  add(ctx, a, a);                                      // timed again: the nesting depth is back to 0
  silu(ctx, cast(ctx, filled(ctx, {16}, 1.0f), DType::BF16));  // composite/upcast_f32 -> cast, silu, cast
  matmul(before, a, b, MatmulAttrs{false, true});      // a context without the profiler: not timed

  const OpProfiler::Profile p = prof.collect();
  const OpProfiler::Total* mm = nullptr;
  for (const auto& t : p.kernels)
    if (t.op == OpId::matmul) mm = &t;
  ASSERT_NE(mm, nullptr);
  EXPECT_EQ(mm->calls, 2);
  EXPECT_DOUBLE_EQ(mm->flops, 2 * 2.0 * 64 * 48 * 32);
  EXPECT_GT(mm->host_ms, 0.0) << "the CPU's matmul runs inside its run function";
  ASSERT_EQ(p.matmul_shapes.size(), 1u);
  EXPECT_EQ(p.matmul_shapes[0].name, "64 x 48 x 32 nt");
  ASSERT_NE(find(p.kernels, "test/nests_add"), nullptr);
  EXPECT_EQ(find(p.kernels, "test/nests_add")->calls, 1);
  ASSERT_NE(find(p.kernels, "test/throws"), nullptr);
  const OpProfiler::Total* add_k = nullptr;
  for (const auto& t : p.kernels)
    if (t.op == OpId::add) add_k = &t;
  ASSERT_NE(add_k, nullptr);
  EXPECT_EQ(add_k->calls, 1) << "the add nested in test/nests_add was counted on its own";
  EXPECT_TRUE(std::any_of(p.composites.begin(), p.composites.end(),
                          [](const auto& c) { return c.first == "composite/upcast_f32" && c.second == 1; }));
  ASSERT_NE(find(p.kernels, "cpu/silu"), nullptr) << "the composite's inner ops are timed";
  double sum = 0;
  int64_t calls = 0;
  for (const auto& t : p.kernels) {
    EXPECT_GE(t.ms, 0.0) << t.name;
    // The host time inside the run function lies within the device interval on the CPU (its events are host clocks
    // read before and after): a kernel that runs on the host spends its time there.
    EXPECT_GE(t.host_ms, 0.0) << t.name;
    EXPECT_LE(t.host_ms, t.ms + 1e-6) << t.name;
    sum += t.ms;
    calls += t.calls;
  }
  EXPECT_NEAR(sum, p.kernels_ms, 1e-9);
  EXPECT_EQ(calls, p.calls);
  EXPECT_LE(p.kernels_ms, p.span_ms + 1e-6);
  // The time between timed ops, by the pair around it: on the CPU the ops run one after another on the host clock, so
  // the gaps and the kernels together make up the span (the host code between the calls above is in the gaps).
  double between = 0;
  for (const auto& g : p.gaps) {
    EXPECT_GT(g.ms, 0.0) << g.name;
    EXPECT_NE(g.name.find(" -> "), std::string::npos) << g.name;
    between += g.ms;
  }
  EXPECT_FALSE(p.gaps.empty());
  EXPECT_NEAR(p.kernels_ms + between, p.span_ms, 1e-6);
  EXPECT_TRUE(std::is_sorted(p.gaps.begin(), p.gaps.end(), [](const auto& a, const auto& b) { return a.ms > b.ms; }));

  // collect() forgets what it returned.
  EXPECT_EQ(prof.collect().calls, 0);
  rt.set_profiler(nullptr);
  EXPECT_EQ(rt.context(Device::cpu()).profiler, nullptr);
}

TEST(Flops, Qwen3SmallShapeMatchesThePerfAnchors) {
  ModelConfig c;
  c.vocab_size = 151936;
  c.hidden_size = 1024;
  c.intermediate_size = 3072;
  c.num_layers = 28;
  c.num_heads = 16;
  c.num_kv_heads = 8;
  c.head_dim = 128;
  c.tie_word_embeddings = true;
  // Per layer: q 1024x2048, k and v 1024x1024, o 2048x1024, MLP 3 x 1024x3072; plus the tied head.
  const double n = 28.0 * (2048 * 1024 + 2 * 1024 * 1024 + 2048 * 1024 + 3 * 1024 * 3072) + 151936.0 * 1024;
  EXPECT_DOUBLE_EQ(matmul_parameter_count(c), n);
  const std::vector<int32_t> one_doc = {0, 4096}, two_docs = {0, 2048, 4096};
  const double attn = 6.0 * 28 * 16 * 128 * 4096;
  EXPECT_DOUBLE_EQ(flops_per_token(c, one_doc), 6 * n + attn);
  EXPECT_NEAR(flops_per_token(c, one_doc) / 1e9, 4.99, 0.01);  // research/perf-anchors.md sec. 2
  EXPECT_DOUBLE_EQ(attention_flops_per_token(c, two_docs), attn / 2);
  EXPECT_DOUBLE_EQ(lora_flops_per_token(c, 1e6, one_doc), 4 * n + 6e6 + attn);
  EXPECT_EQ(peak_flops("NVIDIA H100 80GB HBM3"), 989e12);
  EXPECT_EQ(peak_flops("cpu"), 0.0);
}

TEST(Flops, Qwen35SmallShapeCountsGdnLayersAndFullAttentionOnly) {
  // The Qwen3.5-0.8B shape of issue 8: 24 layers (3 GDN + 1 full attention, repeated), hidden 1024, 8/2 attention
  // heads of 256, 16/16 GDN heads of 128, FFN 3584, tied vocab 248320.
  ModelConfig c;
  c.model_type = "qwen3_5_text";
  c.vocab_size = 248320;
  c.hidden_size = 1024;
  c.intermediate_size = 3584;
  c.num_layers = 24;
  c.num_heads = 8;
  c.num_kv_heads = 2;
  c.head_dim = 256;
  c.tie_word_embeddings = true;
  c.linear_num_key_heads = c.linear_num_value_heads = 16;
  c.linear_key_head_dim = c.linear_value_head_dim = 128;
  c.linear_conv_kernel_dim = 4;
  for (int i = 0; i < 24; ++i) c.layer_types.push_back((i + 1) % 4 == 0 ? "full_attention" : "linear_attention");
  // GDN: in_proj_qkv 1024 x 6144, in_proj_z 1024 x 2048, in_proj_b/a 1024 x 16, out_proj 2048 x 1024; attention:
  // q (query + gate) 1024 x 4096, k and v 1024 x 512, o 2048 x 1024; MLP 3 x 1024 x 3584; the tied head once.
  const double gdn = 1024.0 * 6144 + 1024.0 * 2048 + 2 * 1024.0 * 16 + 2048.0 * 1024;
  const double attn = 1024.0 * 4096 + 2 * 1024.0 * 512 + 2048.0 * 1024;
  const double n = 18 * gdn + 6 * attn + 24 * 3 * 1024.0 * 3584 + 248320.0 * 1024;
  EXPECT_DOUBLE_EQ(matmul_parameter_count(c), n);
  // research/gated-deltanet.md sec. 3.6: about 688K FLOPs per token and value head at d = 128, fwd + bwd.
  EXPECT_DOUBLE_EQ(gdn_core_flops_per_token(c), 18.0 * 16 * 688128);
  const std::vector<int32_t> one_doc = {0, 4096};
  EXPECT_DOUBLE_EQ(attention_flops_per_token(c, one_doc), 6.0 * 6 * 8 * 256 * 4096);
  EXPECT_DOUBLE_EQ(flops_per_token(c, one_doc), 6 * n + 6.0 * 6 * 8 * 256 * 4096 + 18.0 * 16 * 688128);
  // Layer by layer (what a pipeline is balanced by): a full-attention layer its projections, MLP and attention at
  // 4,096 tokens, a GDN layer its projections, MLP and core; the head on the last; together the whole count.
  const std::vector<double> layers = layer_flops_per_token(c, 4096);
  ASSERT_EQ(layers.size(), 24u);
  const double mlp = 3 * 1024.0 * 3584;
  EXPECT_DOUBLE_EQ(layers[0], 6 * (gdn + mlp) + 16.0 * 688128);
  EXPECT_DOUBLE_EQ(layers[3], 6 * (attn + mlp) + 6.0 * 8 * 256 * 4096);
  EXPECT_DOUBLE_EQ(layers[23], 6 * (attn + mlp) + 6.0 * 8 * 256 * 4096 + 6 * 248320.0 * 1024);
  double sum = 0;
  for (double f : layers) sum += f;
  EXPECT_NEAR(sum, flops_per_token(c, one_doc), 1e-12 * sum);
}
