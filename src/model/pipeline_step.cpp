// The pipeline's driver (pipeline_step.h).
#include "model/pipeline_step.h"

#include <map>
#include <memory>
#include <tuple>
#include <utility>

#include "comm/communicator.h"
#include "ops/ops.h"

namespace lathe {

namespace {

// The doubles of a host vector on the model's device (for the pipeline group's data plane) and back.
Tensor device_values(Runtime& rt, Device device, const std::vector<double>& v) {
  return rt.from_host(v.data(), {int64_t(v.size())}, DType::F64, device);
}

std::vector<double> host_values(Runtime& rt, const Tensor& t) {
  const Tensor h = t.device().is_cpu() ? t : rt.copy_to(t, Device::cpu());
  return std::vector<double>(h.data<double>(), h.data<double>() + h.numel());
}

// The schedule's ticks on this rank (pipeline_step.h): the last stage's losses, or with StageHead::LabelLogprobs its
// log-probabilities into *logprobs, with StageHead::LastLogits its logits into *logits.
std::vector<LossResult> run_stages(CausalLm& m, const std::vector<PackedBatch>& micro, StageHead head,
                                   double loss_scale, std::vector<std::vector<double>>* logprobs,
                                   std::vector<Tensor>* logits = nullptr) {
  const bool backward = head == StageHead::Train;
  const ModelOptions& o = m.options();
  LATHE_CHECK(o.pp && o.pp->size() > 1, "pipeline: the model was built without a pipeline group (ModelOptions::pp)");
  Runtime& rt = m.runtime();
  Communicator& pp = *o.pp;
  const PipelineLayout& pl = o.pipeline;
  const int me = pp.rank(), stages = pl.stages();
  const int64_t n = int64_t(micro.size());
  const PipelineTimeline tl = pipeline_timeline(pl, n, !backward);
  const std::vector<PipeAction>& order = tl.orders[size_t(me)];
  const bool moe = m.routing_totals_size(stages) > 0;
  const bool aux = m.pipeline_sends_aux(backward);  // the aux derivative travels back with the gradients
  const int64_t hidden = m.config().hidden_size;
  ExecContext cx = rt.context(o.device);

  using Key = std::pair<int, int>;  // (virtual stage, micro-batch)
  std::map<Key, std::shared_ptr<StageWork>> works;
  std::map<Key, Tensor> stream_in, totals_in, grad_in, aux_in;  // received, for the stage's own action
  std::map<std::tuple<int, int, int>, std::vector<Tensor>> outbox;  // (op, receiving stage, micro) -> tensors to send
  std::vector<LossResult> losses(static_cast<size_t>(n));
  std::vector<Tensor> last_aux(static_cast<size_t>(n));  // the last stage's aux derivative of each micro-batch

  for (const PipeTick& tick : tl.ticks) {
    if (const int index = tick.action[size_t(me)]; index >= 0) {
      const PipeAction a = order[size_t(index)];
      const int v = pl.stage(me, a.chunk);
      const Key key{v, a.micro};
      const PackedBatch& b = micro[size_t(a.micro)];
      if (a.op == PipeOp::Forward) {
        std::shared_ptr<StageWork> w = m.stage_forward(v, b, v > 0 ? stream_in.at(key) : Tensor(), head, loss_scale);
        stream_in.erase(key);
        std::vector<double> totals;  // every sparse layer's so far, in layer order
        if (moe) {
          if (v > 0 && totals_in.count(key)) totals = host_values(rt, totals_in.at(key));
          const std::vector<double> mine = m.stage_routing_totals(*w);
          totals.insert(totals.end(), mine.begin(), mine.end());
        }
        totals_in.erase(key);
        if (v + 1 < stages) {
          std::vector<Tensor> out = {w->out};
          if (!totals.empty()) out.push_back(device_values(rt, o.device, totals));
          outbox[{int(PipeOp::Forward), v + 1, a.micro}] = std::move(out);
          w->out = Tensor();
        } else if (head == StageHead::LabelLogprobs) {
          (*logprobs)[size_t(a.micro)] = std::move(w->logprobs);
        } else if (head == StageHead::LastLogits) {
          (*logits)[size_t(a.micro)] = std::move(w->logits);
        } else {
          losses[size_t(a.micro)] = w->loss;
          if (moe)
            last_aux[size_t(a.micro)] = m.aux_from_pipeline(losses[size_t(a.micro)], totals, backward, loss_scale);
        }
        if (backward) works[key] = std::move(w);
      } else {
        std::shared_ptr<StageWork> w = works.at(key);
        works.erase(key);
        const Tensor dout = v + 1 < stages ? grad_in.at(key) : Tensor();
        const Tensor d_aux = v + 1 < stages ? (aux ? aux_in.at(key) : Tensor()) : last_aux[size_t(a.micro)];
        grad_in.erase(key);
        aux_in.erase(key);
        const Tensor dx = m.stage_backward(*w, dout, b, d_aux);
        if (v > 0) {
          std::vector<Tensor> out = {dx};
          if (aux) out.push_back(d_aux);
          outbox[{int(PipeOp::Backward), v - 1, a.micro}] = std::move(out);
        }
      }
    }
    // The tick's exchange: what this tick's actions made goes out, what the neighbours' made comes in.
    std::vector<std::pair<Tensor, int>> sends, recvs;
    for (const PipeMessage& msg : tick.messages) {
      const std::tuple<int, int, int> id{int(msg.op), msg.stage, msg.micro};
      if (msg.from == me) {
        for (const Tensor& t : outbox.at(id)) sends.emplace_back(t, msg.to);
        outbox.erase(id);
      }
      if (msg.to != me) continue;
      const Key key{msg.stage, msg.micro};
      const int64_t rows = m.stream_rows(micro[size_t(msg.micro)]);
      if (msg.op == PipeOp::Forward) {
        stream_in[key] = Tensor::empty({2, rows, hidden}, o.dtype, cx.allocator);
        recvs.emplace_back(stream_in[key], msg.from);
        if (const int64_t size = moe ? m.routing_totals_size(msg.stage) : 0; size > 0) {
          totals_in[key] = Tensor::empty({size}, DType::F64, cx.allocator);
          recvs.emplace_back(totals_in[key], msg.from);
        }
      } else {
        grad_in[key] = Tensor::empty({rows, hidden}, o.dtype, cx.allocator);
        recvs.emplace_back(grad_in[key], msg.from);
        if (aux) {
          aux_in[key] = Tensor::empty({1, m.global_config().num_experts}, m.aux_dtype(), cx.allocator);
          recvs.emplace_back(aux_in[key], msg.from);
        }
      }
    }
    // Not waited for on the host: on CUDA the exchange is ordered on the compute stream (the next tick's kernels queue
    // behind it, and a sent tensor's block is reused only by later work of that stream), so the host queues the next
    // tick while this one runs; the communicator's watchdog bounds it (parallel.timeout_s). On the CPU it is done on
    // return.
    if (!sends.empty() || !recvs.empty()) pp.exchange(sends, recvs);
  }
  LATHE_ASSERT(works.empty() && outbox.empty());
  return losses;
}

}  // namespace

std::vector<LossResult> run_pipeline(CausalLm& m, const std::vector<PackedBatch>& micro, bool backward,
                                     double loss_scale) {
  return run_stages(m, micro, backward ? StageHead::Train : StageHead::Loss, loss_scale, nullptr);
}

std::vector<std::vector<double>> pipeline_label_logprobs(CausalLm& m, const std::vector<PackedBatch>& batches) {
  std::vector<std::vector<double>> lp(batches.size());
  run_stages(m, batches, StageHead::LabelLogprobs, 1.0, &lp);
  Communicator& pp = *m.options().pp;
  std::vector<double> flat;  // every batch's, one value a token
  size_t total = 0;
  for (const PackedBatch& b : batches) total += size_t(b.tokens());
  if (pp.rank() == pp.size() - 1)
    for (const std::vector<double>& v : lp) flat.insert(flat.end(), v.begin(), v.end());
  from_last_stage(m, flat, total);
  size_t at = 0;
  for (size_t k = 0; k < batches.size(); ++k) {
    lp[k].assign(flat.begin() + std::ptrdiff_t(at), flat.begin() + std::ptrdiff_t(at + size_t(batches[k].tokens())));
    at += size_t(batches[k].tokens());
  }
  return lp;
}

Tensor pipeline_last_logits(CausalLm& m, const PackedBatch& b) {
  std::vector<Tensor> logits(1);
  run_stages(m, {b}, StageHead::LastLogits, 1.0, nullptr, &logits);
  Communicator& pp = *m.options().pp;
  if (pp.rank() + 1 < pp.size()) {
    ExecContext cx = m.runtime().context(m.options().device);
    logits[0] = Tensor::empty({int64_t(b.host_cu.size()) - 1, m.global_config().vocab_size}, m.options().dtype,
                              cx.allocator);
  }
  pp.broadcast(logits[0], pp.size() - 1).wait();
  return logits[0];
}

void from_last_stage(CausalLm& m, std::vector<double>& v, size_t n) {
  Communicator& pp = *m.options().pp;
  v.resize(n, 0.0);
  if (n == 0) return;
  Tensor t = device_values(m.runtime(), m.options().device, v);
  pp.broadcast(t, pp.size() - 1).wait();
  v = host_values(m.runtime(), t);
}

void broadcast_losses(CausalLm& m, std::vector<LossResult>& losses) {
  Communicator& pp = *m.options().pp;
  Runtime& rt = m.runtime();
  const Device device = m.options().device;
  std::vector<double> flat;  // per micro-batch: loss sum, labelled, aux loss, segments, then the loads
  if (pp.rank() == pp.size() - 1)
    for (const LossResult& r : losses) {
      flat.insert(flat.end(), {r.loss_sum, double(r.labelled), r.aux_loss, double(r.segments.size())});
      for (const LossResult::Segment& s : r.segments) flat.insert(flat.end(), {s.loss_sum, double(s.labelled)});
      flat.push_back(double(r.expert_load.size()));
      for (const ExpertLoadStat& e : r.expert_load) {
        flat.insert(flat.end(), {double(e.layer), e.max_over_mean, double(e.tokens_per_expert.size())});
        flat.insert(flat.end(), e.tokens_per_expert.begin(), e.tokens_per_expert.end());
      }
    }
  Tensor size = device_values(rt, device, {double(flat.size())});
  pp.broadcast(size, pp.size() - 1).wait();
  flat.resize(size_t(host_values(rt, size)[0]));
  Tensor values = device_values(rt, device, flat);
  pp.broadcast(values, pp.size() - 1).wait();
  flat = host_values(rt, values);
  const double* v = flat.data();
  for (LossResult& r : losses) {
    r = LossResult{};
    r.loss_sum = *v++;
    r.labelled = int64_t(*v++);
    r.loss = r.labelled > 0 ? r.loss_sum / double(r.labelled) : 0.0;
    r.aux_loss = *v++;
    r.segments.resize(size_t(*v++));
    for (LossResult::Segment& s : r.segments) {
      s.loss_sum = *v++;
      s.labelled = int64_t(*v++);
    }
    r.expert_load.resize(size_t(*v++));
    for (ExpertLoadStat& e : r.expert_load) {
      e.layer = int64_t(*v++);
      e.max_over_mean = *v++;
      e.tokens_per_expert.resize(size_t(*v++));
      for (int64_t& t : e.tokens_per_expert) t = int64_t(*v++);
    }
  }
}

void sum_tied_embedding_grads(CausalLm& m) {
  const ModelOptions& o = m.options();
  if (!o.pp || o.pp->size() == 1 || !m.global_config().tie_word_embeddings) return;
  if (!m.holds_embedding() && !m.holds_head()) return;
  Parameter* embed = m.embedding_parameter();
  LATHE_CHECK(embed, "pipeline: the first or last stage holds no embed_tokens.weight to tie");
  ExecContext cx = m.runtime().context(o.device);
  Tensor mine = embed->grad.defined() ? contiguous(cx, embed->grad)
                                       : Tensor::empty(embed->value.shape(), embed->value.dtype(), cx.allocator);
  if (!embed->grad.defined()) cx.backend.fill_bytes(mine.data_ptr(), 0, mine.nbytes(), cx.stream);  // no labelled row
  Tensor theirs = Tensor::empty(mine.shape(), mine.dtype(), cx.allocator);
  const int peer = m.holds_embedding() ? o.pp->size() - 1 : 0;
  o.pp->exchange({{mine, peer}}, {{theirs, peer}}).wait();
  embed->grad = m.holds_embedding() ? add(cx, mine, theirs) : add(cx, theirs, mine);
}

}  // namespace lathe
