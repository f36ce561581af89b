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

void rms_norm(torch::Tensor out, torch::Tensor x, c10::optional<torch::Tensor> delta, torch::Tensor weight,
              double eps);
void rotary_and_cache(torch::Tensor qkv, torch::Tensor cos, torch::Tensor sin, torch::Tensor k_cache,
                      torch::Tensor v_cache, torch::Tensor slots, int64_t num_heads);
bool paged_attention(torch::Tensor out, torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                     torch::Tensor block_tables, torch::Tensor query_start_loc, torch::Tensor seq_lens, double scale,
                     int64_t sliding_window, bool skip_fresh);
void packed_linear_rows(torch::Tensor out, torch::Tensor x, int64_t weight_ptr, int64_t n_padded,
                        int64_t k_padded, c10::optional<torch::Tensor> bias, bool silu_mul);

namespace {

// A linear layer as layers/linear.py hands it over: its packed weights (held, so that they outlive
// any swap of the module's), where their buffer is, and how wide.
struct PackedLinear {
  torch::Tensor weight;
  int64_t address, n_padded, k_padded, out_features;
  c10::optional<torch::Tensor> bias;
  bool silu_mul;
  int64_t rows_per_call;  // as Linear._packed_rows: longer batches go in chunks of this many rows

  torch::Tensor operator()(const torch::Tensor& x) const {
    const int64_t rows = x.size(0);
    torch::Tensor out = torch::empty({rows, silu_mul ? out_features / 2 : out_features}, x.options());
    for (int64_t start = 0; start < rows; start += rows_per_call) {
      const int64_t count = std::min(rows_per_call, rows - start);
      packed_linear_rows(out.narrow(0, start, count), x.narrow(0, start, count), address, n_padded, k_padded, bias,
                         silu_mul);
    }
    return out;
  }
};

struct Layer {
  torch::Tensor input_norm, post_attention_norm;
  PackedLinear qkv, o, gate_up, down;
  int64_t sliding_window;  // 0: full attention
};

}  // namespace

using LinearSpec = std::tuple<torch::Tensor, int64_t, int64_t, int64_t, int64_t, c10::optional<torch::Tensor>>;

class DecoderStack {
 public:
  DecoderStack(int64_t num_heads, int64_t head_dim, double eps, double scale, torch::Tensor final_norm,
               int64_t rows_per_linear_call)
      : num_heads_(num_heads), head_dim_(head_dim), eps_(eps), scale_(scale), final_norm_(std::move(final_norm)),
        rows_per_call_(rows_per_linear_call) {}

  // Each linear as (packed weight, its buffer's address, padded out and in features, out features,
  // bias); gate_up's blocks interleave gate and up 64 columns at a time (SiluAndMulLinear).
  void add_layer(torch::Tensor input_norm, torch::Tensor post_attention_norm, const LinearSpec& qkv,
                 const LinearSpec& o, const LinearSpec& gate_up, const LinearSpec& down, int64_t sliding_window) {
    layers_.push_back({std::move(input_norm), std::move(post_attention_norm), linear(qkv, false), linear(o, false),
                       linear(gate_up, true), linear(down, false), sliding_window});
  }

  // x: the step's token embeddings [tokens, hidden], taken over as the residual stream.
  // kv_caches: per layer (K, V). Returns the final norm of the last residual.
  torch::Tensor forward(torch::Tensor x, const torch::Tensor& cos, const torch::Tensor& sin,
                        const std::vector<std::tuple<torch::Tensor, torch::Tensor>>& kv_caches,
                        const torch::Tensor& slot_mapping, const torch::Tensor& block_tables,
                        const torch::Tensor& query_start_loc, const torch::Tensor& seq_lens) const {
    TORCH_CHECK(kv_caches.size() == layers_.size(), "one (K, V) cache per layer expected");
    TORCH_CHECK(x.is_contiguous(), "contiguous embeddings expected");
    const int64_t tokens = x.size(0), q_size = num_heads_ * head_dim_;
    torch::Tensor residual = x, normed = torch::empty_like(x), delta;
    for (size_t i = 0; i < layers_.size(); ++i) {
      const Layer& layer = layers_[i];
      const auto& [k_cache, v_cache] = kv_caches[i];
      rms_norm(normed, residual, i == 0 ? c10::nullopt : c10::optional<torch::Tensor>(delta), layer.input_norm, eps_);
      const torch::Tensor qkv = layer.qkv(normed);
      rotary_and_cache(qkv, cos, sin, k_cache, v_cache, slot_mapping, num_heads_);
      const torch::Tensor q = qkv.narrow(1, 0, q_size).view({tokens, num_heads_, head_dim_}).contiguous();
      torch::Tensor attention = torch::empty_like(q);
      paged_attention(attention, q, k_cache, v_cache, block_tables, query_start_loc, seq_lens, scale_,
                      layer.sliding_window, false);
      const torch::Tensor o = layer.o(attention.view({tokens, q_size}));
      rms_norm(normed, residual, o, layer.post_attention_norm, eps_);
      delta = layer.down(layer.gate_up(normed));
    }
    torch::Tensor out = torch::empty_like(x);
    rms_norm(out, residual, layers_.empty() ? c10::nullopt : c10::optional<torch::Tensor>(delta), final_norm_, eps_);
    return out;
  }

 private:
  PackedLinear linear(const LinearSpec& spec, bool silu_mul) const {
    const auto& [weight, address, n_padded, k_padded, out_features, bias] = spec;
    return {weight, address, n_padded, k_padded, out_features, bias, silu_mul, rows_per_call_};
  }

  int64_t num_heads_, head_dim_;
  double eps_, scale_;
  torch::Tensor final_norm_;
  int64_t rows_per_call_;
  std::vector<Layer> layers_;
};

void bind_decoder_stack(pybind11::module& m) {
  pybind11::class_<DecoderStack>(m, "DecoderStack")
      .def(pybind11::init<int64_t, int64_t, double, double, torch::Tensor, int64_t>())
      .def("add_layer", &DecoderStack::add_layer)
      .def("forward", &DecoderStack::forward, pybind11::call_guard<pybind11::gil_scoped_release>());
}
