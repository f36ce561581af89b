// The KV cache's 8-bit float formats (--kv-cache-dtype fp8_e4m3 / fp8_e5m2): one byte per value,
// value = fp8 x the layer's scale. Written as K/V enter the cache (fused_ops.cpp), read by the
// attention kernels (paged_attention.cpp), whose walks widen the bytes in registers.
#pragma once

#include <torch/extension.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Float8_e5m2.h>

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

// Both formats widen to an fp32 by their bits alone: the byte sign-extended to 32 bits and shifted
// left sets its exponent and mantissa into the fp32's low exponent bits and high mantissa bits and
// its sign into the sign bit; a mask clears the rest. The fp32 is the fp8's value x 2^-E (E: 120 for
// e4m3, 112 for e5m2), normals and subnormals alike (these become fp32 subnormals), exactly.
template <KvKind K>
constexpr int fp8_float_exponent() {
  return K == KvKind::kE4M3 ? 120 : 112;
}
template <KvKind K>
constexpr int fp8_float_shift() {
  return K == KvKind::kE4M3 ? 20 : 21;
}
template <KvKind K>
constexpr uint32_t fp8_float_mask() {
  return K == KvKind::kE4M3 ? 0x87F00000u : 0x8FE00000u;
}
template <KvKind K>
inline float fp8_as_float(uint8_t b) {
  const auto wide = static_cast<uint32_t>(static_cast<int32_t>(static_cast<int8_t>(b)));
  const uint32_t bits = (wide << fp8_float_shift<K>()) & fp8_float_mask<K>();
  float x;
  std::memcpy(&x, &bits, sizeof x);
  return x;
}

template <KvKind K>
inline float from_fp8(uint8_t b, float scale) {
  if constexpr (K == KvKind::kE4M3) return static_cast<float>(c10::Float8_e4m3fn(b, c10::Float8_e4m3fn::from_bits())) * scale;
  return static_cast<float>(c10::Float8_e5m2(b, c10::Float8_e5m2::from_bits())) * scale;
}
