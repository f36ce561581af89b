// Paged attention on CPU: each query token attends to its sequence's keys and values read in
// place from the block-table-addressed KV cache (no gather into a contiguous tensor).
// Serves prefill chunks and decodes alike: a sequence contributes `q_len` query tokens that sit
// at the end of its `seq_len` tokens of context (causal within the chunk).
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

namespace {

// bf16 is the high half of an fp32: widening by a shift, not the scalar conversion operator,
// lets the loops below vectorize.
template <typename T>
inline float widen(T x) {
  if constexpr (std::is_same_v<T, at::BFloat16>) {
    const uint32_t bits = static_cast<uint32_t>(x.x) << 16;
    float f;
    std::memcpy(&f, &bits, sizeof f);
    return f;
  } else {
    return static_cast<float>(x);
  }
}

constexpr int64_t kMaxHeadDim = 512;

// exp(x) for x <= 0 as plain arithmetic, so that loops of it vectorize (std::exp does not here):
// 2^(x log2 e) split into an integer power, set in the exponent bits, and a fraction, by a
// degree-6 polynomial. Relative error below 3e-7; x below -87 (and -inf) gives 0.
inline float fast_exp(float x) {
  x = std::max(x, -87.f);
  const float t = x * 1.44269504f;
  const float fi = std::floor(t);
  const float f = t - fi;
  float p = 1.5353362e-4f;
  p = p * f + 1.3398874e-3f;
  p = p * f + 9.6181291e-3f;
  p = p * f + 5.5504109e-2f;
  p = p * f + 2.4022652e-1f;
  p = p * f + 6.9314718e-1f;
  p = p * f + 1.0f;
  const int32_t bits = (static_cast<int32_t>(fi) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return p * scale;
}


// One query token and head against its context. With D > 0 the head size is known at compile
// time, so the query and the accumulator live in registers across the whole walk.
template <typename T, int64_t D>
void attend_one(T* out, const T* q, const T* k_cache, const T* v_cache, const int32_t* blocks,
                int64_t pos, int64_t first, int64_t block_size, int64_t token_stride,
                int64_t d_runtime, float scale, float* scores) {
  const int64_t d = D > 0 ? D : d_runtime;
  float qf[D > 0 ? D : kMaxHeadDim], acc[D > 0 ? D : kMaxHeadDim];
  for (int64_t i = 0; i < d; ++i) {
    qf[i] = widen(q[i]) * scale;
    acc[i] = 0.f;
  }
  float running_max = -std::numeric_limits<float>::infinity();
  float denom = 0.f;
  // Walk the context one block at a time: scores for the block, then one rescale of acc.
  for (int64_t start = first - first % block_size; start <= pos; start += block_size) {
    const int64_t lo = std::max(start, first), hi = std::min(start + block_size - 1, pos), n = hi - lo + 1;
    const int64_t base = static_cast<int64_t>(blocks[start / block_size]) * block_size + lo - start;
    float block_max = running_max;
    for (int64_t j = 0; j < n; ++j) {
      const T* __restrict k = k_cache + (base + j) * token_stride;
      float sum = 0.f;
#pragma omp simd reduction(+ : sum)
      for (int64_t i = 0; i < d; ++i) sum += qf[i] * widen(k[i]);
      scores[j] = sum;
      block_max = std::max(block_max, sum);
    }
    const float correction = fast_exp(running_max - block_max);
    denom *= correction;
#pragma omp simd
    for (int64_t i = 0; i < d; ++i) acc[i] *= correction;
#pragma omp simd
    for (int64_t j = 0; j < n; ++j) scores[j] = fast_exp(scores[j] - block_max);
    for (int64_t j = 0; j < n; ++j) {
      const float p = scores[j];
      denom += p;
      const T* __restrict v = v_cache + (base + j) * token_stride;
#pragma omp simd
      for (int64_t i = 0; i < d; ++i) acc[i] += p * widen(v[i]);
    }
    running_max = block_max;
  }
  const float inv = 1.f / denom;
  for (int64_t i = 0; i < d; ++i) out[i] = static_cast<T>(acc[i] * inv);
}

template <typename T>
void run(torch::Tensor& out, const torch::Tensor& q, const torch::Tensor& k_cache,
         const torch::Tensor& v_cache, const torch::Tensor& block_tables,
         const torch::Tensor& query_start_loc, const torch::Tensor& seq_lens, double scale,
         int64_t sliding_window, bool skip_fresh) {
  const int64_t num_tokens = q.size(0), num_heads = q.size(1), d = q.size(2);
  const int64_t block_size = k_cache.size(1), num_kv_heads = k_cache.size(2);
  const int64_t group = num_heads / num_kv_heads;
  const int64_t token_stride = num_kv_heads * d;  // one token's K (or V) row in the cache
  const int64_t table_stride = block_tables.size(1);
  const int32_t* qsl = query_start_loc.data_ptr<int32_t>();
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  const int64_t num_seqs = seq_lens.size(0);

  // Which sequence each query token belongs to, and its absolute position. With skip_fresh,
  // prompts computed whole in this step (no cached context) are left to the caller.
  std::vector<int64_t> seq_of(num_tokens), pos_of(num_tokens);
  for (int64_t b = 0; b < num_seqs; ++b) {
    const int64_t q_len = qsl[b + 1] - qsl[b];
    const bool skip = skip_fresh && q_len > 1 && q_len == lens[b];
    for (int64_t t = qsl[b]; t < qsl[b + 1]; ++t) {
      seq_of[t] = skip ? -1 : b;
      pos_of[t] = lens[b] - q_len + (t - qsl[b]);
    }
  }
  const T* qp = q.data_ptr<T>();
  const T* kp = k_cache.data_ptr<T>();
  const T* vp = v_cache.data_ptr<T>();
  T* op = out.data_ptr<T>();
  const int32_t* tables = block_tables.data_ptr<int32_t>();

  TORCH_CHECK(d <= kMaxHeadDim, "head_dim above ", kMaxHeadDim);
  auto attend = d == 64 ? attend_one<T, 64> : d == 128 ? attend_one<T, 128> : attend_one<T, 0>;
  at::parallel_for(0, num_tokens * num_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores(block_size);
    for (int64_t work = begin; work < end; ++work) {
      const int64_t t = work / num_heads, h = work % num_heads;
      if (seq_of[t] < 0) continue;
      const int64_t pos = pos_of[t];
      const int64_t first = sliding_window > 0 ? std::max<int64_t>(0, pos - sliding_window + 1) : 0;
      const int64_t kv_head = h / group;
      attend(op + (t * num_heads + h) * d, qp + (t * num_heads + h) * d, kp + kv_head * d, vp + kv_head * d,
             tables + seq_of[t] * table_stride, pos, first, block_size, token_stride, d,
             static_cast<float>(scale), scores.data());
    }
  });
}

}  // namespace

void paged_attention(torch::Tensor out, torch::Tensor q, torch::Tensor k_cache,
                     torch::Tensor v_cache, torch::Tensor block_tables,
                     torch::Tensor query_start_loc, torch::Tensor seq_lens, double scale,
                     int64_t sliding_window, bool skip_fresh) {
  TORCH_CHECK(q.is_contiguous() && out.is_contiguous() && k_cache.is_contiguous() &&
              v_cache.is_contiguous() && block_tables.is_contiguous(), "contiguous inputs expected");
  TORCH_CHECK(block_tables.scalar_type() == torch::kInt32 && seq_lens.scalar_type() == torch::kInt32 &&
              query_start_loc.scalar_type() == torch::kInt32, "int32 metadata expected");
  switch (q.scalar_type()) {
    case torch::kFloat: run<float>(out, q, k_cache, v_cache, block_tables, query_start_loc, seq_lens, scale, sliding_window, skip_fresh); break;
    case torch::kBFloat16: run<at::BFloat16>(out, q, k_cache, v_cache, block_tables, query_start_loc, seq_lens, scale, sliding_window, skip_fresh); break;
    case torch::kHalf: run<at::Half>(out, q, k_cache, v_cache, block_tables, query_start_loc, seq_lens, scale, sliding_window, skip_fresh); break;
    default: TORCH_CHECK(false, "unsupported dtype ", q.scalar_type());
  }
}

bool has_avx512_bf16();
void gemv_bf16(torch::Tensor out, torch::Tensor x, torch::Tensor w);
void rms_norm(torch::Tensor out, torch::Tensor x, c10::optional<torch::Tensor> delta, torch::Tensor weight,
              double eps);
void silu_and_mul(torch::Tensor out, torch::Tensor gate_up);
void rotary_embedding(torch::Tensor x, torch::Tensor cos, torch::Tensor sin);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_attention", &paged_attention, "paged attention over a block-table KV cache (CPU)");
  m.def("gemv_bf16", &gemv_bf16, "out = x @ w.T for a few rows of x, bf16 (AVX512-BF16)");
  m.def("has_avx512_bf16", &has_avx512_bf16, "whether gemv_bf16 was built with AVX512-BF16");
  m.def("rms_norm", &rms_norm, "RMSNorm, optionally after adding delta into x (in place)");
  m.def("silu_and_mul", &silu_and_mul, "silu(gate) * up over [.., 2n] -> [.., n]");
  m.def("rotary_embedding", &rotary_embedding, "rotate-half rotary embedding in place");
}
