// The KV cache's 8-bit float formats (--kv-cache-dtype fp8_e4m3 / fp8_e5m2): one byte per value,
// value = fp8 x the layer's scale. Written as K/V enter the cache (fused_ops.cpp), read by the
// attention kernels (paged_attention.cpp), whose walks widen the bytes in registers.
#pragma once

#include <torch/extension.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Float8_e5m2.h>
#include <c10/util/Half.h>

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>

// kBF16: bf16 values for fp32 queries and K/V (--kv-cache-dtype bfloat16 on an fp32 model).
enum class KvKind { kSame = 0, kE4M3 = 1, kE5M2 = 2, kBF16 = 3 };

constexpr bool is_fp8(KvKind k) { return k == KvKind::kE4M3 || k == KvKind::kE5M2; }

// A cache element: the values' own type T, a bf16, or a byte of fp8.
template <KvKind K, typename T>
using CacheT = std::conditional_t<K == KvKind::kSame, T, std::conditional_t<K == KvKind::kBF16, at::BFloat16, uint8_t>>;

// The layer's scales: a cached K value is its byte's fp8 value x k (V: x v). Unused for kSame.
struct KvScales {
  float k = 1.f, v = 1.f;
};

// Which format a cache tensor holds, given the dtype of the queries (or K/V) it serves.
inline KvKind kv_kind(const torch::Tensor& cache, c10::ScalarType compute) {
  switch (cache.scalar_type()) {
    case torch::kFloat8_e4m3fn: return KvKind::kE4M3;
    case torch::kFloat8_e5m2: return KvKind::kE5M2;
    case torch::kBFloat16:
      if (compute == torch::kFloat) return KvKind::kBF16;
      [[fallthrough]];
    default:
      TORCH_CHECK(cache.scalar_type() == compute, "KV cache of ", cache.scalar_type(), " for ", compute,
                  " values: expected the same dtype, fp8 (e4m3fn, e5m2) or (fp32 values) bf16");
      return KvKind::kSame;
  }
}

// value / scale as the format's byte: saturated to its largest finite value, rounded to nearest
// even (c10's conversions, which torch's .to() uses: the pure-torch path writes the same bytes).
template <KvKind K>
inline uint8_t to_fp8(float value, float inv_scale) {
  const float x = value * inv_scale;
  if constexpr (K == KvKind::kE4M3) {
    return c10::Float8_e4m3fn(std::clamp(x, -448.f, 448.f)).x;
  } else {
    return c10::Float8_e5m2(std::clamp(x, -57344.f, 57344.f)).x;
  }
}

// Both formats are a prefix of an fp16's bits: e5m2 is an fp16's high byte; e4m3's exponent and
// mantissa, set 3 bits into an fp16's, give its value / 2^8 (normals and subnormals alike: the
// biases differ by 8). So the byte widens as an fp16, and 2^8 joins the scale.
template <KvKind K>
inline uint16_t fp8_as_half_bits(uint8_t b) {
  if constexpr (K == KvKind::kE4M3) return static_cast<uint16_t>(((b & 0x80) << 8) | ((b & 0x7F) << 7));
  return static_cast<uint16_t>(b << 8);
}

template <KvKind K>
constexpr float fp8_half_factor() {
  return K == KvKind::kE4M3 ? 256.f : 1.f;
}

template <KvKind K>
inline float from_fp8(uint8_t b, float scale) {
  return static_cast<float>(c10::Half(fp8_as_half_bits<K>(b), c10::Half::from_bits())) * (fp8_half_factor<K>() * scale);
}
