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


// One query token against its context for the G query heads that share one KV head: each K and
// V row is read once for all G. With D > 0 the head size is known at compile time, so queries
// and accumulators stay in registers (or L1) across the whole walk.
template <typename T, int64_t D, int64_t G>
void attend(T* out, const T* q, const T* k_cache, const T* v_cache, const int32_t* blocks, int64_t pos,
            int64_t first, int64_t block_size, int64_t token_stride, int64_t d_runtime, float scale,
            float* scores) {
  const int64_t d = D > 0 ? D : d_runtime;
  constexpr int64_t kD = D > 0 ? D : kMaxHeadDim;
  float qf[G][kD], acc[G][kD], running_max[G], denom[G];
  for (int64_t g = 0; g < G; ++g) {
    for (int64_t i = 0; i < d; ++i) {
      qf[g][i] = widen(q[g * d + i]) * scale;
      acc[g][i] = 0.f;
    }
    running_max[g] = -std::numeric_limits<float>::infinity();
    denom[g] = 0.f;
  }
  // Walk the context one block at a time: scores for the block, then one rescale of acc.
  for (int64_t start = first - first % block_size; start <= pos; start += block_size) {
    const int64_t lo = std::max(start, first), hi = std::min(start + block_size - 1, pos), n = hi - lo + 1;
    const int64_t base = static_cast<int64_t>(blocks[start / block_size]) * block_size + lo - start;
    for (int64_t j = 0; j < n; ++j) {
      const T* __restrict k = k_cache + (base + j) * token_stride;
      for (int64_t g = 0; g < G; ++g) {
        float sum = 0.f;
#pragma omp simd reduction(+ : sum)
        for (int64_t i = 0; i < d; ++i) sum += qf[g][i] * widen(k[i]);
        scores[g * block_size + j] = sum;
      }
    }
    for (int64_t g = 0; g < G; ++g) {
      float* __restrict sc = scores + g * block_size;
      float block_max = running_max[g];
      for (int64_t j = 0; j < n; ++j) block_max = std::max(block_max, sc[j]);
      const float correction = fast_exp(running_max[g] - block_max);
      denom[g] *= correction;
#pragma omp simd
      for (int64_t i = 0; i < d; ++i) acc[g][i] *= correction;
#pragma omp simd
      for (int64_t j = 0; j < n; ++j) sc[j] = fast_exp(sc[j] - block_max);
      for (int64_t j = 0; j < n; ++j) denom[g] += sc[j];
      running_max[g] = block_max;
    }
    for (int64_t j = 0; j < n; ++j) {
      const T* __restrict v = v_cache + (base + j) * token_stride;
      for (int64_t g = 0; g < G; ++g) {
        const float p = scores[g * block_size + j];
#pragma omp simd
        for (int64_t i = 0; i < d; ++i) acc[g][i] += p * widen(v[i]);
      }
    }
  }
  for (int64_t g = 0; g < G; ++g) {
    const float inv = 1.f / denom[g];
    for (int64_t i = 0; i < d; ++i) out[g * d + i] = static_cast<T>(acc[g][i] * inv);
  }
}

// The compiled variant for this head size and group size; `served`: query heads per call.
template <typename T>
void (*pick(int64_t d, int64_t group, int64_t& served))(T*, const T*, const T*, const T*, const int32_t*, int64_t,
                                                          int64_t, int64_t, int64_t, int64_t, float, float*) {
  served = group;
#define PICK_G(DD)                                  \
  switch (group) {                                  \
    case 1: return attend<T, DD, 1>;                \
    case 2: return attend<T, DD, 2>;                \
    case 3: return attend<T, DD, 3>;                \
    case 4: return attend<T, DD, 4>;                \
    case 8: return attend<T, DD, 8>;                \
    default: break;                                 \
  }
  if (d == 64) { PICK_G(64) }
  else if (d == 128) { PICK_G(128) }
  else { PICK_G(0) }
#undef PICK_G
  served = 1;  // an unusual group size: one head at a time
  return d == 64 ? attend<T, 64, 1> : d == 128 ? attend<T, 128, 1> : attend<T, 0, 1>;
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
  int64_t served = 1;
  auto attend_fn = pick<T>(d, group, served);
  const int64_t calls_per_token = num_heads / served;
  at::parallel_for(0, num_tokens * calls_per_token, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores(served * block_size);
    for (int64_t work = begin; work < end; ++work) {
      const int64_t t = work / calls_per_token, h0 = (work % calls_per_token) * served;
      if (seq_of[t] < 0) continue;
      const int64_t pos = pos_of[t];
      const int64_t first = sliding_window > 0 ? std::max<int64_t>(0, pos - sliding_window + 1) : 0;
      const int64_t kv_head = h0 / group;
      attend_fn(op + (t * num_heads + h0) * d, qp + (t * num_heads + h0) * d, kp + kv_head * d,
                vp + kv_head * d, tables + seq_of[t] * table_stride, pos, first, block_size, token_stride, d,
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
