// Fused elementwise work of a decoder layer, one pass each instead of a chain of small ops:
// RMSNorm (with the residual add before it), SiLU-and-mul, rotary embedding with the KV cache write;
// and the greedy sampler's argmax over rows of logits.
// Each rounds to the tensor dtype exactly where PyTorch's op-by-op version does, so results
// match the torch references in layers/ bit for bit in float32 and in bfloat16.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cmath>
#include <cstring>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "kv_quant.h"
#if defined(__AVX512BF16__)
#include <sleef.h>  // ships with PyTorch, whose own vectorized exp this is
#endif

namespace {

#if defined(__AVX512F__)
// The first min(left, 16) lanes.
inline __mmask16 lanes(int64_t left) { return left >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << left) - 1); }
#endif

template <typename T>
inline T round_to(float v) { return static_cast<T>(v); }

// out = w * to_dtype(x * rsqrt(mean(x^2) + eps)); with `residual`, x = residual += delta first.
// Gemma's RMSNorm (kOffsetWeight): the weight is an offset from 1 and the scaling is done in fp32,
// rounded once at the end; Llama's rounds the normalized value, then scales in the model's dtype.
template <typename T, bool kOffsetWeight = false>
void rms_rows(T* out, T* x, const T* delta, const T* w, int64_t rows, int64_t n, float eps) {
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      T* xr = x + r * n;
      if (delta != nullptr) {
        const T* dr = delta + r * n;
        for (int64_t i = 0; i < n; ++i) xr[i] = round_to<T>(static_cast<float>(xr[i]) + static_cast<float>(dr[i]));
      }
      float sum = 0.f;
#pragma omp simd reduction(+ : sum)
      for (int64_t i = 0; i < n; ++i) sum += static_cast<float>(xr[i]) * static_cast<float>(xr[i]);
      const float inv = 1.f / std::sqrt(sum / static_cast<float>(n) + eps);
      T* outr = out + r * n;
      for (int64_t i = 0; i < n; ++i) {
        if constexpr (kOffsetWeight) {
          outr[i] = round_to<T>(static_cast<float>(xr[i]) * inv * (1.f + static_cast<float>(w[i])));
        } else {
          const T normed = round_to<T>(static_cast<float>(xr[i]) * inv);
          outr[i] = round_to<T>(static_cast<float>(w[i]) * static_cast<float>(normed));
        }
      }
    }
  });
}

template <typename T>
void silu_mul_rows(T* out, const T* gate_up, int64_t rows, int64_t n) {
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* g = gate_up + r * 2 * n;
      const T* u = g + n;
      T* o = out + r * n;
      for (int64_t i = 0; i < n; ++i) {
        const float gf = static_cast<float>(g[i]);
        const T act = round_to<T>(gf / (1.f + std::exp(-gf)));
        o[i] = round_to<T>(static_cast<float>(act) * static_cast<float>(u[i]));
      }
    }
  });
}

#if defined(__AVX512BF16__)
inline __m512 load_bf16x16(const at::BFloat16* p, __mmask16 m) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, p)), 16));
}

inline __m512 round_bf16(__m512 x) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(x)), 16));
}

// silu(g) * u, 16 lanes: silu(g) = g / (1 + exp(-g)) in fp32 with PyTorch's own exp (Sleef,
// 1 ulp), rounded to bf16 before the product, as F.silu(gate) * up rounds.
inline __m256bh silu_mul_x16(__m512 g, __m512 u) {
  const __m512 e = Sleef_expf16_u10(_mm512_sub_ps(_mm512_setzero_ps(), g));
  const __m512 act = _mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.f), e));
  return _mm512_cvtneps_pbh(_mm512_mul_ps(round_bf16(act), u));
}

template <>
void silu_mul_rows<at::BFloat16>(at::BFloat16* out, const at::BFloat16* gate_up, int64_t rows, int64_t n) {
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const at::BFloat16* g = gate_up + r * 2 * n;
      const at::BFloat16* u = g + n;
      at::BFloat16* o = out + r * n;
      for (int64_t i = 0; i < n; i += 16) {
        const __mmask16 m = lanes(n - i);
        _mm256_mask_storeu_epi16(o + i, m, (__m256i)silu_mul_x16(load_bf16x16(g + i, m), load_bf16x16(u + i, m)));
      }
    }
  });
}
#endif

}  // namespace

#if defined(__AVX512BF16__)
// out[0, n) = silu(g) * u, where g and u are fp32 sums of the gate and up projections: each is
// rounded to bf16 first, as a bf16 linear layer's output is, then treated as silu_and_mul treats
// that output. packed_linear_rows calls it as it stores a block of gate_up columns.
void silu_mul_sums_bf16(at::BFloat16* out, const float* g, const float* u, int64_t n) {
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 m = lanes(n - i);
    const __m512 gf = round_bf16(_mm512_maskz_loadu_ps(m, g + i)), uf = round_bf16(_mm512_maskz_loadu_ps(m, u + i));
    _mm256_mask_storeu_epi16(out + i, m, (__m256i)silu_mul_x16(gf, uf));
  }
}
#endif

namespace {

// x[t, h, :] = x * cos + rotate_half(x) * sin, each product and the sum rounded to T.
template <typename T>
void rotary_rows(T* x, int64_t token_stride, int64_t heads, int64_t d, const float* cos, const float* sin,
                 int64_t tokens) {
  const int64_t half = d / 2;
  at::parallel_for(0, tokens, 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* c = cos + t * d;
      const float* s = sin + t * d;
      for (int64_t h = 0; h < heads; ++h) {
        T* v = x + t * token_stride + h * d;
        for (int64_t i = 0; i < half; ++i) {
          const float a = static_cast<float>(v[i]), b = static_cast<float>(v[i + half]);
          const float ci = static_cast<float>(round_to<T>(c[i])), si = static_cast<float>(round_to<T>(s[i]));
          const float cj = static_cast<float>(round_to<T>(c[i + half]));
          const float sj = static_cast<float>(round_to<T>(s[i + half]));
          const float lo = static_cast<float>(round_to<T>(a * ci)) + static_cast<float>(round_to<T>(-b * si));
          const float hi = static_cast<float>(round_to<T>(b * cj)) + static_cast<float>(round_to<T>(a * sj));
          v[i] = round_to<T>(lo);
          v[i + half] = round_to<T>(hi);
        }
      }
    }
  });
}

// The index of the largest of p[0, n), the first where several tie, a NaN counting as largest:
// torch.argmax's answer.
int64_t argmax_scalar(const float* p, int64_t n) {
  int64_t arg = 0;
  for (int64_t i = 0; i < n; ++i) {
    if (p[i] != p[i]) return i;
    if (p[i] > p[arg]) arg = i;
  }
  return arg;
}

// The same in two vectorized passes, the max and then its first index (torch's own CPU argmax
// took 0.7-1.3 ms on 64 x 32000 logits here); rows with a NaN go the scalar way.
int64_t argmax_row(const float* p, int64_t n) {
#if defined(__AVX512F__)
  const __m512 lowest = _mm512_set1_ps(-INFINITY);
  __m512 m0 = lowest, m1 = lowest;
  __mmask16 nan = 0;
  int64_t i = 0;
  for (; i + 32 <= n; i += 32) {
    const __m512 a = _mm512_loadu_ps(p + i), b = _mm512_loadu_ps(p + i + 16);
    nan |= _mm512_cmp_ps_mask(a, a, _CMP_UNORD_Q) | _mm512_cmp_ps_mask(b, b, _CMP_UNORD_Q);
    m0 = _mm512_max_ps(m0, a);
    m1 = _mm512_max_ps(m1, b);
  }
  for (; i < n; i += 16) {
    const __mmask16 k = lanes(n - i);
    const __m512 a = _mm512_mask_loadu_ps(lowest, k, p + i);
    nan |= _mm512_cmp_ps_mask(a, a, _CMP_UNORD_Q);
    m0 = _mm512_max_ps(m0, a);
  }
  if (nan) return argmax_scalar(p, n);
  const __m512 best = _mm512_set1_ps(_mm512_reduce_max_ps(_mm512_max_ps(m0, m1)));
  for (i = 0; i < n; i += 16) {
    const __mmask16 k = lanes(n - i);
    const __mmask16 hit = _mm512_mask_cmp_ps_mask(k, _mm512_maskz_loadu_ps(k, p + i), best, _CMP_EQ_OQ);
    if (hit) return i + __builtin_ctz(hit);
  }
  return 0;  // n == 0
#else
  return argmax_scalar(p, n);
#endif
}

}  // namespace

#define DISPATCH(dtype, NAME, ...)                                                     \
  switch (dtype) {                                                                     \
    case torch::kFloat: { using scalar = float; __VA_ARGS__; break; }                 \
    case torch::kBFloat16: { using scalar = at::BFloat16; __VA_ARGS__; break; }       \
    default: TORCH_CHECK(false, NAME, ": unsupported dtype ", dtype);                 \
  }

// out = rms_norm(x); with delta given, x += delta first (x is the residual stream, updated).
void rms_norm(torch::Tensor out, torch::Tensor x, c10::optional<torch::Tensor> delta, torch::Tensor weight,
              double eps) {
  TORCH_CHECK(x.is_contiguous() && out.is_contiguous() && weight.is_contiguous(), "contiguous tensors expected");
  const int64_t n = x.size(-1), rows = x.numel() / n;
  DISPATCH(x.scalar_type(), "rms_norm",
           rms_rows<scalar>(out.data_ptr<scalar>(), x.data_ptr<scalar>(),
                            delta.has_value() ? delta->contiguous().data_ptr<scalar>() : nullptr,
                            weight.data_ptr<scalar>(), rows, n, static_cast<float>(eps)))
}

// out = Gemma's RMSNorm of x (weight an offset from 1, scaled in fp32).
void gemma_rms_norm(torch::Tensor out, torch::Tensor x, torch::Tensor weight, double eps) {
  TORCH_CHECK(x.is_contiguous() && out.is_contiguous() && weight.is_contiguous(), "contiguous tensors expected");
  TORCH_CHECK(weight.scalar_type() == x.scalar_type(), "the weight in x's dtype expected");
  const int64_t n = x.size(-1), rows = x.numel() / n;
  DISPATCH(x.scalar_type(), "gemma_rms_norm",
           (rms_rows<scalar, true>(out.data_ptr<scalar>(), x.data_ptr<scalar>(), nullptr, weight.data_ptr<scalar>(),
                                   rows, n, static_cast<float>(eps))))
}

void silu_and_mul(torch::Tensor out, torch::Tensor gate_up) {
  TORCH_CHECK(gate_up.is_contiguous() && out.is_contiguous(), "contiguous tensors expected");
  const int64_t n = out.size(-1), rows = out.numel() / n;
  DISPATCH(out.scalar_type(), "silu_and_mul", silu_mul_rows<scalar>(out.data_ptr<scalar>(),
                                                                    gate_up.data_ptr<scalar>(), rows, n))
}

// n values of a K or V row into the cache: copied, rounded to bf16, or as fp8 bytes of value / scale.
template <KvKind K, typename scalar>
inline void store_row(void* dst, const scalar* src, int64_t n, float scale) {
  if constexpr (K == KvKind::kSame) {
    std::memcpy(dst, src, n * sizeof(scalar));
  } else if constexpr (K == KvKind::kBF16) {
    at::BFloat16* out = static_cast<at::BFloat16*>(dst);
    for (int64_t i = 0; i < n; ++i) out[i] = static_cast<at::BFloat16>(static_cast<float>(src[i]));
  } else {
    uint8_t* out = static_cast<uint8_t*>(dst);
    const float inv = 1.f / scale;
    for (int64_t i = 0; i < n; ++i) out[i] = to_fp8<K>(static_cast<float>(src[i]), inv);
  }
}

template <KvKind K, typename scalar>
void store_kv(const scalar* x, int64_t stride, int64_t q_size, int64_t kv_size, const int64_t* slot, int64_t tokens,
              torch::Tensor& k_cache, torch::Tensor& v_cache, float k_scale, float v_scale) {
  char* kc = static_cast<char*>(k_cache.data_ptr());
  char* vc = static_cast<char*>(v_cache.data_ptr());
  const int64_t row_bytes = kv_size * static_cast<int64_t>(k_cache.element_size());
  at::parallel_for(0, tokens, 64, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      store_row<K>(kc + slot[t] * row_bytes, x + t * stride + q_size, kv_size, k_scale);
      store_row<K>(vc + slot[t] * row_bytes, x + t * stride + q_size + kv_size, kv_size, v_scale);
    }
  });
}

// qkv: [tokens, (num_heads + 2 kv_heads) * d] rows, q then k then v heads. Rotates the q and k
// heads in place, then copies each token's k and v into its slot of the caches ([blocks,
// block_size, kv_heads, d]): one call for what were two rotary calls and two index copies.
// fp8 caches take the bytes of value / scale.
void rotary_and_cache(torch::Tensor qkv, torch::Tensor cos, torch::Tensor sin, torch::Tensor k_cache,
                      torch::Tensor v_cache, torch::Tensor slots, int64_t num_heads, double k_scale, double v_scale) {
  const int64_t tokens = qkv.size(0), kv_heads = k_cache.size(2), d = k_cache.size(3);
  const int64_t q_size = num_heads * d, kv_size = kv_heads * d;
  TORCH_CHECK(qkv.dim() == 2 && qkv.stride(1) == 1 && qkv.size(1) == q_size + 2 * kv_size, "qkv rows expected");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "contiguous caches expected");
  const KvKind kind = kv_kind(k_cache, qkv.scalar_type());
  TORCH_CHECK(kv_kind(v_cache, qkv.scalar_type()) == kind, "K and V caches of one dtype expected");
  TORCH_CHECK(slots.scalar_type() == torch::kLong && slots.is_contiguous() && slots.numel() == tokens,
              "one int64 slot per token expected");
  TORCH_CHECK(cos.scalar_type() == torch::kFloat && cos.is_contiguous() && sin.is_contiguous(), "fp32 tables");
  const int64_t* slot = slots.data_ptr<int64_t>();
  DISPATCH(qkv.scalar_type(), "rotary_and_cache", {
    scalar* x = qkv.data_ptr<scalar>();
    const int64_t stride = qkv.stride(0);
    rotary_rows<scalar>(x, stride, num_heads + kv_heads, d, cos.data_ptr<float>(), sin.data_ptr<float>(), tokens);
    const float ks = static_cast<float>(k_scale), vs = static_cast<float>(v_scale);
    switch (kind) {
      case KvKind::kE4M3: store_kv<KvKind::kE4M3>(x, stride, q_size, kv_size, slot, tokens, k_cache, v_cache, ks, vs); break;
      case KvKind::kE5M2: store_kv<KvKind::kE5M2>(x, stride, q_size, kv_size, slot, tokens, k_cache, v_cache, ks, vs); break;
      case KvKind::kBF16: store_kv<KvKind::kBF16>(x, stride, q_size, kv_size, slot, tokens, k_cache, v_cache, ks, vs); break;
      default: store_kv<KvKind::kSame>(x, stride, q_size, kv_size, slot, tokens, k_cache, v_cache, ks, vs);
    }
  })
}

// out[r] = argmax of row r of x ([rows, n] fp32, contiguous), as torch.argmax(x, dim=-1).
void argmax_rows(torch::Tensor out, torch::Tensor x) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.scalar_type() == torch::kFloat, "[rows, n] fp32 expected");
  TORCH_CHECK(out.scalar_type() == torch::kLong && out.numel() == x.size(0), "one int64 per row expected");
  const int64_t n = x.size(1);
  const float* p = x.data_ptr<float>();
  int64_t* o = out.data_ptr<int64_t>();
  at::parallel_for(0, x.size(0), 8, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) o[r] = argmax_row(p + r * n, n);
  });
}

// Structured output's token mask: in fp32 rows `rows[j]` of logits, tokens whose bit is clear in
// mask row j (bit t % 32 of int32 word t / 32) become -inf. Words of all ones (a free stretch of
// vocabulary) are skipped and words of zeros filled whole: a grammar's masks are mostly one or the
// other, so a row costs a pass over its 1.5k words rather than over 49k tokens.
void apply_token_mask(torch::Tensor logits, torch::Tensor rows, torch::Tensor words) {
  TORCH_CHECK(logits.dim() == 2 && logits.is_contiguous() && logits.scalar_type() == torch::kFloat,
              "[batch, vocab] fp32 logits expected");
  TORCH_CHECK(words.dim() == 2 && words.is_contiguous() && words.scalar_type() == torch::kInt, "int32 mask words expected");
  TORCH_CHECK(rows.scalar_type() == torch::kLong && rows.numel() == words.size(0), "one int64 row index per mask row");
  const int64_t vocab = logits.size(1), num_words = words.size(1);
  TORCH_CHECK(num_words * 32 >= vocab, "the mask covers ", num_words * 32, " tokens, fewer than the vocabulary's ", vocab);
  const int64_t* row_index = rows.data_ptr<int64_t>();
  for (int64_t j = 0; j < rows.numel(); ++j) {
    TORCH_CHECK(row_index[j] >= 0 && row_index[j] < logits.size(0), "mask row index out of range");
  }
  const float neg_inf = -std::numeric_limits<float>::infinity();
  at::parallel_for(0, rows.numel(), 1, [&](int64_t begin, int64_t end) {
    for (int64_t j = begin; j < end; ++j) {
      float* row = logits.data_ptr<float>() + row_index[j] * vocab;
      const uint32_t* mask = reinterpret_cast<const uint32_t*>(words.data_ptr<int32_t>()) + j * num_words;
      for (int64_t w = 0; w * 32 < vocab; ++w) {
        const uint32_t word = mask[w];
        if (word == 0xffffffffu) continue;
        const int64_t base = w * 32, count = std::min<int64_t>(32, vocab - base);
        for (int64_t b = 0; b < count; ++b) {
          if (!((word >> b) & 1u)) row[base + b] = neg_inf;
        }
      }
    }
  });
}
