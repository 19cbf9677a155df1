// The decoder-stack driver both families share: embedding, the layers in order, the final RMSNorm and the LM head
// (logits, label log-probs, the loss head of CausalLm), and the backward through the layers in reverse, recomputing a
// layer's activations from its input where options.recomputes(its index). A family M (Qwen3Model, Qwen35Model) befriends
// DecoderStack and provides Layer, LayerActs (with .out, a ResidualStream), layers_, layer_forward(l, x, b, training),
// layer_backward(l, acts, dout, b), embed_, final_norm_, head() and kFinalNormOffset (0: w, 1: zero-centred 1 + w).
// Included only by the families' .cpp files, where LayerActs is complete. Covered by tests/models (both families).
#pragma once

#include <cctype>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "model/causal_lm.h"
#include "ops/ops.h"

namespace lathe {

struct DecoderStack {
  template <typename M>
  static NormAttrs final_norm(const M& m) {
    return {m.config_.rms_norm_eps, M::kFinalNormOffset};
  }

  // The last layer's output (T, H), as the residual stream's last two terms. With `acts` given (a training forward),
  // `acts` and `inputs` receive an entry a layer: a layer that recomputes in the backward (ModelOptions::recomputes)
  // leaves its LayerActs empty and gives its input (its sum, LayerActs::x), any other its activations and an empty
  // input; `kept` (if given) a slot a layer, where a recomputing layer's attention outputs or Gated DeltaNet rule
  // results are kept (recompute_keeps_attention, recompute_keeps_gdn).
  template <typename M>
  static ResidualStream hidden(M& m, const PackedBatch& b, std::vector<typename M::LayerActs>* acts,
                               std::vector<ResidualStream>* inputs, bool training,
                               std::vector<KeptAttention>* kept = nullptr) {
    m.begin_forward(b);
    struct End {  // what the model kept for this forward of a decoding batch goes with it, also on an error
      M& m;
      ~End() { m.end_forward(); }
    } end{m};
    ResidualStream x{m.embed(m.embed_, b.ids), {}};  // vocab-parallel under tp: summed over the group
    return forward_layers(m, 0, m.layers_.size(), x, b, training, acts, inputs, kept);
  }

  // Points m.kept_attention_ at one layer's slot while the layer runs (and at nothing after, also on an error).
  template <typename M>
  struct KeepingAttention {
    M& m;
    KeepingAttention(M& model, KeptAttention* slot) : m(model) { m.kept_attention_ = slot; }
    ~KeepingAttention() { m.kept_attention_ = nullptr; }
    KeepingAttention(const KeepingAttention&) = delete;
    KeepingAttention& operator=(const KeepingAttention&) = delete;
  };

  // Whether a training forward keeps attention outputs (or Gated DeltaNet rule results) for its backward's recompute.
  template <typename M>
  static bool keeps_attention(const M& m, bool backward) {
    return backward && m.options_.recompute && (m.options_.recompute_keeps_attention || m.options_.recompute_keeps_gdn);
  }

  // The layers m.layers_[begin, end) over the stream x (the whole stack, or a pipeline stage's), returning the last
  // one's output. With `acts` (a training forward; then `inputs` too) an entry a layer in both: a layer that
  // recomputes in the backward gives its input (its sum, LayerActs::x) and an empty LayerActs, any other its
  // activations and an empty input; `kept` (where given) a slot a layer, filled by the recomputing layers only.
  template <typename M>
  static ResidualStream forward_layers(M& m, size_t begin, size_t end, ResidualStream x, const PackedBatch& b,
                                       bool training, std::vector<typename M::LayerActs>* acts,
                                       std::vector<ResidualStream>* inputs, std::vector<KeptAttention>* kept) {
    for (size_t k = begin; k < end; ++k) {
      const bool recomputes = acts && m.options_.recomputes(m.layers_[k].index);
      if (kept) kept->emplace_back();
      const KeepingAttention<M> keeping(m, kept && recomputes ? &kept->back() : nullptr);
      typename M::LayerActs a = m.layer_forward(m.layers_[k], x, b, training);
      x = a.out;
      if (!acts) continue;
      inputs->push_back(recomputes ? ResidualStream{a.x, {}} : ResidualStream{});
      acts->push_back(recomputes ? typename M::LayerActs{} : std::move(a));
    }
    return x;
  }

  // The backward through m.layers_[begin, end), the last first, from d(their output) dx, with what forward_layers
  // kept (an entry a layer from `begin` in `acts` and `inputs`, `kept` empty or a slot a layer): a layer's activations
  // moved out of `acts`, or recomputed from its input in `inputs` (its attention outputs taken from `kept`, if the
  // forward kept them); `done(k)` after the layer at position k. Returns d(the input of layer `begin`).
  template <typename M>
  static Tensor backward_layers(M& m, size_t begin, size_t end, std::vector<typename M::LayerActs>& acts,
                                std::vector<ResidualStream>& inputs, std::vector<KeptAttention>& kept, Tensor dx,
                                const PackedBatch& b, const std::function<void(int64_t)>& done) {
    LATHE_CHECK(acts.size() == end - begin && inputs.size() == end - begin && (kept.empty() || kept.size() == acts.size()),
                "model: the backward got {} layers' activations and {} inputs for {} layers", acts.size(),
                inputs.size(), end - begin);
    for (size_t k = end; k-- > begin;) {
      const auto& l = m.layers_[k];
      const auto recomputed = [&] {
        const KeepingAttention<M> keeping(m, kept.empty() ? nullptr : &kept[k - begin]);
        return m.layer_forward(l, inputs[k - begin], b, true);
      };
      const typename M::LayerActs a = m.options_.recomputes(l.index) ? recomputed() : std::move(acts[k - begin]);
      acts.pop_back();  // this layer's entries, spent (the activations moved out, or empty)
      inputs.pop_back();
      if (!kept.empty()) kept.pop_back();
      dx = m.layer_backward(l, a, dx, b);
      if (done) done(int64_t(k));
    }
    return dx;
  }

  template <typename M>
  static Tensor logits(M& m, const PackedBatch& b) {
    ExecContext cx = m.ctx();
    const ResidualStream x = hidden(m, b, nullptr, nullptr, false);
    const Tensor xf = m.head_input(m.norm_stream(x, m.w(m.final_norm_), final_norm(m)).first, b);
    return m.lm_head(m.head()).whole_logits(cx, xf);
  }

  template <typename M>
  static Tensor last_hidden(M& m, const PackedBatch& b) {
    const ResidualStream x = hidden(m, b, nullptr, nullptr, false);
    return last_rows(m, m.head_input(m.norm_stream(x, m.w(m.final_norm_), final_norm(m)).first, b), b);
  }

  // The rows of the final norm's output xf (every row of the batch) at each document's last token.
  template <typename M>
  static Tensor last_rows(M& m, const Tensor& xf, const PackedBatch& b) {
    ExecContext cx = m.ctx();
    const int64_t docs = int64_t(b.host_cu.size()) - 1;
    if (xf.size(0) == docs) return xf;  // one token a document: every row is a last one
    if (docs == 1) return xf.narrow(0, xf.size(0) - 1, 1);
    std::vector<int32_t> last;  // each document's last row, gathered as embedding rows
    for (size_t i = 1; i < b.host_cu.size(); ++i) last.push_back(b.host_cu[i] - 1);
    const Tensor rows = b.cache ? b.cache->table("last_rows", last)
                                : m.rt_->upload(last.data(), {int64_t(last.size())}, DType::I32, m.options_.device);
    return embedding(cx, xf, rows);
  }

  template <typename M>
  static Tensor lm_head_logits(M& m, const Tensor& x) {
    ExecContext cx = m.ctx();
    return m.lm_head(m.head()).whole_logits(cx, x);  // under tp the rows' pieces gathered: decoding's few rows
  }

  template <typename M>
  static std::vector<double> label_logprobs(M& m, const PackedBatch& b) {
    const Tensor xf = m.norm_stream(hidden(m, b, nullptr, nullptr, false), m.w(m.final_norm_), final_norm(m)).first;
    return m.head_label_logprobs(m.block_input(xf, m.block_tokens(b)), m.head(), b);  // the rank's rows under cp
  }

  template <typename M>
  static LossResult loss(M& m, const PackedBatch& b, bool backward, double loss_scale, const BackwardHooks& hooks) {
    ExecContext cx = m.ctx();
    std::vector<typename M::LayerActs> acts;
    std::vector<ResidualStream> inputs;
    std::vector<KeptAttention> kept;
    const NormAttrs norm = final_norm(m);
    const ResidualStream out = hidden(m, b, backward ? &acts : nullptr, backward ? &inputs : nullptr, backward,
                                      keeps_attention(m, backward) ? &kept : nullptr);
    const auto [xf, x_last] = m.norm_stream(out, m.w(m.final_norm_), norm);  // the stream's rows under sp
    Tensor dxf;
    std::vector<std::pair<size_t, Tensor>> losses;  // read once the backward is queued too
    // The head on the rows the stack ran on (under cp the rank's; gathered over tp under sp): CausalLm::head_rows.
    LossResult result =
        m.head_loss(m.block_input(xf, m.block_tokens(b)), m.head(), b, backward, loss_scale, &dxf, losses);
    m.moe_after_forward(result, backward, loss_scale);  // MoE models: aux loss, expert loads, the aux gradient
    if (!backward) {
      m.add_head_losses(result, b, losses);
      m.moe_read_routing(result);
      return result;
    }
    // Under sp the head's input gradient is each tp rank's part (its vocabulary columns'), reduce-scattered to the
    // rows (one collective of the rows' size, where an all-reduce and a cut moved twice that).
    const Tensor dxf_rows = m.sequence_parallel() ? m.block_output(dxf) : dxf;
    const std::vector<Tensor> dfinal = rmsnorm_backward(cx, x_last, m.w(m.final_norm_), dxf_rows, norm);
    m.add_norm_grad(m.final_norm_, dfinal[1]);
    const auto done = [&](int64_t layers_left) {
      if (hooks.grads_done) hooks.grads_done(layers_left);
    };
    done(int64_t(m.layers_.size()));
    const Tensor dx = backward_layers(m, 0, m.layers_.size(), acts, inputs, kept, dfinal[0], b, done);
    m.end_backward(m.embed_, dx, b);
    done(-1);
    if (hooks.queued) hooks.queued();
    m.add_head_losses(result, b, losses);
    m.moe_read_routing(result);  // the routing's figures and its non-finite check, left on the device for this read
    return result;
  }

  // CausalLm::grads_complete_after: a layer's parameters are named "...layers.N." (N its index), so they are complete
  // after layer N's backward; the head and the final norm before the first layer's; the rest at the end.
  template <typename M>
  static std::vector<int64_t> grads_complete_after(const M& m) {
    std::vector<int64_t> after(m.params_.size(), -1);
    for (size_t i = 0; i < m.params_.size(); ++i) {
      const std::string& name = m.params_[i].name;
      const size_t at = name.find("layers.");
      if (at == std::string::npos || (at > 0 && name[at - 1] != '.')) continue;
      size_t end = at + 7;
      int64_t layer = 0;
      while (end < name.size() && std::isdigit(static_cast<unsigned char>(name[end])))
        layer = layer * 10 + (name[end++] - '0');
      if (end > at + 7 && end < name.size() && name[end] == '.' && layer < int64_t(m.layers_.size()))
        after[i] = layer;
    }
    if (m.final_norm_ >= 0) after[size_t(m.final_norm_)] = int64_t(m.layers_.size());
    if (m.head() >= 0 && m.head() != m.embed_) after[size_t(m.head())] = int64_t(m.layers_.size());
    if (m.embed_ >= 0) after[size_t(m.embed_)] = -1;
    return after;
  }

  // Pipeline parallelism (CausalLm::stage_forward / stage_backward): one micro-batch on one virtual stage. What the
  // forward keeps: the layers' activations (or, under recompute, their inputs and any kept attention outputs), and on
  // the last stage the final norm's input and d(loss)/d(its output).
  template <typename M>
  struct StageActs {
    size_t begin = 0, end = 0;  // the stage's layers: m.layers_[begin, end)
    std::vector<typename M::LayerActs> acts;
    std::vector<ResidualStream> inputs;
    std::vector<KeptAttention> kept;
    Tensor x_last, dxf;
  };

  template <typename M>
  static std::shared_ptr<StageWork> stage_forward(M& m, int stage, const PackedBatch& b, const Tensor& in,
                                                  StageHead head, double loss_scale) {
    const bool backward = head == StageHead::Train;
    const PipelineLayout& pl = m.options_.pipeline;
    LATHE_CHECK(pl.rank_of(stage) == m.pp_rank(), "model: pipeline stage {} is not held by pp rank {}", stage,
                m.pp_rank());
    ExecContext cx = m.ctx();
    auto work = std::make_shared<StageWork>();
    auto sa = std::make_shared<StageActs<M>>();
    work->stage = stage;
    m.begin_forward(b);
    struct End {
      M& m;
      ~End() { m.end_forward(); }
    } end{m};
    ResidualStream x;
    if (stage == 0) {
      x = {m.embed(m.embed_, b.ids), {}};
    } else {
      const int64_t rows = in.size(1);
      x = {in.narrow(0, 0, 1).view({rows, in.size(2)}), in.narrow(0, 1, 1).view({rows, in.size(2)})};
    }
    while (sa->begin < m.layers_.size() && m.layers_[sa->begin].index < pl.first_layer(stage)) ++sa->begin;
    for (sa->end = sa->begin; sa->end < m.layers_.size() && m.layers_[sa->end].index < pl.end_layer(stage);) ++sa->end;
    x = forward_layers(m, sa->begin, sa->end, x, b, backward, backward ? &sa->acts : nullptr,
                       backward ? &sa->inputs : nullptr, keeps_attention(m, backward) ? &sa->kept : nullptr);
    for (size_t k = sa->begin; k < sa->end; ++k) {  // the stage's routing of this micro-batch, for its backward
      const int64_t layer = m.layers_[k].index;
      const MoeRoute& route = m.moe_routes_[size_t(layer)];
      if (route.valid) work->routes.emplace_back(layer, route);
      if (m.global_config_.sparse_layer(layer)) {  // a cp rank without rows of the batch adds zeros
        const size_t e = size_t(m.global_config_.num_experts);
        work->totals.push_back(route.valid ? route.totals
                                           : RoutingTotals{0, std::vector<int64_t>(e, 0), std::vector<double>(e, 0.0)});
      }
    }
    if (stage + 1 < pl.stages()) {  // the stream's two terms, stacked, for the next stage
      const int64_t rows = x.h.size(0), h = x.h.size(1);
      work->out = Tensor::empty({2, rows, h}, x.h.dtype(), cx.allocator);
      copy_into(cx, x.h, work->out.narrow(0, 0, 1).view({rows, h}));
      copy_into(cx, x.r, work->out.narrow(0, 1, 1).view({rows, h}));
    } else {
      const auto [xf, x_last] = m.norm_stream(x, m.w(m.final_norm_), final_norm(m));
      if (head == StageHead::LastLogits) {  // decoding: every row of the batch (no cp while decoding)
        work->logits = m.lm_head_logits(last_rows(m, m.head_input(xf, b), b));
        return work;
      }
      if (head == StageHead::LabelLogprobs) {  // the rank's rows under cp, joined
        work->logprobs = m.head_label_logprobs(m.block_input(xf, m.block_tokens(b)), m.head(), b);
        return work;
      }
      std::vector<std::pair<size_t, Tensor>> losses;
      Tensor dxf;
      work->loss = m.head_loss(m.block_input(xf, m.block_tokens(b)), m.head(), b, backward, loss_scale, &dxf, losses);
      m.add_head_losses(work->loss, b, losses);
      if (backward) {
        sa->x_last = x_last;
        sa->dxf = m.sequence_parallel() ? m.block_output(dxf) : dxf;
      }
    }
    work->acts = sa;
    return work;
  }

  template <typename M>
  static Tensor stage_backward(M& m, StageWork& work, const Tensor& dout, const PackedBatch& b, const Tensor& d_aux) {
    ExecContext cx = m.ctx();
    auto& sa = *static_cast<StageActs<M>*>(work.acts.get());
    for (auto& [layer, route] : work.routes) {  // the stage's routing of this micro-batch (others ran since)
      m.moe_routes_[size_t(layer)] = route;
      m.moe_routes_[size_t(layer)].d_aux = d_aux;
    }
    m.cp_tables_tokens_ = -1;  // context parallelism: this micro-batch's tables, not the last forward's
    Tensor dx = dout;
    if (work.stage + 1 == m.options_.pipeline.stages()) {
      const std::vector<Tensor> dfinal = rmsnorm_backward(cx, sa.x_last, m.w(m.final_norm_), sa.dxf, final_norm(m));
      m.add_norm_grad(m.final_norm_, dfinal[1]);
      dx = dfinal[0];
    }
    dx = backward_layers(m, sa.begin, sa.end, sa.acts, sa.inputs, sa.kept, dx, b, {});
    work.acts.reset();
    if (work.stage > 0) {
      if (m.lora_ && !b.segments.empty()) m.lora_->collect_grads();  // (end_backward's, on the first stage)
      return dx;
    }
    m.end_backward(m.embed_, dx, b);
    return Tensor();
  }
};

}  // namespace lathe
