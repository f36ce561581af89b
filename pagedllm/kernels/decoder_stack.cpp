// A Llama-family model's decoder layers and final norm as one call from Python.
//
// models/decoder.py runs the same layers op by op; there, each of a layer's seven kernels (two
// norms, four linear layers, rotary with the cache write, attention) is reached through a few
// Python frames, checks and tensor views: about 1 ms a step on a 16-layer model, whatever the
// batch, so 8% of a batch-1 decode step on the 250M benchmark model. Here the same kernels run in
// the same order on the same buffers, so the results are bit for bit those of the Python path
// (tests/test_decoder_stack.py), and the GIL is released once for the whole pass.
#include <algorithm>
#include <tuple>
#include <vector>

#include <torch/extension.h>

#include "linear_op.h"
#include "lora.h"

void rms_norm(torch::Tensor out, torch::Tensor x, c10::optional<torch::Tensor> delta, torch::Tensor weight,
              double eps);
void rotary_and_cache(torch::Tensor qkv, torch::Tensor cos, torch::Tensor sin, torch::Tensor k_cache,
                      torch::Tensor v_cache, torch::Tensor slots, int64_t num_heads, double k_scale, double v_scale);
void paged_attention(torch::Tensor out, torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                     torch::Tensor block_tables, torch::Tensor query_start_loc, torch::Tensor seq_lens, double scale,
                     int64_t sliding_window, double k_scale, double v_scale, c10::optional<torch::Tensor> sinks);
void packed_linear_rows(torch::Tensor out, torch::Tensor x, int64_t weight_ptr, int64_t n_padded,
                        int64_t k_padded, c10::optional<torch::Tensor> bias, bool silu_mul);

namespace {

// A bf16 linear layer as layers/linear.py's PackedBF16LinearMethod hands it over: its packed
// weights (held, so that they outlive any swap of the module's), where their buffer is, and how wide.
class PackedLinear : public LinearOp {
 public:
  PackedLinear(torch::Tensor weight, int64_t address, int64_t n_padded, int64_t k_padded, int64_t out_features,
               c10::optional<torch::Tensor> bias, bool silu_mul, int64_t rows_per_call)
      : weight_(std::move(weight)), address_(address), n_padded_(n_padded), k_padded_(k_padded),
        out_features_(out_features), bias_(std::move(bias)), silu_mul_(silu_mul), rows_per_call_(rows_per_call) {}

  int64_t out_features() const override { return silu_mul_ ? out_features_ / 2 : out_features_; }

  torch::Tensor forward(const torch::Tensor& x, const torch::Tensor& given) const override {
    const int64_t rows = x.size(0);
    torch::Tensor out = output(x, given);
    // As Linear._packed_rows: longer batches go in chunks of rows_per_call rows.
    for (int64_t start = 0; start < rows; start += rows_per_call_) {
      const int64_t count = std::min(rows_per_call_, rows - start);
      packed_linear_rows(out.narrow(0, start, count), x.narrow(0, start, count), address_, n_padded_, k_padded_,
                         bias_, silu_mul_);
    }
    return out;
  }

 private:
  torch::Tensor weight_;
  int64_t address_, n_padded_, k_padded_, out_features_;
  c10::optional<torch::Tensor> bias_;
  bool silu_mul_;
  int64_t rows_per_call_;
};

using Linear = std::shared_ptr<LinearOp>;

struct Layer {
  torch::Tensor input_norm, post_attention_norm;
  // gate_up null: the MLP is down alone, one op from the normed rows to the output (a mixture of
  // experts, kernels/moe.cpp).
  Linear qkv, o, gate_up, down;
  c10::optional<torch::Tensor> q_norm, k_norm;  // per-head RMSNorm of q and k before rotary (Qwen3)
  int64_t sliding_window;  // 0: full attention
  double k_scale, v_scale;  // of an fp8 KV cache's values
  c10::optional<torch::Tensor> sinks;  // fp32 [heads]: a logit per head in each softmax's denominator (gpt-oss)
  int64_t group;  // the KV group whose slots and block tables the layer reads (config.KVCacheGroups)
};

}  // namespace

class DecoderStack {
 public:
  // mlp_rows: models/decoder.py's MLP_ROWS, the rows of a long step's MLP chunks; piece_rows: its
  // PIECE_ROWS, the most rows a pass through the layers takes (a longer step goes in pieces).
  DecoderStack(int64_t num_heads, int64_t head_dim, double eps, double scale, torch::Tensor final_norm,
               int64_t mlp_rows, int64_t piece_rows)
      : num_heads_(num_heads), head_dim_(head_dim), eps_(eps), scale_(scale), final_norm_(std::move(final_norm)),
        mlp_rows_(mlp_rows), piece_rows_(piece_rows) {
    TORCH_CHECK(mlp_rows > 0 && piece_rows > 0, "positive row counts expected");
  }

  // Each linear layer's op; gate_up's applies SiLU-and-mul (SiluAndMulLinear).
  void add_layer(torch::Tensor input_norm, torch::Tensor post_attention_norm, Linear qkv, Linear o, Linear gate_up,
                 Linear down, c10::optional<torch::Tensor> q_norm, c10::optional<torch::Tensor> k_norm,
                 int64_t sliding_window, double k_scale, double v_scale, c10::optional<torch::Tensor> sinks,
                 int64_t group) {
    TORCH_CHECK(qkv && o && down, "a layer needs its qkv, o and down ops");
    TORCH_CHECK(!sinks || (sinks->scalar_type() == torch::kFloat && sinks->numel() == num_heads_),
                "fp32 sinks, one a head, expected");
    TORCH_CHECK(group >= 0, "a KV group index expected");
    layers_.push_back({std::move(input_norm), std::move(post_attention_norm), std::move(qkv), std::move(o),
                       std::move(gate_up), std::move(down), std::move(q_norm), std::move(k_norm), sliding_window,
                       k_scale, v_scale, std::move(sinks), group});
  }

  void set_lora(std::shared_ptr<LoRARows> rows) { lora_ = std::move(rows); }

  // x: the step's token embeddings [tokens, hidden], taken over as the residual stream.
  // kv_caches: per layer (K, V). slot_mapping and block_tables: KV group 0's; group_tables: the
  // (slot_mapping, block_tables) of groups 1, 2, ... Returns the final norm of the last residual,
  // written over x. One call at a time: the intermediates live in buffers the stack keeps.
  //
  // A step of more than piece_rows_ rows goes through the layers a piece of rows at a time, each
  // piece's sequences' metadata cut to its rows: a piece's KV is in the cache before a later
  // piece's rows attend to it, and every kernel computes a row on its own, so the results are the
  // whole step's while the buffers hold a piece, not the step. With LoRA adapters the rows' slots
  // are the whole step's: such a step goes whole.
  torch::Tensor forward(torch::Tensor x, const torch::Tensor& cos, const torch::Tensor& sin,
                        const std::vector<std::tuple<torch::Tensor, torch::Tensor>>& kv_caches,
                        const torch::Tensor& slot_mapping, const torch::Tensor& block_tables,
                        const torch::Tensor& query_start_loc, const torch::Tensor& seq_lens,
                        const std::vector<std::tuple<torch::Tensor, torch::Tensor>>& group_tables) const {
    TORCH_CHECK(kv_caches.size() == layers_.size(), "one (K, V) cache per layer expected");
    TORCH_CHECK(x.is_contiguous(), "contiguous embeddings expected");
    const int64_t tokens = x.size(0);
    const Metadata whole{cos, sin, slot_mapping, block_tables, query_start_loc, seq_lens, group_tables};
    if (tokens <= piece_rows_ || (lora_ && lora_->active())) {
      run(x, kv_caches, whole);
      return x;
    }
    TORCH_CHECK(cos.size(0) == tokens && sin.size(0) == tokens, "a rotary row per token expected");
    for (int64_t start = 0; start < tokens; start += piece_rows_) {
      const int64_t count = std::min(piece_rows_, tokens - start);
      run(x.narrow(0, start, count), kv_caches, whole.piece(start, count));
    }
    return x;
  }

 private:
  // A pass's rotary tables and attention metadata (of its sequences, in the step's order).
  struct Metadata {
    torch::Tensor cos, sin, slot_mapping, block_tables, query_start_loc, seq_lens;
    std::vector<std::tuple<torch::Tensor, torch::Tensor>> group_tables;

    // Rows [start, start + count) of the step: the sequences with rows among them, each cut to
    // those rows. A sequence cut at the piece's end is as long as its rows up to there (so its
    // tokens after the piece are not yet there to attend to); one cut at its start keeps its
    // length, from which its rows' positions follow.
    Metadata piece(int64_t start, int64_t count) const {
      const int64_t end = start + count, num_seqs = seq_lens.size(0);
      const int32_t* qsl = query_start_loc.data_ptr<int32_t>();
      const int32_t* lens = seq_lens.data_ptr<int32_t>();
      int64_t first = 0;
      while (first < num_seqs && qsl[first + 1] <= start) ++first;
      int64_t last = first;  // one past the piece's last sequence
      while (last < num_seqs && qsl[last] < end) ++last;
      const auto int32 = query_start_loc.options();
      torch::Tensor starts = torch::empty({last - first + 1}, int32), cut = torch::empty({last - first}, int32);
      int32_t* s = starts.data_ptr<int32_t>();
      int32_t* n = cut.data_ptr<int32_t>();
      for (int64_t b = first; b < last; ++b) {
        s[b - first] = static_cast<int32_t>(std::max<int64_t>(qsl[b], start) - start);
        n[b - first] = static_cast<int32_t>(lens[b] - (qsl[b + 1] - std::min<int64_t>(qsl[b + 1], end)));
      }
      s[last - first] = static_cast<int32_t>(count);
      std::vector<std::tuple<torch::Tensor, torch::Tensor>> groups;
      for (const auto& [slots, tables] : group_tables)
        groups.emplace_back(slots.narrow(0, start, count), tables.narrow(0, first, last - first));
      return {cos.narrow(0, start, count), sin.narrow(0, start, count), slot_mapping.narrow(0, start, count),
              block_tables.narrow(0, first, last - first), starts, cut, std::move(groups)};
    }
  };

  // The layers over x's rows (their residual stream, changed in place), then the final norm,
  // written over them (the kernel reads each value before it writes it).
  void run(const torch::Tensor& x, const std::vector<std::tuple<torch::Tensor, torch::Tensor>>& kv_caches,
           const Metadata& m) const {
    const int64_t tokens = x.size(0), hidden = x.size(1);
    const torch::Tensor& residual = x;
    const torch::Tensor normed = buffer(kNormed, x, tokens, hidden);
    const torch::Tensor delta = buffer(kDelta, x, tokens, hidden);  // each sublayer's output
    for (size_t i = 0; i < layers_.size(); ++i) {
      const Layer& layer = layers_[i];
      const auto& [k_cache, v_cache] = kv_caches[i];
      TORCH_CHECK(layer.group <= static_cast<int64_t>(m.group_tables.size()), "no block tables for KV group ",
                  layer.group);
      const torch::Tensor& slots = layer.group == 0 ? m.slot_mapping : std::get<0>(m.group_tables[layer.group - 1]);
      const torch::Tensor& tables = layer.group == 0 ? m.block_tables : std::get<1>(m.group_tables[layer.group - 1]);
      rms_norm(normed, residual, i == 0 ? c10::nullopt : c10::optional<torch::Tensor>(delta), layer.input_norm, eps_);
      attend(layer, normed, delta, m.cos, m.sin, k_cache, v_cache, slots, tables, m.query_start_loc, m.seq_lens);
      rms_norm(normed, residual, delta, layer.post_attention_norm, eps_);
      mlp(layer, normed, delta);
    }
    rms_norm(x, residual, layers_.empty() ? c10::nullopt : c10::optional<torch::Tensor>(delta), final_norm_, eps_);
  }

  // The intermediates of a step, in buffers kept from step to step and shared by the layers. A
  // long step's (tens of MiB) allocated a few times a layer were mapped, faulted in and unmapped
  // each time (a seventh of a 2048-token prefill's time on the 250M Q4_K_M model), or, taken from
  // the heap, left resident wherever they had landed (30 MiB more at the server's peak).
  enum Buffer { kNormed, kDelta, kQkv, kQuery, kHeads, kGateUp, kNumBuffers };

  // Buffer b's first `rows` rows of `cols` columns, in x's dtype, grown where it is too small.
  torch::Tensor buffer(Buffer b, const torch::Tensor& x, int64_t rows, int64_t cols) const {
    torch::Tensor& kept = buffers_[b];
    if (!kept.defined() || kept.size(0) < rows || kept.size(1) != cols || kept.scalar_type() != x.scalar_type())
      kept = torch::empty({rows, cols}, x.options());
    return kept.narrow(0, 0, rows);
  }

  // The attention sublayer of normed into out.
  void attend(const Layer& layer, const torch::Tensor& normed, const torch::Tensor& out, const torch::Tensor& cos,
              const torch::Tensor& sin, const torch::Tensor& k_cache, const torch::Tensor& v_cache,
              const torch::Tensor& slot_mapping, const torch::Tensor& block_tables,
              const torch::Tensor& query_start_loc, const torch::Tensor& seq_lens) const {
    const int64_t tokens = normed.size(0), q_size = num_heads_ * head_dim_;
    const torch::Tensor qkv = layer.qkv->forward(normed, buffer(kQkv, normed, tokens, layer.qkv->out_features()));
    if (layer.q_norm) norm_heads(qkv, 0, q_size, *layer.q_norm);
    if (layer.k_norm) norm_heads(qkv, q_size, (qkv.size(1) - q_size) / 2, *layer.k_norm);
    rotary_and_cache(qkv, cos, sin, k_cache, v_cache, slot_mapping, num_heads_, layer.k_scale, layer.v_scale);
    const torch::Tensor q = buffer(kQuery, normed, tokens, q_size).view({tokens, num_heads_, head_dim_});
    q.copy_(qkv.narrow(1, 0, q_size).view({tokens, num_heads_, head_dim_}));
    const torch::Tensor heads = buffer(kHeads, normed, tokens, q_size);
    paged_attention(heads.view({tokens, num_heads_, head_dim_}), q, k_cache, v_cache, block_tables, query_start_loc,
                    seq_lens, scale_, layer.sliding_window, layer.k_scale, layer.v_scale, layer.sinks);
    layer.o->forward(heads, out);
  }

  // RMSNorm of each head of qkv's columns [start, start + size), written back: as models/decoder.py's
  // Attention._norm_qk (the heads gathered into rows, normed, put back), so the same values.
  void norm_heads(const torch::Tensor& qkv, int64_t start, int64_t size, const torch::Tensor& weight) const {
    const torch::Tensor part = qkv.narrow(1, start, size);
    const torch::Tensor heads = part.reshape({-1, head_dim_}).contiguous();  // (one head a row: a view)
    torch::Tensor normed = torch::empty_like(heads);
    rms_norm(normed, heads, c10::nullopt, weight, eps_);
    part.copy_(normed.view(part.sizes()));
  }

  // The MLP of normed into out (whose attention output is spent), in chunks of mlp_rows_ rows as
  // models/decoder.py's GatedMLP (whole in a step with LoRA adapters: their rows' slots are the step's).
  void mlp(const Layer& layer, const torch::Tensor& normed, const torch::Tensor& out) const {
    if (!layer.gate_up) {  // one op, whole (a mixture of experts groups the step's rows by expert)
      layer.down->forward(normed, out);
      return;
    }
    const int64_t tokens = normed.size(0);
    const int64_t chunk = lora_ && lora_->active() ? std::max<int64_t>(tokens, 1) : mlp_rows_;
    for (int64_t start = 0; start < tokens; start += chunk) {
      const int64_t count = std::min(chunk, tokens - start);
      const torch::Tensor rows = normed.narrow(0, start, count);
      layer.down->forward(layer.gate_up->forward(rows, buffer(kGateUp, rows, count, layer.gate_up->out_features())),
                          out.narrow(0, start, count));
    }
  }

  int64_t num_heads_, head_dim_;
  double eps_, scale_;
  torch::Tensor final_norm_;
  int64_t mlp_rows_, piece_rows_;
  std::shared_ptr<LoRARows> lora_;  // the step's adapter rows, where layers have LoRA slots
  std::vector<Layer> layers_;
  mutable torch::Tensor buffers_[kNumBuffers];
};

void bind_decoder_stack(pybind11::module& m) {
  using release = pybind11::call_guard<pybind11::gil_scoped_release>;
  pybind11::class_<LinearOp, std::shared_ptr<LinearOp>>(m, "LinearOp")
      .def("__call__", [](const LinearOp& op, const torch::Tensor& x) { return op.forward(x, torch::Tensor()); },
           release());
  pybind11::class_<PackedLinear, LinearOp, std::shared_ptr<PackedLinear>>(m, "PackedLinear")
      .def(pybind11::init<torch::Tensor, int64_t, int64_t, int64_t, int64_t, c10::optional<torch::Tensor>, bool,
                          int64_t>());
  pybind11::class_<DecoderStack>(m, "DecoderStack")
      .def(pybind11::init<int64_t, int64_t, double, double, torch::Tensor, int64_t, int64_t>())
      .def("add_layer", &DecoderStack::add_layer)
      .def("set_lora", &DecoderStack::set_lora)
      .def("forward", &DecoderStack::forward, pybind11::call_guard<pybind11::gil_scoped_release>());
}
