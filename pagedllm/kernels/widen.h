// fp32 and bf16 values as fp32, one or 8 lanes (AVX2): bf16 -> fp32 is exact, its bits moved up 16.
#pragma once

#include <torch/extension.h>
#if defined(__AVX2__)
#include <immintrin.h>
#endif

inline float widen(float v) { return v; }
inline float widen(at::BFloat16 v) { return static_cast<float>(v); }

#if defined(__AVX2__)
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const at::BFloat16* p) {
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
}
#endif
