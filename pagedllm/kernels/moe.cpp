// A mixture-of-experts block's routed experts as one call from Python (layers/moe.py's SparseMoE).
//
// The op-by-op path routes, sorts the (token, expert) pairs and runs each chosen expert on its
// tokens through about forty torch ops a layer; at one token a step those cost more than the
// experts' matmuls (docs/benchmarks-history.md). Here the same steps run in one call with the GIL
// released: the router's logits through its linear op, each token's softmax and top-k in fp32,
// each chosen expert once on its tokens' rows (its gate/up op, the activation, its down op), and
// each token's weighted sum taken in ascending expert order, rounded to the activations' dtype at
// every step as the op-by-op path's torch ops round. A row's result depends on that row alone.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>
#include <vector>

#include <ATen/Parallel.h>
#include <torch/extension.h>

#include "linear_op.h"

namespace {

using Linear = std::shared_ptr<LinearOp>;

// What lies between an expert's gate/up op and its down op.
enum class Activation : int64_t {
  kFused = 0,          // none: the gate/up op applied SiLU-and-mul itself (SiluAndMulLinear)
  kClampedSwiglu = 1,  // gpt-oss: (clamp(up, +-limit) + 1) * g * sigmoid(alpha g), g = min(gate, limit)
};

template <typename T>
inline T round_to(float v) {
  return static_cast<T>(v);
}

// gpt-oss's activation over [rows, 2n] (gate's n columns, then up's) into [rows, n], each torch op of
// GptOssExpert.forward rounded to T where it rounds.
template <typename T>
void clamped_swiglu(T* out, const T* gate_up, int64_t rows, int64_t n, float alpha, float limit) {
  const float lim = static_cast<float>(round_to<T>(limit));
  at::parallel_for(0, rows, std::max<int64_t>(1, 16384 / std::max<int64_t>(n, 1)), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* g = gate_up + r * 2 * n;
      const T* u = g + n;
      T* o = out + r * n;
      for (int64_t i = 0; i < n; ++i) {
        const float gate = std::min(static_cast<float>(g[i]), lim);
        const float up = std::min(std::max(static_cast<float>(u[i]), -lim), lim);
        const float scaled = static_cast<float>(round_to<T>(gate * alpha));
        const float sig = static_cast<float>(round_to<T>(1.f / (1.f + std::exp(-scaled))));
        const float glu = static_cast<float>(round_to<T>(gate * sig));
        const float up1 = static_cast<float>(round_to<T>(up + 1.f));
        o[i] = round_to<T>(up1 * glu);
      }
    }
  });
}

}  // namespace

// The block as a LinearOp ([tokens, hidden] -> [tokens, hidden]), so that the C++ decoder stack can
// run it as a layer's MLP.
class SparseMoEOp : public LinearOp {
 public:
  // router: [hidden] -> [experts] logits; gate_up[e], down[e]: expert e's ops. groups: DeepSeek's
  // (n_group, topk_group), (0, 0) for none.
  SparseMoEOp(Linear router, std::vector<Linear> gate_up, std::vector<Linear> down, int64_t top_k, bool renormalize,
              double routed_scale, int64_t num_groups, int64_t keep_groups, int64_t activation, double alpha,
              double limit)
      : router_(std::move(router)), gate_up_(std::move(gate_up)), down_(std::move(down)), top_k_(top_k),
        renormalize_(renormalize), routed_scale_(static_cast<float>(routed_scale)), num_groups_(num_groups),
        keep_groups_(keep_groups), activation_(static_cast<Activation>(activation)), alpha_(static_cast<float>(alpha)),
        limit_(static_cast<float>(limit)) {
    const int64_t experts = static_cast<int64_t>(gate_up_.size());
    TORCH_CHECK(experts > 0 && down_.size() == gate_up_.size(), "one gate/up and one down op per expert expected");
    TORCH_CHECK(router_->out_features() == experts, "the router gives ", router_->out_features(), " logits for ",
                experts, " experts");
    TORCH_CHECK(top_k_ >= 1 && top_k_ <= experts, "top_k ", top_k_, " out of 1..", experts);
    TORCH_CHECK(activation == 0 || activation == 1, "unknown activation ", activation);
    TORCH_CHECK(num_groups_ == 0 || (experts % num_groups_ == 0 && keep_groups_ >= 1 && keep_groups_ <= num_groups_),
                "expert groups ", num_groups_, " (keeping ", keep_groups_, ") do not divide ", experts, " experts");
  }

  int64_t out_features() const override { return down_[0]->out_features(); }

  // x [tokens, hidden] -> the routed experts' weighted sum [tokens, hidden], in x's dtype, into
  // `given` where it is defined.
  torch::Tensor forward(const torch::Tensor& x, const torch::Tensor& given) const override {
    TORCH_CHECK(x.dim() == 2, "[tokens, hidden] activations expected");
    const torch::Tensor input = x.contiguous();
    torch::Tensor out = output(input, given);
    out.zero_();
    if (input.size(0) == 0) return out;
    const Routes routes = route(input);
    if (input.scalar_type() == torch::kBFloat16)
      run_experts<at::BFloat16>(input, routes, out);
    else if (input.scalar_type() == torch::kFloat)
      run_experts<float>(input, routes, out);
    else
      TORCH_CHECK(false, "the MoE op computes in bf16 or fp32, not ", input.scalar_type());
    return out;
  }

  // For tests: each token's (weights, experts), as SparseMoE.route gives them (weights in fp32).
  std::tuple<torch::Tensor, torch::Tensor> route_for_test(const torch::Tensor& x) const {
    const Routes routes = route(x.contiguous());
    const int64_t tokens = x.size(0);
    torch::Tensor weights = torch::empty({tokens, top_k_}, torch::kFloat);
    torch::Tensor experts = torch::empty({tokens, top_k_}, torch::kLong);
    std::copy(routes.weight.begin(), routes.weight.end(), weights.data_ptr<float>());
    std::copy(routes.expert.begin(), routes.expert.end(), experts.data_ptr<int64_t>());
    return {weights, experts};
  }

 private:
  // Each token's top_k (expert, weight) pairs, token-major, largest weight first.
  struct Routes {
    std::vector<int64_t> expert;
    std::vector<float> weight;
  };

  Routes route(const torch::Tensor& x) const {
    const int64_t tokens = x.size(0), experts = static_cast<int64_t>(gate_up_.size());
    const torch::Tensor logits = router_->forward(x, torch::Tensor()).to(torch::kFloat).contiguous();
    const float* l = logits.data_ptr<float>();
    Routes routes{std::vector<int64_t>(tokens * top_k_), std::vector<float>(tokens * top_k_)};
    std::vector<float> probs(experts);
    std::vector<int64_t> order(experts);
    for (int64_t t = 0; t < tokens; ++t) {
      softmax(l + t * experts, probs.data(), experts);
      if (num_groups_) keep_best_groups(probs.data(), experts);
      // top_k of probs, largest first, the lower expert first where two tie (torch.topk's order here)
      std::iota(order.begin(), order.end(), 0);
      std::partial_sort(order.begin(), order.begin() + top_k_, order.end(),
                        [&](int64_t a, int64_t b) { return probs[a] > probs[b] || (probs[a] == probs[b] && a < b); });
      float sum = 0.f;
      for (int64_t j = 0; j < top_k_; ++j) sum += probs[order[j]];
      for (int64_t j = 0; j < top_k_; ++j) {
        float w = probs[order[j]];
        if (renormalize_) w = w / sum;
        if (routed_scale_ != 1.f) w = w * routed_scale_;
        routes.expert[t * top_k_ + j] = order[j];
        routes.weight[t * top_k_ + j] = w;
      }
    }
    return routes;
  }

  static void softmax(const float* logits, float* probs, int64_t n) {
    const float top = *std::max_element(logits, logits + n);
    float sum = 0.f;
    for (int64_t i = 0; i < n; ++i) sum += probs[i] = std::exp(logits[i] - top);
    const float inv = 1.f / sum;
    for (int64_t i = 0; i < n; ++i) probs[i] *= inv;
  }

  // Group-limited greedy (DeepSeek): every expert outside the keep_groups_ groups of highest best
  // probability set to 0.
  void keep_best_groups(float* probs, int64_t experts) const {
    const int64_t size = experts / num_groups_;
    std::vector<float> best(num_groups_);
    for (int64_t g = 0; g < num_groups_; ++g) best[g] = *std::max_element(probs + g * size, probs + (g + 1) * size);
    std::vector<int64_t> groups(num_groups_);
    std::iota(groups.begin(), groups.end(), 0);
    std::partial_sort(groups.begin(), groups.begin() + keep_groups_, groups.end(),
                      [&](int64_t a, int64_t b) { return best[a] > best[b] || (best[a] == best[b] && a < b); });
    std::vector<bool> kept(num_groups_, false);
    for (int64_t j = 0; j < keep_groups_; ++j) kept[groups[j]] = true;
    for (int64_t g = 0; g < num_groups_; ++g)
      if (!kept[g]) std::fill(probs + g * size, probs + (g + 1) * size, 0.f);
  }

  // Each expert with tokens routed to it, in ascending order: its tokens' rows gathered, run, and
  // each row times its weight (rounded to T) added to its token's sum (rounded to T).
  template <typename T>
  void run_experts(const torch::Tensor& x, const Routes& routes, torch::Tensor& out) const {
    const int64_t tokens = x.size(0), hidden = x.size(1), experts = static_cast<int64_t>(gate_up_.size());
    std::vector<std::vector<int64_t>> pairs(experts);  // each expert's (token, k) pairs, in token order
    for (int64_t p = 0; p < tokens * top_k_; ++p) pairs[routes.expert[p]].push_back(p);
    const T* in = x.data_ptr<T>();
    T* y = out.data_ptr<T>();
    for (int64_t e = 0; e < experts; ++e) {
      const std::vector<int64_t>& mine = pairs[e];
      const int64_t count = static_cast<int64_t>(mine.size());
      if (count == 0) continue;
      torch::Tensor rows = torch::empty({count, hidden}, x.options());
      T* r = rows.data_ptr<T>();
      for (int64_t i = 0; i < count; ++i) std::memcpy(r + i * hidden, in + mine[i] / top_k_ * hidden, hidden * sizeof(T));
      const torch::Tensor result = down_[e]->forward(activate<T>(gate_up_[e]->forward(rows, torch::Tensor())),
                                                     torch::Tensor());
      const T* z = result.data_ptr<T>();
      for (int64_t i = 0; i < count; ++i) {
        const float w = static_cast<float>(round_to<T>(routes.weight[mine[i]]));
        T* sum = y + mine[i] / top_k_ * hidden;
        const T* row = z + i * hidden;
        for (int64_t c = 0; c < hidden; ++c)
          sum[c] = round_to<T>(static_cast<float>(sum[c]) +
                               static_cast<float>(round_to<T>(static_cast<float>(row[c]) * w)));
      }
    }
  }

  template <typename T>
  torch::Tensor activate(const torch::Tensor& product) const {
    if (activation_ == Activation::kFused) return product;
    const int64_t rows = product.size(0), n = product.size(1) / 2;
    torch::Tensor out = torch::empty({rows, n}, product.options());
    clamped_swiglu<T>(out.data_ptr<T>(), product.data_ptr<T>(), rows, n, alpha_, limit_);
    return out;
  }

  Linear router_;
  std::vector<Linear> gate_up_, down_;
  int64_t top_k_;
  bool renormalize_;
  float routed_scale_;
  int64_t num_groups_, keep_groups_;
  Activation activation_;
  float alpha_, limit_;
};

void bind_moe(pybind11::module& m) {
  using release = pybind11::call_guard<pybind11::gil_scoped_release>;
  pybind11::class_<SparseMoEOp, LinearOp, std::shared_ptr<SparseMoEOp>>(m, "SparseMoE")
      .def(pybind11::init<Linear, std::vector<Linear>, std::vector<Linear>, int64_t, bool, double, int64_t, int64_t,
                          int64_t, double, double>(),
           pybind11::arg("router"), pybind11::arg("gate_up"), pybind11::arg("down"), pybind11::arg("top_k"),
           pybind11::arg("renormalize"), pybind11::arg("routed_scale"), pybind11::arg("num_groups"),
           pybind11::arg("keep_groups"), pybind11::arg("activation"), pybind11::arg("alpha"), pybind11::arg("limit"))
      .def("route", &SparseMoEOp::route_for_test, release());
}
