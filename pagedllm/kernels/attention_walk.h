// The attention walk of every build, dtype and head size that the AVX-512 BF16 walk does not
// serve (paged_attention.cpp): fp32, fp16 and bf16 queries over caches of their own dtype or fp8,
// in 8 fp32 lanes (AVX2 with FMA, or plain arrays elsewhere).
//
// Each query token's result is one fixed sequence of operations that depends only on its position:
// its context [first, pos] is cut into partitions of `part` tokens aligned to absolute positions
// (0, part, 2 part, ...; a multiple of the block size), each partition walked tile by tile (kTile
// keys, also aligned to absolute positions, across blocks) as an online softmax of its own, and
// the partitions' states folded in order. So a decode, a
// prefill chunk's token, a verification's or a recompute's give the same bits, alone or beside
// others, on one thread or many, whether one thread walks all of a token's partitions (many
// query tokens: threads take tokens) or each partition is a task of its own (a few long decodes:
// threads take partitions, the states wait in a buffer, then fold).
//
// The arithmetic lives in a few functions kept out of line (tile_step, score_rows3, softmax_rows, fold, finish),
// so that no caller's inlining can fuse a multiply and an add differently in one place than
// another; inside tile_step, the groupings of rows and keys use explicit FMAs and sums only.
#pragma once

#include <torch/extension.h>

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>

#include "kv_quant.h"

namespace attention_walk {

constexpr float kLog2e = 1.44269504f;
// 2^t for t <= 0: t = n + f, n = round(t) by adding kRound (1.5 x 2^23 + 127: the sum's low mantissa
// bits are then n + 127, the exponent bits of 2^n), f in [-0.5, 0.5] by a degree-5 polynomial
// (relative error below 3e-7); t below -125 (or NaN) gives 2^-125, no subnormals. std::fma and
// _mm256_max_ps's order, so that the scalar and the vector form give the same bits. t far above 0
// (only lanes past a tile's keys, whose results are dropped) gives meaningless bits.
constexpr float kRound = 12583039.f;
inline float exp2_1(float t) {
  t = t > -125.f ? t : -125.f;
  const float y = t + kRound;
  const float f = t - (y - kRound);
  float p = 1.32764643e-3f;
  p = std::fma(p, f, 9.67554096e-3f);
  p = std::fma(p, f, 5.55071346e-2f);
  p = std::fma(p, f, 2.40221202e-1f);
  p = std::fma(p, f, 6.93146944e-1f);
  p = std::fma(p, f, 1.00000012f);
  uint32_t bits;
  std::memcpy(&bits, &y, sizeof bits);
  bits <<= 23;
  float power;
  std::memcpy(&power, &bits, sizeof power);
  return p * power;
}
// exp(x) for x <= 0 (the states' corrections).
inline float exp1(float x) { return exp2_1(x * kLog2e); }

#if defined(__AVX2__) && defined(__FMA__)
struct F8 {
  __m256 v;
};
inline F8 load8(const float* p) { return {_mm256_loadu_ps(p)}; }
inline void store8(float* p, F8 a) { _mm256_storeu_ps(p, a.v); }
inline F8 set8(float x) { return {_mm256_set1_ps(x)}; }
inline F8 fma8(F8 a, F8 b, F8 c) { return {_mm256_fmadd_ps(a.v, b.v, c.v)}; }
inline F8 mul8(F8 a, F8 b) { return {_mm256_mul_ps(a.v, b.v)}; }
inline F8 add8(F8 a, F8 b) { return {_mm256_add_ps(a.v, b.v)}; }
// The first `n` lanes of a, the rest 0.
inline F8 first8(F8 a, int64_t n) {
  const __m256i lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  return {_mm256_and_ps(a.v, _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(n)), lanes)))};
}
// Lane i: the sum of a[i]'s lanes, as ((0 + 1) + (2 + 3)) + ((4 + 5) + (6 + 7)).
inline F8 sums8(const F8* a) {
  const __m256 t0 = _mm256_hadd_ps(a[0].v, a[1].v), t1 = _mm256_hadd_ps(a[2].v, a[3].v);
  const __m256 t2 = _mm256_hadd_ps(a[4].v, a[5].v), t3 = _mm256_hadd_ps(a[6].v, a[7].v);
  const __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);
  return {_mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31))};
}
inline F8 max8(F8 a, F8 b) { return {_mm256_max_ps(a.v, b.v)}; }
// The first `n` lanes of a, the rest x.
inline F8 first8_or(F8 a, int64_t n, float x) {
  const __m256i lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  const __m256 keep = _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(n)), lanes));
  return {_mm256_blendv_ps(_mm256_set1_ps(x), a.v, keep)};
}
inline float max_of(F8 a) {
  const __m128 m = _mm_max_ps(_mm256_castps256_ps128(a.v), _mm256_extractf128_ps(a.v, 1));
  const __m128 m2 = _mm_max_ps(m, _mm_movehl_ps(m, m));
  return _mm_cvtss_f32(_mm_max_ss(m2, _mm_movehdup_ps(m2)));
}
// out[i]: the sum of a[i]'s lanes (i < 4), in sums8's order.
inline void sums4(float* out, const F8* a) {
  const __m256 u = _mm256_hadd_ps(_mm256_hadd_ps(a[0].v, a[1].v), _mm256_hadd_ps(a[2].v, a[3].v));
  _mm_storeu_ps(out, _mm_add_ps(_mm256_castps256_ps128(u), _mm256_extractf128_ps(u, 1)));
}
inline F8 exp2_8(F8 a) {
  const __m256 t = _mm256_max_ps(a.v, _mm256_set1_ps(-125.f));
  const __m256 y = _mm256_add_ps(t, _mm256_set1_ps(kRound));
  const __m256 f = _mm256_sub_ps(t, _mm256_sub_ps(y, _mm256_set1_ps(kRound)));
  __m256 p = _mm256_set1_ps(1.32764643e-3f);
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(9.67554096e-3f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(5.55071346e-2f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(2.40221202e-1f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(6.93146944e-1f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.00000012f));
  return {_mm256_mul_ps(p, _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_castps_si256(y), 23)))};
}
#else
struct F8 {
  float v[8];
};
inline F8 load8(const float* p) {
  F8 a;
  std::memcpy(a.v, p, sizeof a.v);
  return a;
}
inline void store8(float* p, F8 a) { std::memcpy(p, a.v, sizeof a.v); }
inline F8 set8(float x) {
  F8 a;
  std::fill(a.v, a.v + 8, x);
  return a;
}
#define PAGEDLLM_LANES(EXPR) \
  F8 r;                      \
  for (int i = 0; i < 8; ++i) r.v[i] = EXPR; \
  return r
inline F8 fma8(F8 a, F8 b, F8 c) { PAGEDLLM_LANES(std::fma(a.v[i], b.v[i], c.v[i])); }
inline F8 mul8(F8 a, F8 b) { PAGEDLLM_LANES(a.v[i] * b.v[i]); }
inline F8 add8(F8 a, F8 b) { PAGEDLLM_LANES(a.v[i] + b.v[i]); }
inline F8 first8(F8 a, int64_t n) { PAGEDLLM_LANES(i < n ? a.v[i] : 0.f); }
inline F8 exp2_8(F8 a) { PAGEDLLM_LANES(exp2_1(a.v[i])); }
inline F8 sums8(const F8* a) {
  PAGEDLLM_LANES(((a[i].v[0] + a[i].v[1]) + (a[i].v[2] + a[i].v[3])) + ((a[i].v[4] + a[i].v[5]) + (a[i].v[6] + a[i].v[7])));
}
inline F8 max8(F8 a, F8 b) { PAGEDLLM_LANES(std::max(a.v[i], b.v[i])); }
inline F8 first8_or(F8 a, int64_t n, float x) { PAGEDLLM_LANES(i < n ? a.v[i] : x); }
#undef PAGEDLLM_LANES
inline float max_of(F8 a) { return *std::max_element(a.v, a.v + 8); }
inline void sums4(float* out, const F8* a) {
  for (int i = 0; i < 4; ++i)
    out[i] = ((a[i].v[0] + a[i].v[1]) + (a[i].v[2] + a[i].v[3])) + ((a[i].v[4] + a[i].v[5]) + (a[i].v[6] + a[i].v[7]));
}
#endif

// Keeps a loaded vector in a register. The compiler otherwise folds its load into each FMA that
// uses it, loading it once for each; loads, not FMAs, then bound the loop.
inline void in_register(F8& a) {
#if defined(__AVX2__) && defined(__FMA__)
  __asm__("" : "+x"(a.v));
#else
  (void)a;
#endif
}

// The sum of a's lanes, in sums8's order.
inline float sum8(F8 a) {
  alignas(32) float x[8];
  store8(x, a);
  return ((x[0] + x[1]) + (x[2] + x[3])) + ((x[4] + x[5]) + (x[6] + x[7]));
}

// 8 K or V values as fp32: fp32 rows read as they are, bf16 rows widened exactly in registers.
inline F8 load_row8(const float* p) { return load8(p); }
inline F8 load_row8(const at::BFloat16* p) {
#if defined(__AVX2__) && defined(__FMA__)
  const __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return {_mm256_castsi256_ps(_mm256_slli_epi32(w, 16))};
#else
  F8 a;
  for (int i = 0; i < 8; ++i) a.v[i] = static_cast<float>(p[i]);
  return a;
#endif
}

// An fp8 cache's row as the walk reads it in place: its bytes, widened by their bits (fp8_as_float:
// the value x 2^-E), which is exact; 2^E, the layer's scales and the query's are the scores' and
// the probabilities' (Call), so that no value of K or V is rounded.
template <KvKind K>
struct Fp8 {
  uint8_t byte;
};
template <typename R>
constexpr bool is_fp8_row = false;
template <KvKind K>
constexpr bool is_fp8_row<Fp8<K>> = true;

// How an fp8 cache's 2^E is shared out (Call): the scores take 2^56 of K's and the query the rest;
// the probabilities take 2^112 of V's and the result the rest. Every product q k is then the one of
// the values themselves x 2^-56, every p v exactly the one of p and the value: for any fp8 byte, as
// far from fp32's subnormals and its overflow as the values' own products are.
constexpr int kFp8ScoreShare = 56;
constexpr int kFp8ProbShare = 112;

// Clears the calling thread's denormals-are-zero flag while it lives (torch.set_flush_denormal sets
// it): fp8 subnormals widen to fp32 subnormals, which must read as themselves.
struct SubnormalsRead {
  unsigned saved = _mm_getcsr();
  SubnormalsRead() { _mm_setcsr(saved & ~0x40u); }
  ~SubnormalsRead() { _mm_setcsr(saved); }
  SubnormalsRead(const SubnormalsRead&) = delete;
  SubnormalsRead& operator=(const SubnormalsRead&) = delete;
};

#if defined(__AVX2__)
// 8 bytes of fp8 as fp8_as_float widens them.
template <KvKind K>
inline __m256 fp8_as_floats(const uint8_t* p) {
  const __m256i wide = _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  const __m256i mask = _mm256_set1_epi32(static_cast<int>(fp8_float_mask<K>()));
  return _mm256_castsi256_ps(_mm256_and_si256(_mm256_slli_epi32(wide, fp8_float_shift<K>()), mask));
}
#endif

template <KvKind K>
inline F8 load_row8(const Fp8<K>* p) {
#if defined(__AVX2__) && defined(__FMA__)
  return {fp8_as_floats<K>(&p->byte)};
#else
  alignas(32) float x[8];
  for (int i = 0; i < 8; ++i) x[i] = fp8_as_float<K>(p[i].byte);
  return load8(x);
#endif
}

// n cached values as fp32, exactly: bf16 rows (kSame bf16 or kBF16) by a shift, fp8 bytes as
// load_row8 widens them (x 2^-E, without their scale).
template <KvKind K, typename C>
inline void widen_row(float* dst, const C* src, int64_t n) {
  int64_t i = 0;
  if constexpr (is_fp8(K)) {
#if defined(__AVX2__)
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(dst + i, fp8_as_floats<K>(src + i));
#endif
    for (; i < n; ++i) dst[i] = fp8_as_float<K>(src[i]);
  } else if constexpr (std::is_same_v<C, at::BFloat16>) {
#if defined(__AVX2__)
    for (; i + 8 <= n; i += 8) {
      const __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i)));
      _mm256_storeu_ps(dst + i, _mm256_castsi256_ps(_mm256_slli_epi32(w, 16)));
    }
#endif
    for (; i < n; ++i) dst[i] = static_cast<float>(src[i]);
  } else if constexpr (std::is_same_v<C, at::Half>) {
#if defined(__F16C__) && defined(__AVX2__)
    for (; i + 8 <= n; i += 8)
      _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i))));
#endif
    for (; i < n; ++i) dst[i] = static_cast<float>(src[i]);
  } else if constexpr (std::is_same_v<C, float>) {
    std::memcpy(dst, src, n * sizeof(float));
  } else {
    for (; i < n; ++i) dst[i] = static_cast<float>(src[i]);
  }
}

// A query head's online-softmax state: acc[0 .. dd), then the running max and the denominator.
inline int64_t state_stride(int64_t dd) { return dd + 8; }

inline void reset_state(float* s, int64_t dd) {
  std::fill(s, s + dd, 0.f);
  s[dd] = -std::numeric_limits<float>::infinity();
  s[dd + 1] = 0.f;
}

// Query rows' scores against a tile's keys: RC rows (dd apart) by KJ keys from key j0, each a
// chain of FMAs over the row, then its lanes summed in sums8's order. Any grouping of rows and
// keys gives each score the same bits.
template <int64_t D, int64_t RC, int64_t KJ, typename R>
inline void score_group(const float* q, int64_t dd, const R* const* keys, int64_t j0, int64_t n, float* scores,
                        int64_t stride) {
  if constexpr (D > 0) dd = D;
  const R* rows[KJ];
  for (int64_t jj = 0; jj < KJ; ++jj) rows[jj] = keys[std::min(j0 + jj, n - 1)];  // past n: unused
  F8 dots[RC][KJ];
  for (int64_t r = 0; r < RC; ++r)
    for (int64_t jj = 0; jj < KJ; ++jj) dots[r][jj] = set8(0.f);
  for (int64_t c = 0; c < dd; c += 8) {
    F8 qs[RC];
    for (int64_t r = 0; r < RC; ++r) {
      qs[r] = load8(q + r * dd + c);
      if constexpr (!is_fp8_row<R>) in_register(qs[r]);  // fp8 rows: measured faster folded
    }
    for (int64_t jj = 0; jj < KJ; ++jj) {
      const F8 key = load_row8(rows[jj] + c);
      for (int64_t r = 0; r < RC; ++r) dots[r][jj] = fma8(qs[r], key, dots[r][jj]);
    }
  }
  if constexpr (RC == 4 && KJ == 2) {  // the 8 sums in one tree: lanes 2 r, 2 r + 1 are row r's
    const F8 eight[8] = {dots[0][0], dots[0][1], dots[1][0], dots[1][1], dots[2][0], dots[2][1], dots[3][0], dots[3][1]};
    alignas(32) float sums[8];
    store8(sums, sums8(eight));
    for (int64_t r = 0; r < 4; ++r) std::memcpy(scores + r * stride + j0, sums + 2 * r, 2 * sizeof(float));
    return;
  }
  for (int64_t r = 0; r < RC; ++r) {
    if constexpr (KJ == 8) {
      store8(scores + r * stride + j0, sums8(dots[r]));
    } else if constexpr (KJ == 4) {
      sums4(scores + r * stride + j0, dots[r]);
    } else {  // KJ 2: sums4's order, its last two sums dropped
      const F8 four[4] = {dots[r][0], dots[r][1], dots[r][0], dots[r][1]};
      float sums[4];
      sums4(sums, four);
      std::memcpy(scores + r * stride + j0, sums, 2 * sizeof(float));
    }
  }
}

// Three rows' scores against keys 0 .. n (rounded up to 4) of a tile held as consecutive fp32 rows
// (D floats apart): score_group<D, 3, 4>'s arithmetic, with each query and K vector loaded once.
template <int64_t D>
__attribute__((noinline)) void score_rows3(const float* q, const float* k, int64_t n, float* scores, int64_t stride) {
  for (int64_t j0 = 0; j0 < n; j0 += 4) {
    F8 dots[3][4];
    for (int64_t r = 0; r < 3; ++r)
      for (int64_t jj = 0; jj < 4; ++jj) dots[r][jj] = set8(0.f);
#pragma GCC unroll 8
    for (int64_t c = 0; c < D; c += 8) {
      F8 qs[3];
      for (int64_t r = 0; r < 3; ++r) {
        qs[r] = load8(q + r * D + c);
        in_register(qs[r]);
      }
      for (int64_t jj = 0; jj < 4; ++jj) {
        F8 key = load8(k + (j0 + jj) * D + c);
        in_register(key);
        for (int64_t r = 0; r < 3; ++r) dots[r][jj] = fma8(qs[r], key, dots[r][jj]);
      }
    }
    for (int64_t r = 0; r < 3; ++r) sums4(scores + r * stride + j0, dots[r]);
  }
}

// A row's scores against KJ keys from j0, its query held in registers (qr).
template <int64_t D, int64_t KJ, typename R>
inline void score_keys(const F8* qr, const R* const* keys, int64_t j0, int64_t n_keys, float* scores) {
  const R* rows[KJ];
  for (int64_t jj = 0; jj < KJ; ++jj) rows[jj] = keys[std::min(j0 + jj, n_keys - 1)];
  F8 dots[KJ];
  for (int64_t jj = 0; jj < KJ; ++jj) dots[jj] = set8(0.f);
  for (int64_t c = 0; c < D / 8; ++c)
    for (int64_t jj = 0; jj < KJ; ++jj) dots[jj] = fma8(qr[c], load_row8(rows[jj] + 8 * c), dots[jj]);
  if constexpr (KJ == 8) {
    store8(scores + j0, sums8(dots));
  } else {
    sums4(scores + j0, dots);
  }
}

// One row's scores against keys 0 .. n (rounded up to 4), its query held in registers (D <= 64):
// 8 keys at a time (8 chains of FMAs in flight, what keeps both FMA pipes busy), the rest 4 at a time.
template <int64_t D, typename R>
inline void score_row(const float* q, const R* const* keys, int64_t n, int64_t n_keys, float* scores) {
  F8 qr[D / 8];
  for (int64_t c = 0; c < D / 8; ++c) qr[c] = load8(q + 8 * c);
  int64_t j0 = 0;
  for (; j0 + 8 <= n; j0 += 8) score_keys<D, 8>(qr, keys, j0, n_keys, scores);
  for (; j0 < n; j0 += 4) score_keys<D, 4>(qr, keys, j0, n_keys, scores);
}

// Query rows that go through a tile's three stages together: their queries, scores and states
// stay in L1 beside the tile's K and V rows.
constexpr int64_t kRowBlock = 12;

// Up to kRowBlock rows' softmax over their scores of a tile (row i: n[i] scores, `stride` apart;
// its state S apart), each folded into its state: the running max and denominator move on, the
// accumulator is scaled by the correction, and the scores become the probabilities. Phase by
// phase across the rows (maxima, probabilities, states), so that the rows' independent chains
// overlap where one row's would wait on their latency; each row's arithmetic is its own. One
// function for every caller, so that no inlining changes that arithmetic. kFactors (fp8 caches):
// each score is the one given x f.score, and the probabilities are stored x f.prob (the states'
// denominators sum them without it).
struct Factors {
  float score = 1.f, prob = 1.f;
};
template <bool kFactors>
__attribute__((noinline)) void softmax_rows(float* sc, int64_t stride, const int64_t* n, int64_t rows, float* st,
                                            int64_t S, int64_t dd, Factors f) {
  const F8 sf = set8(f.score), pf = set8(f.prob);
  auto score8 = [&](const float* p) { return kFactors ? mul8(load8(p), sf) : load8(p); };
  float top[kRowBlock], total[kRowBlock];
  for (int64_t i = 0; i < rows; ++i) {
    const float* row = sc + i * stride;
    const float old = st[i * S + dd];
    F8 tops = set8(old);
    int64_t j0 = 0;
    for (; j0 + 8 <= n[i]; j0 += 8) tops = max8(tops, score8(row + j0));  // whole vectors: no lanes to mask
    if (j0 < n[i]) tops = max8(tops, first8_or(score8(row + j0), n[i] - j0, old));
    top[i] = max_of(tops);
  }
  for (int64_t i = 0; i < rows; ++i) {
    float* row = sc + i * stride;
    const F8 log2e = set8(kLog2e), shift = set8(-top[i] * kLog2e);  // exp(x - top) as 2^(x log2 e - top log2 e)
    F8 sum = set8(0.f);
    int64_t j0 = 0;
    for (; j0 + 8 <= n[i]; j0 += 8) {
      const F8 p = exp2_8(fma8(score8(row + j0), log2e, shift));
      store8(row + j0, kFactors ? mul8(p, pf) : p);
      sum = add8(sum, p);
    }
    if (j0 < n[i]) {
      const F8 p = first8(exp2_8(fma8(score8(row + j0), log2e, shift)), n[i] - j0);
      store8(row + j0, kFactors ? mul8(p, pf) : p);
      sum = add8(sum, p);
    }
    total[i] = sum8(sum);
  }
  for (int64_t i = 0; i < rows; ++i) {
    float* s = st + i * S;
    const float correction = exp1(s[dd] - top[i]);
    s[dd + 1] = std::fma(s[dd + 1], correction, total[i]);
    s[dd] = top[i];
    const F8 cv = set8(correction);
    for (int64_t c = 0; c < dd; c += 8) store8(s + c, mul8(load8(s + c), cv));
  }
}

// RC rows' accumulators (dims c .. c + 8 WC) += their probabilities x V, keys j0 .. j1 in order:
// a chain of FMAs per row and 8 dims.
template <int64_t RC, int64_t WC, typename R>
inline void value_group(const float* p, int64_t stride, const R* const* values, int64_t j0, int64_t j1, int64_t c,
                        float* states, int64_t S) {
  F8 acc[RC][WC];
  for (int64_t r = 0; r < RC; ++r)
    for (int64_t w = 0; w < WC; ++w) acc[r][w] = load8(states + r * S + c + 8 * w);
  for (int64_t j = j0; j < j1; ++j) {
    F8 row[WC];
    for (int64_t w = 0; w < WC; ++w) row[w] = load_row8(values[j] + c + 8 * w);
    for (int64_t r = 0; r < RC; ++r) {
      const F8 pr = set8(p[r * stride + j]);
      for (int64_t w = 0; w < WC; ++w) acc[r][w] = fma8(pr, row[w], acc[r][w]);
    }
  }
  for (int64_t r = 0; r < RC; ++r)
    for (int64_t w = 0; w < WC; ++w) store8(states + r * S + c + 8 * w, acc[r][w]);
}

template <int64_t RC, int64_t WC, typename R>
void value_rows(const float* p, int64_t stride, const R* const* values, const int64_t* n, int64_t dd, float* states,
                int64_t S) {
  const int64_t common = *std::min_element(n, n + RC);
  int64_t c = 0;
  for (; c + 8 * WC <= dd; c += 8 * WC) value_group<RC, WC>(p, stride, values, 0, common, c, states, S);
  for (; c < dd; c += 8) value_group<RC, 1>(p, stride, values, 0, common, c, states, S);
  for (int64_t r = 0; r < RC; ++r)  // a row's keys past the others' (the causal edge): its own chain goes on
    if (n[r] > common)
      for (int64_t c1 = 0; c1 < dd; c1 += 8)
        value_group<1, 1>(p + r * stride, stride, values, common, n[r], c1, states + r * S, S);
}

// Keys of a tile: an online-softmax step, aligned to absolute positions (0, 64, 128, ...) and to
// the partitions' bounds, whatever the blocks.
constexpr int64_t kTile = 64;
// The K and V rows of the next tile, prefetched (to L2) while this one is walked: whole rows of
// the unit's KV heads (`bytes`, consecutive in a token's row), so that each block is read from
// memory as one sweep rather than a head's slice at a time, a head's share (`share` bytes a row)
// with each group of scores: requests for a whole tile at once, a burst, measured slower.
struct Ahead {
  const char* k[kTile];
  const char* v[kTile];
  int64_t n = 0, bytes = 0, share = 0;
  int64_t row = 0, offset = 0;  // the next line to request
  void aim_at(int64_t rows) { n = rows, row = offset = 0; }
  // `count` rows' worth of a head's share.
  void request(int64_t count) {
    for (int64_t left = count * share; left > 0 && row < n; left -= 64) {
      _mm_prefetch(k[row] + offset, _MM_HINT_T1);
      _mm_prefetch(v[row] + offset, _MM_HINT_T1);
      offset += 64;
      if (offset >= bytes) offset = 0, ++row;
    }
  }
};

// A tile of keys for `rows` query rows (dd floats apart; states state_stride apart), `group` rows
// a token: row i sees the tile's first min(n_keys, n_first + i / group) keys (the causal edge of a
// prefill chunk), at least one. `keys` and `values`: the tile's K and V rows. `scores`: room for
// kRowBlock x kTile. Rows go through the tile kRowBlock at a time, a few rows and keys in each
// group of FMAs, so that each K and V row loaded serves several rows and many FMAs are in flight
// at once; each row's arithmetic is its own all the same (score_group, softmax_rows, value_group),
// whatever the grouping: a decode's rows and a prefill chunk's give the same bits.
template <int64_t D, typename R>
__attribute__((noinline)) void tile_step(const float* q, int64_t dd, int64_t rows, int64_t group, int64_t n_first,
                                         int64_t n_keys, const R* const* keys, const R* const* values, float* states,
                                         float* scores, Ahead& ahead, Factors f) {
  if constexpr (D > 0) dd = D;
  const int64_t S = state_stride(dd), stride = (n_keys + 7) / 8 * 8;
  for (int64_t i0 = 0; i0 < rows; i0 += kRowBlock) {
    const int64_t rr = std::min<int64_t>(kRowBlock, rows - i0);
    auto keys_of = [&](int64_t i) { return std::min(n_keys, n_first + (i0 + i) / group); };
    const float* qc = q + i0 * dd;
    float* sc = states + i0 * S;
    int64_t i = 0;
    // Prefill's fp32 keys (a tile's consecutive rows): 3 rows at a time, then a row at a time with
    // its query in registers (a decode's few rows share key loads below).
    if constexpr (D > 0 && D <= 64 && std::is_same_v<R, float>) {
      for (; rows > group && i + 3 <= rr; i += 3) {
        score_rows3<D>(qc + i * dd, keys[0], keys_of(i + 2), scores + i * stride, stride);  // Scratch::k
        ahead.request(12);
      }
      for (; rows > group && i < rr; ++i) {
        score_row<D>(qc + i * dd, keys, keys_of(i), n_keys, scores + i * stride);
        ahead.request(8);
      }
    }
    // A decode's rows of a KV head (GQA): 4 rows a key, each K row loaded (widened) once for them.
    for (; i + 4 <= rr; i += 4) {
      const int64_t n = keys_of(i + 3);
      for (int64_t j0 = 0; j0 < n; j0 += 2) {
        score_group<D, 4, 2>(qc + i * dd, dd, keys, j0, n_keys, scores + i * stride, stride);
        ahead.request(2);
      }
    }
    for (; i + 3 <= rr; i += 3) {
      const int64_t n = keys_of(i + 2);
      for (int64_t j0 = 0; j0 < n; j0 += 4) {
        score_group<D, 3, 4>(qc + i * dd, dd, keys, j0, n_keys, scores + i * stride, stride);
        ahead.request(4);
      }
    }
    for (; i + 2 <= rr; i += 2) {
      const int64_t n = keys_of(i + 1);
      for (int64_t j0 = 0; j0 < n; j0 += 4) {
        score_group<D, 2, 4>(qc + i * dd, dd, keys, j0, n_keys, scores + i * stride, stride);
        ahead.request(4);
      }
    }
    for (; i < rr; ++i)
      for (int64_t j0 = 0; j0 < keys_of(i); j0 += 8) {
        score_group<D, 1, 8>(qc + i * dd, dd, keys, j0, n_keys, scores + i * stride, stride);
        ahead.request(8);
      }
    int64_t counts[kRowBlock];
    for (i = 0; i < rr; ++i) counts[i] = keys_of(i);
    if (f.score == 1.f && f.prob == 1.f) {
      softmax_rows<false>(scores, stride, counts, rr, sc, S, dd, f);
    } else {
      softmax_rows<true>(scores, stride, counts, rr, sc, S, dd, f);
    }
    for (i = 0; i < rr;) {  // 6 rows x 16 dims of accumulators at a time: 12 registers
      const int64_t rc = std::min<int64_t>(6, rr - i);
      int64_t n[6];
      for (int64_t r = 0; r < rc; ++r) n[r] = keys_of(i + r);
      const float* p = scores + i * stride;
      float* st = sc + i * S;
      switch (rc) {
        case 6: value_rows<6, 2>(p, stride, values, n, dd, st, S); break;
        case 5: value_rows<5, 2>(p, stride, values, n, dd, st, S); break;
        case 4: value_rows<4, 2>(p, stride, values, n, dd, st, S); break;
        case 3: value_rows<3, 2>(p, stride, values, n, dd, st, S); break;
        case 2: value_rows<2, 4>(p, stride, values, n, dd, st, S); break;
        default: value_rows<1, 8>(p, stride, values, n, dd, st, S); break;
      }
      i += rc;
    }
  }
}

// total = total (+) part: two online-softmax states of adjacent ranges, in that order.
__attribute__((noinline)) inline void fold(float* total, const float* part, int64_t dd) {
  const float top = std::max(total[dd], part[dd]);
  const float ct = exp1(total[dd] - top), cp = exp1(part[dd] - top);
  total[dd + 1] = std::fma(total[dd + 1], ct, part[dd + 1] * cp);
  const F8 a = set8(ct), b = set8(cp);
  for (int64_t c = 0; c < dd; c += 8) store8(total + c, fma8(load8(total + c), a, mul8(load8(part + c), b)));
  total[dd] = top;
}

// out = the state's accumulator / its denominator; a sink (gpt-oss: a logit that joins the
// softmax's denominator and attends to nothing) adds exp(sink - max) to that denominator.
template <typename T>
__attribute__((noinline)) void finish(T* out, const float* state, int64_t d, int64_t dd, float out_scale,
                                      const float* sink) {
  const float inv = out_scale / (state[dd + 1] + (sink != nullptr ? std::exp(*sink - state[dd]) : 0.f));
  for (int64_t i = 0; i < d; ++i) out[i] = static_cast<T>(state[i] * inv);
}

// What every unit of one call shares.
struct Call {
  int64_t d, dd;  // head size; rounded up to 8 (the rows walks read)
  int64_t group, num_heads, num_kv_heads, block_size, token_stride, table_stride, part, window;
  // fp8 caches' K and V rows are their values x 2^-E (fp8_as_float); their 2^E and the layer's
  // scales are shared out as kFp8ScoreShare and kFp8ProbShare say.
  float scale;      // the query's: 1 / sqrt(d), and for fp8 caches its share of K's factor and scale
  Factors factors;  // the scores' and probabilities' (1 but for fp8 caches)
  float out_scale;  // the result's: 1, and for fp8 caches its share of V's factor and scale
  const float* sinks;  // a logit per query head (gpt-oss), or null
  const int32_t* tables;
  float* partials;            // split units' states: [slot][query head] (state_stride(dd) floats each)
  const int64_t* first_slot;  // a query row's first slot, or -1 (its unit finishes it)
};

// A piece of work: `tokens` query tokens of one sequence (q rows from token0, positions from
// pos0), the query heads of KV heads h0 .. h0 + kv_count, partitions [part0, part1).
struct Unit {
  int64_t seq, token0, pos0, tokens, h0, kv_count, part0, part1;
  int64_t cost;  // rough: keys read x query rows served
};

// Per-thread buffers, sized for the largest unit. Query rows and states are laid out [KV head]
// [token][query head of the group], so that a KV head's rows are consecutive. `widen`: room for a
// tile's K and V rows widened to fp32 (caches not read in place).
struct Scratch {
  std::vector<float> q, part_states, total_states, scores, k, v;
  Scratch(const Call& c, int64_t max_rows, bool widen)
      : q(max_rows * c.dd), part_states(max_rows * state_stride(c.dd)), total_states(max_rows * state_stride(c.dd)),
        scores(kRowBlock * kTile), k(widen ? kTile * c.dd : 0), v(widen ? kTile * c.dd : 0) {}
};

// Whether a unit of `tokens` prompt tokens reads a cache of C in place: a decode's rows whose width
// is the walk's (bf16 and fp8 widened as loaded). Else each tile's rows are widened (or, fp32,
// copied) into Scratch::k and v as fp32, consecutive, which a prompt's many rows score a row at a
// time (score_row); widening is exact, so either way gives the same bits.
template <typename C>
bool read_in_place(const Call& c, int64_t tokens) {
  constexpr bool narrow = std::is_same_v<C, at::BFloat16> || std::is_same_v<C, uint8_t>;
  return c.d == c.dd && (std::is_same_v<C, float> || narrow) && tokens == 1;
}

// First position a token at `pos` attends to.
inline int64_t first_position(const Call& c, int64_t pos) {
  return c.window > 0 ? std::max<int64_t>(0, pos - c.window + 1) : 0;
}

// f(j, cache row) for the positions from .. to (j from 0): a block's rows are consecutive.
template <typename F>
inline void for_rows(const Call& c, const int32_t* table, int64_t from, int64_t to, F f) {
  for (int64_t pos = from; pos <= to;) {
    const int64_t offset = pos % c.block_size, count = std::min(c.block_size - offset, to - pos + 1);
    const int64_t row0 = static_cast<int64_t>(table[pos / c.block_size]) * c.block_size + offset;
    for (int64_t j = 0; j < count; ++j) f(pos - from + j, row0 + j);
    pos += count;
  }
}

// R: the rows' type as the tile reads them: bf16 or Fp8<K> where such a cache is read in place,
// else fp32 (read_in_place says which the unit takes).
template <typename T, KvKind K, int64_t D, typename R>
void walk_unit(const Call& c, const Unit& u, const T* q, const CacheT<K, T>* k_cache, const CacheT<K, T>* v_cache,
               T* out, Scratch& s) {
  using C = CacheT<K, T>;
  const int64_t dd = D > 0 ? D : c.dd, S = state_stride(dd), G = c.group;
  const int64_t rows = u.tokens * G;  // a KV head's query rows
  const bool in_place = !std::is_same_v<R, float> || read_in_place<C>(c, u.tokens);
  auto at = [&](int64_t h, int64_t r, int64_t g) { return (h * u.tokens + r) * G + g; };  // scratch row
  auto query_head = [&](int64_t h, int64_t g) { return (u.h0 + h) * G + g; };
  for (int64_t h = 0; h < u.kv_count; ++h)
    for (int64_t r = 0; r < u.tokens; ++r)
      for (int64_t g = 0; g < G; ++g) {
        const T* src = q + ((u.token0 + r) * c.num_heads + query_head(h, g)) * c.d;
        float* dst = s.q.data() + at(h, r, g) * dd;
        for (int64_t i = 0; i < c.d; ++i) dst[i] = static_cast<float>(src[i]) * c.scale;
        std::fill(dst + c.d, dst + dd, 0.f);
      }
  const int32_t* table = c.tables + u.seq * c.table_stride;
  const int64_t last = u.pos0 + u.tokens - 1;
  const int64_t first = first_position(c, u.pos0);  // a run's tokens share it (run_split's rule)
  const int64_t end = std::min(last, u.part1 * c.part - 1);  // the unit's last key
  const R* key_rows[kTile];
  const R* value_rows[kTile];
  Ahead ahead;
  ahead.share = c.d * static_cast<int64_t>(sizeof(C));
  ahead.bytes = u.kv_count * ahead.share;
  auto aim = [&](int64_t from, int64_t to) {  // `ahead` at the rows of positions [from, to]
    int64_t rows = 0;
    for_rows(c, table, from, to, [&](int64_t j, int64_t row) {
      ahead.k[j] = reinterpret_cast<const char*>(k_cache + row * c.token_stride + u.h0 * c.d);
      ahead.v[j] = reinterpret_cast<const char*>(v_cache + row * c.token_stride + u.h0 * c.d);
      rows = j + 1;
    });
    ahead.aim_at(rows);
  };
  for (int64_t p = u.part0; p < u.part1; ++p) {
    const int64_t plo = std::max(first, p * c.part), phi = std::min(last, (p + 1) * c.part - 1);
    for (int64_t i = 0; i < u.kv_count * rows; ++i) reset_state(s.part_states.data() + i * S, dd);
    for (int64_t lo = plo, hi; lo <= phi; lo = hi + 1) {
      hi = std::min(phi, (lo / kTile + 1) * kTile - 1);
      const int64_t n_keys = hi - lo + 1, r0 = std::max<int64_t>(0, lo - u.pos0);  // r0: the first token seeing it
      if (lo == plo && p == u.part0) {  // the unit's first tile: no earlier one asked for it
        aim(lo, hi);
        ahead.request(kTile * u.kv_count);
      }
      aim(hi + 1, std::min(end, hi + kTile));  // its heads' steps request it, a share each
      for (int64_t h = 0; h < u.kv_count; ++h) {
        const int64_t head = u.h0 + h;
        for_rows(c, table, lo, hi, [&](int64_t j, int64_t row) {
          const C* k_row = k_cache + row * c.token_stride + head * c.d;
          const C* v_row = v_cache + row * c.token_stride + head * c.d;
          if (in_place) {
            key_rows[j] = reinterpret_cast<const R*>(k_row);
            value_rows[j] = reinterpret_cast<const R*>(v_row);
            return;
          }
          float* k_wide = s.k.data() + j * dd;
          float* v_wide = s.v.data() + j * dd;
          widen_row<K>(k_wide, k_row, c.d);
          widen_row<K>(v_wide, v_row, c.d);
          std::fill(k_wide + c.d, k_wide + dd, 0.f);
          std::fill(v_wide + c.d, v_wide + dd, 0.f);
          key_rows[j] = reinterpret_cast<const R*>(k_wide);
          value_rows[j] = reinterpret_cast<const R*>(v_wide);
        });
        const int64_t row0 = at(h, r0, 0);
        tile_step<D, R>(s.q.data() + row0 * dd, dd, (u.tokens - r0) * G, G, u.pos0 + r0 - lo + 1, n_keys, key_rows,
                        value_rows, s.part_states.data() + row0 * S, s.scores.data(), ahead, c.factors);
        ahead.request(kTile);  // what the scores did not
      }
    }
    for (int64_t r = 0; r < u.tokens; ++r) {
      if (u.pos0 + r < plo) continue;
      const int64_t token = u.token0 + r;
      for (int64_t h = 0; h < u.kv_count; ++h)
        for (int64_t g = 0; g < G; ++g) {
          const int64_t i = at(h, r, g);
          const float* part = s.part_states.data() + i * S;
          if (c.first_slot[token] >= 0) {  // a split unit: one partition, folded later
            const int64_t slot = c.first_slot[token] + p - first / c.part;
            std::memcpy(c.partials + (slot * c.num_heads + query_head(h, g)) * S, part, S * sizeof(float));
          } else if (p == u.part0) {
            std::memcpy(s.total_states.data() + i * S, part, S * sizeof(float));
          } else {
            fold(s.total_states.data() + i * S, part, dd);
          }
        }
    }
  }
  for (int64_t r = 0; r < u.tokens && c.first_slot[u.token0 + r] < 0; ++r)
    for (int64_t h = 0; h < u.kv_count; ++h)
      for (int64_t g = 0; g < G; ++g)
        finish(out + ((u.token0 + r) * c.num_heads + query_head(h, g)) * c.d,
               s.total_states.data() + at(h, r, g) * S, c.d, dd, c.out_scale,
               c.sinks != nullptr ? c.sinks + query_head(h, g) : nullptr);
}

// A split token's query head: its partitions' states folded in order, then finished.
template <typename T>
void fold_partials(const Call& c, int64_t token, int64_t head, int64_t slots, T* out, float* total) {
  const int64_t S = state_stride(c.dd);
  const float* first = c.partials + (c.first_slot[token] * c.num_heads + head) * S;
  std::memcpy(total, first, S * sizeof(float));
  for (int64_t p = 1; p < slots; ++p) fold(total, first + p * c.num_heads * S, c.dd);
  finish(out + (token * c.num_heads + head) * c.d, total, c.d, c.dd, c.out_scale,
         c.sinks != nullptr ? c.sinks + head : nullptr);
}

}  // namespace attention_walk
