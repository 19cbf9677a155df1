// Fused ops against the ops they fuse. residual_rmsnorm(x, r, w) is, bitwise, add(x, r) followed by rmsnorm, on the
// CPU (f32, f64) and on CUDA (f32, bf16, f16) where a GPU exists; so is swiglu_halves (+ backward) swiglu on the two
// halves of each row; qk_norm_rope is within one rounding of rmsnorm then rope. The CPU's bf16/f16 rows go through
// upcast_f32, which keeps intermediates in f32 between the steps, so they are the op check's business (tolerance), not
// this test's. Values against the f64 reference and the backwards: the op-check cases. Also copy_into's strided
// destinations (concat_columns), matmul on column slices, and embedding_backward_into (the tied LM head's gradient
// taking the embedding's rows in place).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <numeric>
#include <random>

#include "backend/runtime.h"
#include "ops/ops.h"

using namespace lathe;

namespace {

Runtime& runtime() {
  static Runtime rt;
  return rt;
}

Tensor random_tensor(std::mt19937_64& rng, const Shape& shape, DType dtype, Device device) {
  std::uniform_real_distribution<float> dist(-2.0f, 2.0f);
  std::vector<float> v(static_cast<size_t>(shape_numel(shape)));
  for (float& x : v) x = dist(rng);
  ExecContext ctx = runtime().context(device);
  return cast(ctx, runtime().from_host(v.data(), shape, DType::F32, device), dtype);
}

bool same_bits(const Tensor& a, const Tensor& b) {
  const Tensor ha = runtime().copy_to(a, Device::cpu()), hb = runtime().copy_to(b, Device::cpu());
  return ha.nbytes() == hb.nbytes() && std::memcmp(ha.data_ptr(), hb.data_ptr(), ha.nbytes()) == 0;
}

}  // namespace

TEST(ResidualRmsnorm, IsTheAddThenTheNormBitwise) {
  std::vector<std::pair<Device, DType>> rows = {{Device::cpu(), DType::F32}, {Device::cpu(), DType::F64}};
  if (runtime().has_device(Device::cuda(0)))
    for (DType dt : {DType::F32, DType::BF16, DType::F16}) rows.push_back({Device::cuda(0), dt});
  // Row widths of the CUDA kernel's shapes: lane groups of 16 (128 in bf16), one warp with a second pass over the row
  // (1030: single elements), two and four warps (2048, 2560 in bf16).
  for (const auto& [device, dtype] : rows)
    for (int64_t h : {int64_t(128), int64_t(1030), int64_t(2048), int64_t(2560)}) {
      std::mt19937_64 rng{uint64_t(h)};
      ExecContext ctx = runtime().context(device);
      const Tensor x = random_tensor(rng, {37, h}, dtype, device), r = random_tensor(rng, {37, h}, dtype, device);
      const Tensor w = random_tensor(rng, {h}, dtype, device);
      const NormAttrs attrs{1e-6, 1.0};
      const std::vector<Tensor> fused = residual_rmsnorm(ctx, x, r, w, attrs);
      const Tensor h_sum = add(ctx, x, r);
      const std::string where = device.str() + " " + std::string(dtype_name(dtype)) + " h=" + std::to_string(h);
      EXPECT_TRUE(same_bits(fused[1], h_sum)) << where << ": h";
      EXPECT_TRUE(same_bits(fused[0], rmsnorm(ctx, h_sum, w, attrs))) << where << ": y";
    }
}

namespace {

// The devices and dtypes of the bitwise checks: the CPU's f32 and f64 kernels, CUDA's f32, bf16 and f16 where a GPU
// exists (the CPU's bf16/f16 rows are upcast_f32's, see above).
std::vector<std::pair<Device, DType>> bitwise_rows() {
  std::vector<std::pair<Device, DType>> rows = {{Device::cpu(), DType::F32}, {Device::cpu(), DType::F64}};
  if (runtime().has_device(Device::cuda(0)))
    for (DType dt : {DType::F32, DType::BF16, DType::F16}) rows.push_back({Device::cuda(0), dt});
  return rows;
}

// max |a - b| / max |b| over the elements, in f64.
double max_difference_over_max(const Tensor& a, const Tensor& b) {
  ExecContext cpu = runtime().context(Device::cpu());
  const Tensor ha = cast(cpu, runtime().copy_to(a, Device::cpu()), DType::F64);
  const Tensor hb = cast(cpu, runtime().copy_to(b, Device::cpu()), DType::F64);
  double diff = 0, scale = 0;
  for (int64_t i = 0; i < ha.numel(); ++i) {
    const double x = ha.data<double>()[i], y = hb.data<double>()[i];
    diff = std::max(diff, std::abs(x - y));
    scale = std::max(scale, std::abs(y));
  }
  return diff / scale;
}

}  // namespace

// swiglu_halves is swiglu on the two halves of each row, bitwise, forward and backward; concat_columns (the composite's
// and the fused projections' fallback) puts each part in its columns.
TEST(SwigluHalves, IsSwigluOnTheHalvesBitwise) {
  for (const auto& [device, dtype] : bitwise_rows())
    for (int64_t i : {int64_t(24), int64_t(1030)}) {  // whole 16-byte packs, and single elements
      std::mt19937_64 rng{uint64_t(i)};
      ExecContext ctx = runtime().context(device);
      const Tensor gu = random_tensor(rng, {19, 2 * i}, dtype, device), dy = random_tensor(rng, {19, i}, dtype, device);
      const Tensor g = contiguous(ctx, gu.narrow(1, 0, i)), u = contiguous(ctx, gu.narrow(1, i, i));
      const std::string where = device.str() + " " + std::string(dtype_name(dtype)) + " i=" + std::to_string(i);
      EXPECT_TRUE(same_bits(swiglu_halves(ctx, gu), swiglu(ctx, g, u))) << where;
      const std::vector<Tensor> parts = swiglu_backward(ctx, g, u, dy);
      const Tensor dgu = swiglu_halves_backward(ctx, gu, dy);
      EXPECT_TRUE(same_bits(contiguous(ctx, dgu.narrow(1, 0, i)), parts[0])) << where << ": dgate";
      EXPECT_TRUE(same_bits(contiguous(ctx, dgu.narrow(1, i, i)), parts[1])) << where << ": dup";
      EXPECT_TRUE(same_bits(concat_columns(ctx, parts), dgu)) << where << ": concat_columns";
    }
}

TEST(CopyInto, WritesAColumnSliceAndRefusesOverlappingDestinations) {
  ExecContext ctx = runtime().context(Device::cpu());
  std::mt19937_64 rng{3};
  const Tensor src = random_tensor(rng, {5, 3}, DType::F32, Device::cpu());
  const Tensor dst = random_tensor(rng, {5, 8}, DType::F32, Device::cpu());
  const Tensor before = contiguous(ctx, dst.narrow(1, 0, 2));
  copy_into(ctx, src, dst.narrow(1, 2, 3));
  EXPECT_TRUE(same_bits(contiguous(ctx, dst.narrow(1, 2, 3)), src));
  EXPECT_TRUE(same_bits(contiguous(ctx, dst.narrow(1, 0, 2)), before));  // the other columns untouched
  const Tensor row = random_tensor(rng, {1, 3}, DType::F32, Device::cpu());
  EXPECT_THROW(copy_into(ctx, src, row.expand({5, 3})), Error);  // five rows would write one
}

// qk_norm_rope against the ops it fuses (heads copied out of qkv, rmsnorm, rope; backward: inverse rope,
// rmsnorm_backward): within one rounding of the output dtype everywhere; bitwise where the device rounds alike (the
// count of differing values is printed).
// matmul / matmul_into with column slices as A, B and C (cuBLASLt and BLAS leading dimensions, no copies): the
// result equals the product of contiguous copies, and the columns of C outside the slice stay untouched. Every
// transpose combination, beta 0 and 1; CPU f32 and f64, and CUDA f32 and bf16 where a GPU exists.
TEST(Matmul, ReadsAndWritesColumnSlices) {
  std::vector<std::pair<Device, DType>> rows = {{Device::cpu(), DType::F32}, {Device::cpu(), DType::F64}};
  if (runtime().has_device(Device::cuda(0)))
    for (DType dt : {DType::F32, DType::BF16}) rows.push_back({Device::cuda(0), dt});
  const int64_t m = 40, n = 24, k = 32;  // slices of 48-, 64- and 56-column matrices, 16-byte aligned in bf16
  for (const auto& [device, dtype] : rows)
    for (bool ta : {false, true})
      for (bool tb : {false, true})
        for (float beta : {0.0f, 1.0f}) {
          std::mt19937_64 rng{uint64_t(ta * 4 + tb * 2 + int(beta))};
          ExecContext ctx = runtime().context(device);
          const Tensor wa = random_tensor(rng, ta ? Shape{k, 48} : Shape{m, 48}, dtype, device);
          const Tensor wb = random_tensor(rng, tb ? Shape{n, 64} : Shape{k, 64}, dtype, device);
          const Tensor wc = random_tensor(rng, {m, 56}, dtype, device);
          const Tensor a = wa.narrow(1, 8, ta ? m : k), b = wb.narrow(1, 16, tb ? k : n);
          Tensor c = wc.narrow(1, 24, n);
          const Tensor left = contiguous(ctx, wc.narrow(1, 0, 24));
          const MatmulAttrs at{ta, tb, 1.0f, beta};
          Tensor want = contiguous(ctx, c);
          matmul_into(ctx, contiguous(ctx, a), contiguous(ctx, b), want, at);
          matmul_into(ctx, a, b, c, at);
          const std::string where = fmt::format("{} {} ta={} tb={} beta={}", device.str(), dtype_name(dtype), ta, tb,
                                                beta);
          const Tensor got = runtime().copy_to(cast(ctx, contiguous(ctx, c), DType::F64), Device::cpu());
          const Tensor ref = runtime().copy_to(cast(ctx, want, DType::F64), Device::cpu());
          // Two roundings of the result apart at most (either side may take another algorithm): 1e-2 relative in bf16.
          const double rel = dtype == DType::BF16 ? 1e-2 : 1e-5;
          const auto tol = [&](double v) { return rel * std::max(1.0, std::abs(v)); };
          for (int64_t i = 0; i < got.numel(); ++i)
            ASSERT_NEAR(got.data<double>()[i], ref.data<double>()[i], tol(ref.data<double>()[i])) << where << " " << i;
          EXPECT_TRUE(same_bits(contiguous(ctx, wc.narrow(1, 0, 24)), left)) << where << ": columns left of C";
          if (beta == 0.0f) {  // the plain product too
            const Tensor y = matmul(ctx, a, b, {ta, tb});
            const Tensor yc = runtime().copy_to(cast(ctx, y, DType::F64), Device::cpu());
            for (int64_t i = 0; i < yc.numel(); ++i)
              ASSERT_NEAR(yc.data<double>()[i], ref.data<double>()[i], tol(ref.data<double>()[i])) << where << " " << i;
          }
        }
}

// dweight += rows of dy summed per id, against a plain f64 loop over the same values: rows no id names keep their
// bytes, named rows are within one rounding of old + sum (the CUDA kernel sums in fp32 first: bf16 tolerance there).
// The CPU's bf16 row runs the f32 kernel through upcast_f32, which must hand it the output's current contents.
TEST(EmbeddingBackwardInto, AddsEachIdsRowsAndLeavesTheOtherRows) {
  std::vector<std::pair<Device, DType>> rows = {
      {Device::cpu(), DType::F32}, {Device::cpu(), DType::F64}, {Device::cpu(), DType::BF16}};
  if (runtime().has_device(Device::cuda(0)))
    for (DType dt : {DType::F32, DType::BF16}) rows.push_back({Device::cuda(0), dt});
  const int64_t vocab = 37, hidden = 72, tokens = 300;
  std::vector<int32_t> ids(static_cast<size_t>(tokens));
  for (int64_t t = 0; t < tokens; ++t) ids[size_t(t)] = int32_t((t * t + 3 * t) % 29);  // ids 29..36 never occur
  for (const auto& [device, dtype] : rows) {
    const std::string where = fmt::format("{} {}", device.str(), dtype_name(dtype));
    std::mt19937_64 rng{7};
    ExecContext ctx = runtime().context(device);
    const Tensor dy = random_tensor(rng, {tokens, hidden}, dtype, device);
    Tensor dw = random_tensor(rng, {vocab, hidden}, dtype, device);
    const Tensor before = runtime().copy_to(cast(ctx, dw, DType::F64), Device::cpu());
    const Tensor dy64 = runtime().copy_to(cast(ctx, dy, DType::F64), Device::cpu());
    const Tensor before_bits = runtime().copy_to(dw, Device::cpu());
    embedding_backward_into(ctx, dy, runtime().from_host(ids.data(), {tokens}, DType::I32, device), dw);
    const Tensor after_bits = runtime().copy_to(dw, Device::cpu());
    const Tensor got = runtime().copy_to(cast(ctx, dw, DType::F64), Device::cpu());
    const size_t row_bytes = size_t(hidden) * dtype_size(dtype);
    for (int64_t v = 0; v < vocab; ++v) {
      std::vector<double> want(static_cast<size_t>(hidden));
      for (int64_t j = 0; j < hidden; ++j) want[size_t(j)] = before.data<double>()[v * hidden + j];
      bool named = false;
      for (int64_t t = 0; t < tokens; ++t) {
        if (ids[size_t(t)] != v) continue;
        named = true;
        for (int64_t j = 0; j < hidden; ++j) want[size_t(j)] += dy64.data<double>()[t * hidden + j];
      }
      if (!named) {
        EXPECT_EQ(std::memcmp(static_cast<const char*>(after_bits.data_ptr()) + size_t(v) * row_bytes,
                              static_cast<const char*>(before_bits.data_ptr()) + size_t(v) * row_bytes, row_bytes),
                  0)
            << where << ": row " << v << " has no token and must keep its bytes";
        continue;
      }
      const double rel = dtype == DType::BF16 ? 8e-3 : (dtype == DType::F32 ? 1e-5 : 1e-12);
      for (int64_t j = 0; j < hidden; ++j)
        ASSERT_NEAR(got.data<double>()[v * hidden + j], want[size_t(j)], rel * std::max(1.0, std::abs(want[size_t(j)])))
            << where << ": row " << v << " column " << j;
    }
  }
}

TEST(QkNormRope, IsTheNormThenTheRotationWithinOneRounding) {
  for (const auto& [device, dtype] : bitwise_rows()) {
    const int64_t t = 300, hq = 8, hkv = 2, d = 128;
    std::mt19937_64 rng{11};
    ExecContext ctx = runtime().context(device);
    const Tensor qkv = random_tensor(rng, {t, (hq + 2 * hkv) * d}, dtype, device);
    const Tensor wq = random_tensor(rng, {d}, dtype, device), wk = random_tensor(rng, {d}, dtype, device);
    std::vector<int32_t> pos(static_cast<size_t>(t));
    for (int64_t i = 0; i < t; ++i) pos[size_t(i)] = int32_t(i * 37 % 5000);
    const Tensor positions = runtime().from_host(pos.data(), {t}, DType::I32, device);
    const QkNormRopeAttrs attrs{hq, hkv, NormAttrs{1e-6, 0.0}, RopeAttrs{1e6, 0, false}};
    const std::vector<Tensor> fused = qk_norm_rope(ctx, qkv, wq, wk, positions, attrs);
    const auto heads = [&](int64_t first, int64_t n) {
      return contiguous(ctx, qkv.narrow(1, first * d, n * d)).view({t, n, d});
    };
    const Tensor q = rope(ctx, rmsnorm(ctx, heads(0, hq), wq, attrs.norm), positions, attrs.rope);
    const Tensor k = rope(ctx, rmsnorm(ctx, heads(hq, hkv), wk, attrs.norm), positions, attrs.rope);
    const double ulp = dtype == DType::BF16 ? 1.0 / 128 : dtype == DType::F16 ? 1.0 / 1024 : 1e-6;
    const std::string where = device.str() + " " + std::string(dtype_name(dtype));
    EXPECT_LE(max_difference_over_max(fused[0], q), ulp) << where << ": q";
    EXPECT_LE(max_difference_over_max(fused[1], k), ulp) << where << ": k";
    EXPECT_TRUE(same_bits(fused[2], heads(hq + hkv, hkv))) << where << ": v";
    std::printf("qk_norm_rope %s: q %s, k %s\n", where.c_str(), same_bits(fused[0], q) ? "bitwise" : "not bitwise",
                same_bits(fused[1], k) ? "bitwise" : "not bitwise");
  }
}

// cross_entropy on logits in padded rows (empty_padded_rows, the LM head's layout), the padding NaN so that a read of
// it poisons the row: loss and dlogits against logsumexp(x) - x[label] and grad_scale (softmax(x) - onehot(label))
// computed here in f64 from the same (rounded) values; dlogits comes back in padded rows too, an ignored row all zero.
// Vocabularies: one pack short of a whole one, odd (the kernel's single-logit tail after its 16-byte packs), a multiple
// of 64 (no padding).
TEST(CrossEntropy, ReadsAndWritesPaddedRows) {
  std::vector<std::pair<Device, DType>> rows = {{Device::cpu(), DType::F32}, {Device::cpu(), DType::F64}};
  if (runtime().has_device(Device::cuda(0)))
    for (DType dt : {DType::F32, DType::BF16}) rows.push_back({Device::cuda(0), dt});
  const int64_t n = 6;
  for (const auto& [device, dtype] : rows)
    for (int64_t v : {int64_t(7), int64_t(1031), int64_t(2048)}) {
      std::mt19937_64 rng{uint64_t(v)};
      ExecContext ctx = runtime().context(device);
      const int64_t ld = (v + 63) / 64 * 64;
      std::vector<double> host(size_t(n * ld), std::nan(""));
      std::uniform_real_distribution<double> dist(-4.0, 4.0);
      for (int64_t r = 0; r < n; ++r)
        for (int64_t j = 0; j < v; ++j) host[size_t(r * ld + j)] = dist(rng);
      const Tensor full = cast(ctx, runtime().from_host(host.data(), {n, ld}, DType::F64, device), dtype);
      const Tensor logits = full.narrow(1, 0, v);
      ASSERT_FALSE(logits.is_contiguous() && v != ld);
      const std::vector<double> x = [&] {  // the values as rounded to dtype
        const Tensor h = runtime().copy_to(cast(ctx, full, DType::F64), Device::cpu());
        return std::vector<double>(h.data<double>(), h.data<double>() + h.numel());
      }();
      std::vector<int32_t> labels(static_cast<size_t>(n));
      for (int64_t r = 0; r < n; ++r) labels[size_t(r)] = r == 2 ? -100 : int32_t(rng() % uint64_t(v));
      labels[0] = int32_t(v - 1);  // the last logit: in the tail where there is one
      const Tensor lab = runtime().from_host(labels.data(), {n}, DType::I32, device);
      const double scale = 0.5;
      const std::vector<Tensor> out = cross_entropy(ctx, logits, lab, {-100, true, scale});
      ASSERT_EQ(out.size(), 2u);
      ASSERT_EQ(out[1].shape(), (Shape{n, v}));
      EXPECT_TRUE(rows_contiguous(out[1]) && leading_dim(out[1]) % 64 == 0) << out[1].describe();
      const Tensor loss = runtime().copy_to(cast(ctx, out[0], DType::F64), Device::cpu());
      const Tensor grad = runtime().copy_to(cast(ctx, contiguous(ctx, out[1]), DType::F64), Device::cpu());
      const std::string where = fmt::format("{} {} V={}", device.str(), dtype_name(dtype), v);
      const double rel = dtype == DType::F64 ? 1e-12 : dtype == DType::F32 ? 1e-5 : 8e-3;
      for (int64_t r = 0; r < n; ++r) {
        const double* xr = x.data() + r * ld;
        const double mx = *std::max_element(xr, xr + v);
        double sum = 0;
        for (int64_t j = 0; j < v; ++j) sum += std::exp(xr[j] - mx);
        const double lse = mx + std::log(sum);
        const bool ignored = labels[size_t(r)] == -100;
        const double want_loss = ignored ? 0.0 : lse - xr[labels[size_t(r)]];
        EXPECT_NEAR(loss.data<double>()[r], want_loss, 1e-5 * std::max(1.0, want_loss)) << where << " row " << r;
        for (int64_t j = 0; j < v; ++j) {
          const double onehot = j == int64_t(labels[size_t(r)]) ? 1.0 : 0.0;
          const double want = ignored ? 0.0 : scale * (std::exp(xr[j] - lse) - onehot);
          ASSERT_NEAR(grad.data<double>()[r * v + j], want, rel * std::abs(want) + 1e-7)
              << where << " row " << r << " " << j;
        }
      }
    }
}

// paged_attention against the training attention op: each sequence's keys and values laid out whole for `attention`
// (causal over all its positions) and scattered over shuffled cache blocks for paged_attention, whose queries are the
// sequence's last n positions; its output equals attention's last n rows. Sequences: a decoding step at 13 positions, a
// chunk of 4 after 6, a first chunk of 5 (no past); GQA group 2; blocks of 4. On the CPU (f32, f64) and CUDA (f32,
// bf16) where a GPU exists.
TEST(PagedAttention, IsTheLastRowsOfCausalAttentionOverTheSequence) {
  std::vector<std::pair<Device, DType>> rows = {{Device::cpu(), DType::F32}, {Device::cpu(), DType::F64}};
  if (runtime().has_device(Device::cuda(0)))
    for (DType dt : {DType::F32, DType::BF16}) rows.push_back({Device::cuda(0), dt});
  const int64_t hq = 4, hkv = 2, d = 16, bs = 4, blocks = 12;
  const std::vector<int64_t> len = {13, 10, 5}, news = {1, 4, 5};
  for (const auto& [device, dtype] : rows) {
    std::mt19937_64 rng{7};
    ExecContext ctx = runtime().context(device);
    const auto host_of = [&](const Tensor& t) { return runtime().copy_to(cast(ctx, t, DType::F64), Device::cpu()); };
    std::vector<double> cache_k(size_t(blocks * bs * hkv * d), 0.0), cache_v = cache_k;
    std::vector<int32_t> order(static_cast<size_t>(blocks));
    std::iota(order.begin(), order.end(), 0);
    std::shuffle(order.begin(), order.end(), rng);
    std::vector<int32_t> table(len.size() * 4, 0), cu_q = {0}, ctx_lens;
    size_t next_block = 0;
    std::vector<Tensor> refs;
    std::vector<Tensor> queries;
    for (size_t b = 0; b < len.size(); ++b) {
      const Tensor q = random_tensor(rng, {len[b], hq, d}, dtype, device);
      const Tensor k = random_tensor(rng, {len[b], hkv, d}, dtype, device);
      const Tensor v = random_tensor(rng, {len[b], hkv, d}, dtype, device);
      const std::vector<int32_t> cu = {0, int32_t(len[b])};
      const Tensor o = attention(ctx, q, k, v, runtime().from_host(cu.data(), {2}, DType::I32, device), {})[0];
      refs.push_back(host_of(o.narrow(0, len[b] - news[b], news[b])));
      queries.push_back(q.narrow(0, len[b] - news[b], news[b]));
      const Tensor hk = host_of(k), hv = host_of(v);
      for (int64_t j = 0; j < len[b]; ++j) {
        if (j % bs == 0) table[b * 4 + size_t(j / bs)] = order[next_block++];
        const int64_t row = int64_t(table[b * 4 + size_t(j / bs)]) * bs + j % bs;
        for (int64_t e = 0; e < hkv * d; ++e) {
          cache_k[size_t(row * hkv * d + e)] = hk.data<double>()[j * hkv * d + e];
          cache_v[size_t(row * hkv * d + e)] = hv.data<double>()[j * hkv * d + e];
        }
      }
      cu_q.push_back(cu_q.back() + int32_t(news[b]));
      ctx_lens.push_back(int32_t(len[b]));
    }
    const auto upload = [&](const std::vector<double>& x) {
      return cast(ctx, runtime().from_host(x.data(), {blocks * bs, hkv, d}, DType::F64, device), dtype);
    };
    Tensor q_all = Tensor::empty({cu_q.back(), hq, d}, dtype, ctx.allocator);
    for (size_t b = 0; b < len.size(); ++b) copy_into(ctx, queries[b], q_all.narrow(0, cu_q[b], news[b]));
    const Tensor o = paged_attention(
        ctx, q_all, upload(cache_k), upload(cache_v),
        runtime().from_host(table.data(), {int64_t(len.size()), 4}, DType::I32, device),
        runtime().from_host(cu_q.data(), {int64_t(cu_q.size())}, DType::I32, device),
        runtime().from_host(ctx_lens.data(), {int64_t(ctx_lens.size())}, DType::I32, device), {0.0, bs});
    const Tensor got = host_of(o);
    const double tol = dtype == DType::F64 ? 1e-12 : dtype == DType::F32 ? 1e-5 : 2e-2;
    for (size_t b = 0; b < len.size(); ++b)
      for (int64_t x = 0; x < refs[b].numel(); ++x)
        ASSERT_NEAR(got.data<double>()[cu_q[b] * hq * d + x], refs[b].data<double>()[x], tol)
            << device.str() << " " << dtype_name(dtype) << " sequence " << b << " element " << x;
  }
}

// The distribution transformers' logits processors leave, in their order (temperature, top-k, top-p, min-p): top-k
// masks z below the k-th largest; top-p sorts ascending and masks the ids whose cumulative probability is at most
// 1 - p (never the last); min-p masks the probabilities below m x the largest. Ids at or past `limit` never count.
std::vector<double> processed_distribution(const std::vector<double>& x, int64_t limit, double t, double min_p,
                                           int64_t top_k, double top_p) {
  std::vector<double> z(x.size(), -INFINITY);
  for (int64_t j = 0; j < limit; ++j)
    if (std::isfinite(x[size_t(j)])) z[size_t(j)] = x[size_t(j)] / t;
  const auto softmax = [](const std::vector<double>& a) {
    const double top = *std::max_element(a.begin(), a.end());
    std::vector<double> p(a.size());
    double sum = 0;
    for (size_t j = 0; j < a.size(); ++j) sum += (p[j] = std::exp(a[j] - top));
    for (double& q : p) q /= sum;
    return p;
  };
  if (top_k > 0) {
    std::vector<double> sorted = z;
    std::sort(sorted.begin(), sorted.end(), std::greater<>());
    const double kth = sorted[size_t(std::min<int64_t>(top_k, int64_t(z.size())) - 1)];
    for (double& a : z)
      if (a < kth) a = -INFINITY;
  }
  if (top_p < 1) {
    const std::vector<double> p = softmax(z);
    std::vector<size_t> order(z.size());
    std::iota(order.begin(), order.end(), size_t(0));
    std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) { return z[a] < z[b]; });
    double cum = 0;
    for (size_t r = 0; r + 1 < order.size(); ++r)
      if ((cum += p[order[r]]) <= 1 - top_p) z[order[r]] = -INFINITY;
  }
  if (min_p > 0) {
    const std::vector<double> p = softmax(z);
    const double top = *std::max_element(p.begin(), p.end());
    for (size_t j = 0; j < z.size(); ++j)
      if (p[j] < min_p * top) z[j] = -INFINITY;
  }
  return softmax(z);
}

// penalize_rows against transformers' repetition penalty (x / p above zero, x * p otherwise) and vLLM's frequency
// penalty (f times the generated count), values worked out by hand: a seen id, a generated one, a banned one, an
// untouched one, and a draw from the same row with the penalties off.
TEST(PenalizeRows, AppliesTheRepetitionAndFrequencyPenaltiesAndBans) {
  const std::vector<double> x = {2.0, -1.0, 0.5, 3.0, 0.0};
  const std::vector<int32_t> rows = {0, 0}, entries = {0, 0, 0, 0, 1, 2, 0, 3, -1, 0, 4, 1, 1, 0, 3};
  const std::vector<double> params = {2.0, 0.25, 1.0, 0.0};
  const double inf = std::numeric_limits<double>::infinity();
  const std::vector<double> want = {1.0, -2.5, 0.5, -inf, -0.25, 2.0, -1.0, 0.5, 3.0, 0.0};
  std::vector<std::pair<Device, DType>> cells = {{Device::cpu(), DType::F64}, {Device::cpu(), DType::F32}};
  if (runtime().has_device(Device::cuda(0))) cells.push_back({Device::cuda(0), DType::F32});
  for (const auto& [device, dtype] : cells) {
    ExecContext ctx = runtime().context(device);
    const DType st = dtype == DType::F64 ? DType::F64 : DType::F32;
    const Tensor y = penalize_rows(
        ctx, cast(ctx, runtime().from_host(x.data(), {1, 5}, DType::F64, device), dtype),
        runtime().from_host(rows.data(), {2}, DType::I32, device),
        cast(ctx, runtime().from_host(params.data(), {2, 2}, DType::F64, device), st),
        runtime().from_host(entries.data(), {5, 3}, DType::I32, device));
    ASSERT_EQ(y.shape(), (Shape{2, 5}));
    const Tensor h = runtime().copy_to(cast(ctx, y, DType::F64), Device::cpu());
    for (size_t j = 0; j < want.size(); ++j) EXPECT_EQ(h.data<double>()[j], want[j]) << device.str() << " " << j;
  }
}

// sample_rows against the distribution it is meant to draw from, computed here by transformers' definitions
// (processed_distribution): 20,000 draws from one row (counters 0..19,999 of one key) in each of five settings —
// temperature 0.7 with min-p 0.25 (two ids kept), temperature 1.3 alone (every finite id below the limit), top-k 3,
// top-p 0.8, and top-k 3 with top-p 0.9 and min-p 0.01 — give each id's frequency within 5 standard errors of its
// probability, never an id outside the kept set, and each draw's logprob equal to the log of its id's probability and
// its logit to x[id]. On the CPU (f64, f32) and CUDA (f32) where a GPU exists, whose tokens equal the CPU's draw for
// draw (the same variates, backend/sample_hash.h). Interleaving the draws with draws from another row changes none
// of them.
TEST(SampleRows, DrawsFromTheTemperedMinPDistributionWhateverElseIsDrawn) {
  const std::vector<double> x = {0.25, 2.5, -INFINITY, 0.375, 2.375, 9.0};  // id 5 lies beyond the limit
  const int64_t v = 6, limit = 5, n = 20000;
  struct Setting {
    double t, min_p;
    int64_t top_k;
    double top_p;
    int kept;  // ids left, worked out by hand
  };
  for (const Setting s : {Setting{0.7, 0.25, 0, 1, 2}, Setting{1.3, 0.0, 0, 1, 4}, Setting{1.0, 0.0, 3, 1, 3},
                          Setting{0.9, 0.0, 0, 0.8, 2}, Setting{1.1, 0.01, 3, 0.9, 2}}) {
    // The kept ids and their probabilities, from transformers' definitions.
    const std::vector<double> p = processed_distribution(x, limit, s.t, s.min_p, s.top_k, s.top_p);
    ASSERT_EQ(std::count_if(p.begin(), p.end(), [](double q) { return q > 0; }), s.kept)
        << "t " << s.t << " top-k " << s.top_k << " top-p " << s.top_p;
    std::vector<std::pair<Device, DType>> rows = {{Device::cpu(), DType::F64}, {Device::cpu(), DType::F32}};
    if (runtime().has_device(Device::cuda(0))) rows.push_back({Device::cuda(0), DType::F32});
    std::vector<int32_t> cpu_f32_tokens;
    for (const auto& [device, dtype] : rows) {
      ExecContext ctx = runtime().context(device);
      // Two rows: draw 2i from row 0 (counter i), draw 2i + 1 from row 1 (a shuffled copy, another key).
      std::vector<double> two = x;
      for (int64_t j = 0; j < v; ++j) two.push_back(x[size_t((j + 3) % v)]);
      std::vector<int32_t> which, keys;
      std::vector<double> params;
      for (int64_t i = 0; i < 2 * n; ++i) {
        which.push_back(int32_t(i % 2));
        keys.insert(keys.end(), {int32_t(i % 2 ? 99 : 7), 0, int32_t(i / 2)});
        params.insert(params.end(), {s.t, s.min_p, double(s.top_k), s.top_p});
      }
      const DType st = dtype == DType::F64 ? DType::F64 : DType::F32;
      const auto up = [&](const std::vector<double>& h, Shape shape, DType dt) {
        return cast(ctx, runtime().from_host(h.data(), std::move(shape), DType::F64, device), dt);
      };
      const std::vector<Tensor> out =
          sample_rows(ctx, up(two, {2, v}, dtype), runtime().from_host(which.data(), {2 * n}, DType::I32, device),
                      up(params, {2 * n, 4}, st), runtime().from_host(keys.data(), {2 * n, 3}, DType::I32, device), limit);
      const Tensor tok = runtime().copy_to(out[0], Device::cpu());
      const Tensor logit = runtime().copy_to(cast(ctx, out[1], DType::F64), Device::cpu());
      const Tensor logprob = runtime().copy_to(cast(ctx, out[2], DType::F64), Device::cpu());
      // The same draws from row 0 alone.
      std::vector<int32_t> alone_rows(size_t(n), 0), alone_keys;
      std::vector<double> alone_params;
      for (int64_t i = 0; i < n; ++i) {
        alone_keys.insert(alone_keys.end(), {7, 0, int32_t(i)});
        alone_params.insert(alone_params.end(), {s.t, s.min_p, double(s.top_k), s.top_p});
      }
      const Tensor alone = runtime().copy_to(
          sample_rows(ctx, up(x, {1, v}, dtype), runtime().from_host(alone_rows.data(), {n}, DType::I32, device),
                      up(alone_params, {n, 4}, st), runtime().from_host(alone_keys.data(), {n, 3}, DType::I32, device),
                      limit)[0],
          Device::cpu());
      std::vector<int64_t> count(size_t(v), 0);
      const double tol = dtype == DType::F64 ? 1e-12 : 1e-5;
      for (int64_t i = 0; i < n; ++i) {
        const int32_t id = tok.data<int32_t>()[2 * i];
        ASSERT_TRUE(id >= 0 && id < v && p[size_t(id)] > 0) << device.str() << " draw " << i << " gave id " << id;
        ASSERT_EQ(alone.data<int32_t>()[i], id) << device.str() << " draw " << i << " depends on the other row's";
        ++count[size_t(id)];
        ASSERT_NEAR(logprob.data<double>()[2 * i], std::log(p[size_t(id)]), tol);
        ASSERT_EQ(logit.data<double>()[2 * i], x[size_t(id)]);
      }
      for (int64_t j = 0; j < v; ++j) {
        const double freq = double(count[size_t(j)]) / double(n), se = std::sqrt(p[size_t(j)] * (1 - p[size_t(j)]) / n);
        EXPECT_NEAR(freq, p[size_t(j)], 5 * se + 1e-12) << device.str() << " id " << j << " t " << s.t;
      }
      std::vector<int32_t> tokens(tok.data<int32_t>(), tok.data<int32_t>() + 2 * n);
      if (device.is_cpu() && dtype == DType::F32) cpu_f32_tokens = tokens;
      if (!device.is_cpu()) EXPECT_EQ(tokens, cpu_f32_tokens) << "CUDA draws differ from the CPU's";
    }
  }
}
