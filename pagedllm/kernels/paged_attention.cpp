// Paged attention on CPU: each query token attends to its sequence's keys and values read in
// place from the block-table-addressed KV cache (no gather into a contiguous tensor).
// Serves prefill chunks and decodes alike: a sequence contributes `q_len` query tokens that sit
// at the end of its `seq_len` tokens of context (causal within the chunk).
// Batch invariance: a query token's result is one fixed order of operations over its context
// (the keys from its first position in tiles of fixed size, each tile's arithmetic the same; in
// attention_walk.h's walk, in partitions aligned to absolute positions, folded in order), so
// it is bit for bit the same as a decode, a prefill chunk's token (whatever the chunk), a
// recompute after preemption or a speculative verification's, alone or beside any others. A
// faster kernel for many query rows must keep that order.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include <omp.h>

#include "attention_walk.h"
#include "kv_quant.h"
#include "work_split.h"

namespace {

// Per-thread buffers a walk may use: the row offsets of a whole context.
struct Scratch {
  int64_t* rows;
};

// exp(x) for x <= 0 as plain arithmetic, so that loops of it vectorize (std::exp does not here):
// 2^(x log2 e) split into an integer power, set in the exponent bits, and a fraction, by a
// degree-6 polynomial. Relative error below 3e-7; x below -87 (and -inf) gives exp(-87).
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


// The vector kernels' sizes (used by the dispatch below in every build).
constexpr int64_t kTile = 16;         // keys a step of the vector walks
constexpr int64_t kMaxWalkHeads = 8;  // KV heads one decode walk serves


#if defined(__AVX512BF16__)
// The same walk for bf16 caches in AVX-512 (BF16) intrinsics. Keys are taken 16 at a time (a
// tile, across block boundaries): each query head's dot products with them are bf16 pair dot
// products into fp32 lanes, and one transpose-and-add tree turns the 16 lane vectors into the 16
// scores, instead of a horizontal sum per key. Softmax runs in fp32. The weighted sum of V takes
// the probabilities rounded to bf16, as Hugging Face's eager attention rounds them before its
// product with V, two keys per dpbf16, summing in fp32: 0.98-1.21x (mostly 1.05-1.2x) the speed
// of fp32 products of every key per layer call, in same-process runs on kernels.py's shapes.

// exp(x) for x <= 0, 16 lanes: the polynomial of fast_exp, with the power of two set by scalef.
inline __m512 exp_neg(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.f));
  const __m512 t = _mm512_mul_ps(x, _mm512_set1_ps(1.44269504f));
  const __m512 fi = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(t, fi);
  __m512 p = _mm512_set1_ps(1.5353362e-4f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.3398874e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.6181291e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5504109e-2f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4022652e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9314718e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, fi);
}

// Lane j of the result: the sum of the 16 lanes of v[j].
inline __m512 sum_each(const __m512* v) {
  __m512 pairs[8], quads[4];
  for (int i = 0; i < 8; ++i)  // each 128-bit lane: partials of v[2i], v[2i+1], v[2i], v[2i+1]
    pairs[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  for (int i = 0; i < 4; ++i) {  // each 128-bit lane: partials of v[4i .. 4i + 3]
    const __m512d a = _mm512_castps_pd(pairs[2 * i]), b = _mm512_castps_pd(pairs[2 * i + 1]);
    quads[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)), _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
  }
  // Then across the four 128-bit lanes: 0x88 takes lanes 0 and 2 of each input, 0xDD lanes 1 and 3.
  const __m512 lo = _mm512_add_ps(_mm512_shuffle_f32x4(quads[0], quads[1], 0x88), _mm512_shuffle_f32x4(quads[0], quads[1], 0xDD));
  const __m512 hi = _mm512_add_ps(_mm512_shuffle_f32x4(quads[2], quads[3], 0x88), _mm512_shuffle_f32x4(quads[2], quads[3], 0xDD));
  return _mm512_add_ps(_mm512_shuffle_f32x4(lo, hi, 0x88), _mm512_shuffle_f32x4(lo, hi, 0xDD));
}

#if defined(__AVX512VBMI__)
#define PAGEDLLM_FP8_IN_REGISTERS 1
// An fp8 format's 128 magnitudes as the high and low bytes of their bf16 values (exact: bf16
// holds every e4m3 and e5m2 value), in the two halves a byte permute (vpermi2b) looks up.
struct Fp8Lut {
  __m512i hi0, hi1, lo0, lo1;
};

template <KvKind K>
Fp8Lut make_fp8_lut() {
  alignas(64) uint8_t hi[128], lo[128];
  for (int i = 0; i < 128; ++i) {
    const float f = from_fp8<K>(static_cast<uint8_t>(i), 1.f);
    uint32_t bits;
    std::memcpy(&bits, &f, sizeof bits);
    hi[i] = static_cast<uint8_t>(bits >> 24);
    lo[i] = static_cast<uint8_t>(bits >> 16);
  }
  return {_mm512_load_si512(hi), _mm512_load_si512(hi + 64), _mm512_load_si512(lo), _mm512_load_si512(lo + 64)};
}

// 64 fp8 bytes -> their values as two bf16 vectors, in the order byte unpacking leaves them: in
// 128-bit lane L, a holds dims 16L..16L+7 and b dims 16L+8..16L+15. Two lookups, the sign, two
// unpacks: a few instructions for 64 values, so that a decode reads half the bytes of a bf16
// cache without paying for it in arithmetic.
inline void widen64(const uint8_t* src, const Fp8Lut& lut, __m512i& a, __m512i& b) {
  const __m512i x = _mm512_loadu_si512(reinterpret_cast<const void*>(src));
  const __m512i lo = _mm512_permutex2var_epi8(lut.lo0, x, lut.lo1);  // index bit 7 (the sign) unused
  __m512i hi = _mm512_permutex2var_epi8(lut.hi0, x, lut.hi1);
  hi = _mm512_ternarylogic_epi32(hi, x, _mm512_set1_epi8(static_cast<char>(0x80)), 0xF8);  // hi | (x & 0x80)
  a = _mm512_unpacklo_epi8(lo, hi);
  b = _mm512_unpackhi_epi8(lo, hi);
}
#endif

template <int64_t D, int64_t G>
struct Bf16Walk {
  static constexpr int64_t kChunks = D / 32;  // bf16 vectors in a row
  static constexpr int64_t kLanes = D / 16;   // fp32 vectors in a row
  __m512bh q[G][kChunks];
  __m512 acc[G][kLanes];
  float running_max[G], denom[G];
  alignas(64) float probs[G][kTile];

  // fp8: q's dims in widen64's order (a, then b, of each 64 dims), so that keys need no reordering.
  template <KvKind K>
  void start(const at::BFloat16* query) {
    for (int64_t g = 0; g < G; ++g) {
      for (int64_t c = 0; c < kChunks; ++c)
        q[g][c] = (__m512bh)_mm512_loadu_si512(reinterpret_cast<const void*>(query + g * D + c * 32));
      if constexpr (K != KvKind::kSame) {
        alignas(64) int16_t order_a[32], order_b[32];
        for (int i = 0; i < 32; ++i) {
          order_a[i] = static_cast<int16_t>(16 * (i / 8) + i % 8);
          order_b[i] = static_cast<int16_t>(order_a[i] + 8);
        }
        const __m512i ia = _mm512_load_si512(order_a), ib = _mm512_load_si512(order_b);
        for (int64_t c = 0; c < kChunks; c += 2) {
          const __m512i q0 = (__m512i)q[g][c], q1 = (__m512i)q[g][c + 1];
          q[g][c] = (__m512bh)_mm512_permutex2var_epi16(q0, ia, q1);
          q[g][c + 1] = (__m512bh)_mm512_permutex2var_epi16(q0, ib, q1);
        }
      }
      for (int64_t c = 0; c < kLanes; ++c) acc[g][c] = _mm512_setzero_ps();
      running_max[g] = -std::numeric_limits<float>::infinity();
      denom[g] = 0.f;
    }
  }

  // n <= kTile keys at these row offsets (missing ones repeat the first and are masked out).
  void tile(const at::BFloat16* k_cache, const at::BFloat16* v_cache, const int64_t* rows, int64_t n, float scale) {
    const __mmask16 valid = static_cast<__mmask16>((1u << n) - 1);
    // Each step below for all G heads before the next, so that the heads' dependency chains
    // (reductions, the scalar max, exp) run side by side instead of one after another: decodes
    // whose K/V the cache holds (a shared prefix) 1.3x; from memory the reads set the pace.
    __m512 scores[G];
    for (int64_t g = 0; g < G; ++g) {
      __m512 dots[kTile];
      for (int64_t j = 0; j < kTile; ++j) {
        const at::BFloat16* k = k_cache + rows[j < n ? j : 0];
        __m512 sum = _mm512_setzero_ps();
        for (int64_t c = 0; c < kChunks; ++c)
          sum = _mm512_dpbf16_ps(sum, q[g][c], (__m512bh)_mm512_loadu_si512(reinterpret_cast<const void*>(k + c * 32)));
        dots[j] = sum;
      }
      scores[g] = _mm512_mul_ps(sum_each(dots), _mm512_set1_ps(scale));
    }
    alignas(64) uint32_t pairs[G][kTile / 2];
    update(scores, valid, pairs);
    // V by key pairs: the two rows interleaved (unpack within 128-bit lanes), each query head's
    // two probabilities, rounded to bf16, as one pair: one dpbf16 per 16 dims per head.
    for (int64_t j = 0; j < n; j += 2) {
      const at::BFloat16* v0 = v_cache + rows[j];
      const at::BFloat16* v1 = v_cache + rows[j + 1 < n ? j + 1 : j];
      __m512i mixed[kLanes];
      for (int64_t c = 0; c < kChunks; ++c) {
        const __m512i r0 = _mm512_loadu_si512(reinterpret_cast<const void*>(v0 + c * 32));
        const __m512i r1 = _mm512_loadu_si512(reinterpret_cast<const void*>(v1 + c * 32));
        mixed[2 * c] = _mm512_unpacklo_epi16(r0, r1);
        mixed[2 * c + 1] = _mm512_unpackhi_epi16(r0, r1);
      }
      accumulate(pairs, j, mixed);
    }
  }

#if defined(PAGEDLLM_FP8_IN_REGISTERS)
  // The same over fp8 rows, widened in registers (widen64); `scale` includes K's cache scale,
  // V's is applied by finish.
  void tile(const uint8_t* k_cache, const uint8_t* v_cache, const int64_t* rows, int64_t n, float scale,
            const Fp8Lut& lut) {
    const __mmask16 valid = static_cast<__mmask16>((1u << n) - 1);
    __m512i keys[kTile][kChunks];  // widened once for all G heads
    for (int64_t j = 0; j < kTile; ++j)
      for (int64_t c = 0; c < kChunks; c += 2) widen64(k_cache + rows[j < n ? j : 0] + 32 * c, lut, keys[j][c], keys[j][c + 1]);
    __m512 scores[G];
    for (int64_t g = 0; g < G; ++g) {
      __m512 dots[kTile];
      for (int64_t j = 0; j < kTile; ++j) {
        __m512 sum = _mm512_setzero_ps();
        for (int64_t c = 0; c < kChunks; ++c) sum = _mm512_dpbf16_ps(sum, q[g][c], (__m512bh)keys[j][c]);
        dots[j] = sum;
      }
      scores[g] = _mm512_mul_ps(sum_each(dots), _mm512_set1_ps(scale));
    }
    alignas(64) uint32_t pairs[G][kTile / 2];
    update(scores, valid, pairs);
    // acc[g][4c' + s] lane 4L + m then holds dim 64c' + 16L + 4s + m (finish_fp8).
    for (int64_t j = 0; j < n; j += 2) {
      __m512i mixed[kLanes];
      for (int64_t c = 0; c < kChunks; c += 2) {
        __m512i a0, b0, a1, b1;
        widen64(v_cache + rows[j] + 32 * c, lut, a0, b0);
        widen64(v_cache + rows[j + 1 < n ? j + 1 : j] + 32 * c, lut, a1, b1);
        mixed[2 * c] = _mm512_unpacklo_epi16(a0, a1);
        mixed[2 * c + 1] = _mm512_unpackhi_epi16(a0, a1);
        mixed[2 * c + 2] = _mm512_unpacklo_epi16(b0, b1);
        mixed[2 * c + 3] = _mm512_unpackhi_epi16(b0, b1);
      }
      accumulate(pairs, j, mixed);
    }
  }
#endif

  // The online softmax over one tile's scores (keys outside `valid` weigh 0): rescales acc and
  // gives each head's probabilities, rounded to bf16, by key pairs.
  void update(const __m512 (&raw)[G], __mmask16 valid, uint32_t (&pairs)[G][kTile / 2]) {
    __m512 scores[G];
    for (int64_t g = 0; g < G; ++g)
      scores[g] = _mm512_mask_mov_ps(_mm512_set1_ps(-std::numeric_limits<float>::infinity()), valid, raw[g]);
    float new_max[G], correction[G];
    for (int64_t g = 0; g < G; ++g) new_max[g] = std::max(running_max[g], _mm512_reduce_max_ps(scores[g]));
    for (int64_t g = 0; g < G; ++g) correction[g] = fast_exp(running_max[g] - new_max[g]);
    __m512 p[G];
    for (int64_t g = 0; g < G; ++g)
      p[g] = _mm512_maskz_mov_ps(valid, exp_neg(_mm512_sub_ps(scores[g], _mm512_set1_ps(new_max[g]))));
    for (int64_t g = 0; g < G; ++g) {
      denom[g] = denom[g] * correction[g] + _mm512_reduce_add_ps(p[g]);
      running_max[g] = new_max[g];
      _mm512_store_ps(probs[g], p[g]);
      const __m512 corr = _mm512_set1_ps(correction[g]);
      for (int64_t c = 0; c < kLanes; ++c) acc[g][c] = _mm512_mul_ps(acc[g][c], corr);
    }
    for (int64_t g = 0; g < G; ++g)
      _mm256_store_si256(reinterpret_cast<__m256i*>(pairs[g]), (__m256i)_mm512_cvtneps_pbh(_mm512_load_ps(probs[g])));
  }

  // acc += the probabilities of keys j and j + 1 times their V rows, interleaved by key pairs.
  void accumulate(const uint32_t (&pairs)[G][kTile / 2], int64_t j, const __m512i (&mixed)[kLanes]) {
    for (int64_t g = 0; g < G; ++g) {
      const __m512bh p = (__m512bh)_mm512_set1_epi32(static_cast<int>(pairs[g][j / 2]));
      for (int64_t c = 0; c < kLanes; ++c) acc[g][c] = _mm512_dpbf16_ps(acc[g][c], p, (__m512bh)mixed[c]);
    }
  }

  // Lane i of acc[g][c] holds dim dim_of(c, i); out = acc / denom x v_scale, as bf16. With sinks
  // (gpt-oss: a logit per query head that joins each softmax's denominator and attends to
  // nothing), the denominator gains exp(sink - max).
  // bf16 rows: acc[g][2c] lane 4L + m holds dim 32c + 8L + m, acc[g][2c + 1] the dim 4 further.
  // fp8 rows (widen64): acc[g][4c + s] lane 4L + m holds dim 64c + 16L + 4s + m.
  template <KvKind K>
  void finish(at::BFloat16* out, float v_scale, const float* sinks) {
    for (int64_t g = 0; g < G; ++g) {
      alignas(64) float lanes[kLanes][16];
      const float sink = sinks != nullptr ? std::exp(sinks[g] - running_max[g]) : 0.f;
      const __m512 inv = _mm512_set1_ps(v_scale / (denom[g] + sink));
      for (int64_t c = 0; c < kLanes; ++c) _mm512_store_ps(lanes[c], _mm512_mul_ps(acc[g][c], inv));
      alignas(64) float row[D];
      for (int64_t c = 0; c < kLanes; ++c)
        for (int64_t l = 0; l < 4; ++l)
          for (int64_t m = 0; m < 4; ++m) {
            const int64_t dim = K == KvKind::kSame ? 32 * (c / 2) + 8 * l + 4 * (c % 2) + m
                                                   : 64 * (c / 4) + 16 * l + 4 * (c % 4) + m;
            row[dim] = lanes[c][4 * l + m];
          }
      for (int64_t c = 0; c < kLanes; ++c) {
        const __m256bh packed = _mm512_cvtneps_pbh(_mm512_load_ps(row + 16 * c));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + g * D + c * 16), (__m256i)packed);
      }
    }
  }
};

// Offsets of the cache rows of positions first..last, in order; returns how many.
inline int64_t context_rows(int64_t* rows, const int32_t* blocks, int64_t first, int64_t last, int64_t block_size,
                            int64_t token_stride) {
  int64_t n = 0;
  for (int64_t start = first - first % block_size; start <= last; start += block_size) {
    const int64_t lo = std::max(start, first), hi = std::min(start + block_size - 1, last);
    const int64_t base = static_cast<int64_t>(blocks[start / block_size]) * block_size + lo - start;
    for (int64_t j = 0; j <= hi - lo; ++j) rows[n++] = (base + j) * token_stride;
  }
  return n;
}

// Prefetch the first `row_bytes` of the K and V rows rows[begin..end), into L2: a tile's lines
// are more than L1's miss buffers hold, and into L1 the requests past them stall the walk
// (BENCHMARKS.md).
template <typename C>
inline void prefetch_rows(const C* k_cache, const C* v_cache, const int64_t* rows, int64_t begin, int64_t end,
                          int64_t row_bytes) {
  for (int64_t j = begin; j < end; ++j) {
    for (int64_t b = 0; b < row_bytes; b += 64) {
      _mm_prefetch(reinterpret_cast<const char*>(k_cache + rows[j]) + b, _MM_HINT_T1);
      _mm_prefetch(reinterpret_cast<const char*>(v_cache + rows[j]) + b, _MM_HINT_T1);
    }
  }
}

// Query tokens against their context for the query heads of `kv_count` KV heads: `tokens` of
// them (a run of one sequence's tokens: a prefill chunk's, a verification's; or 1) at positions
// pos .. pos + tokens - 1, rows `q_stride` apart, all from position `first`. The tile loop is outside the head loop, so that the
// K/V rows of all those heads (adjacent in the cache) are read together, as a stream, rather than
// one head's slice of each row at a time; and outside the token loop, so that a run's tokens take
// each tile from L1, read once for all of them. Each token's tiles and their arithmetic are those
// of its own walk (the same tiles from `first`, its last one cut at its position): a run's rows
// are bit for bit its tokens' decodes. fp8 rows are widened in registers (byte lookups: AVX512-VBMI).
template <int64_t D, int64_t G, KvKind K>
void walk_bf16(at::BFloat16* out, const at::BFloat16* q, const CacheT<K, at::BFloat16>* k_cache,
               const CacheT<K, at::BFloat16>* v_cache, const int32_t* blocks, int64_t pos, int64_t first,
               int64_t kv_count, int64_t tokens, int64_t q_stride, int64_t block_size, int64_t token_stride,
               float scale, KvScales kv, const float* sinks, Scratch& scratch) {
  const int64_t n = context_rows(scratch.rows, blocks, first, pos + tokens - 1, block_size, token_stride);
  const int64_t row_bytes = kv_count * D * static_cast<int64_t>(sizeof(*k_cache));
  Bf16Walk<D, G> walks[kMaxWalkHeads];  // [token][head]: tokens x kv_count <= kMaxWalkHeads
  for (int64_t r = 0; r < tokens; ++r)
    for (int64_t h = 0; h < kv_count; ++h) walks[r * kv_count + h].template start<K>(q + r * q_stride + h * G * D);
  for (int64_t t = 0; t < n; t += kTile) {
    // The next tile's K/V rows are requested while this one is computed: a share before each
    // head, then all of them once more at the end, which catches the requests that did not take
    // (a core keeps a few dozen misses in flight). Measured on 64 decodes x 1000 tokens from
    // memory: one burst of all the lines 3.5 ms a layer, the shares alone 2.2-2.5, shares and
    // the second pass 1.8; spread two at a time through the loops 2.4, and 1.8x slower than a
    // burst where the cache already held the rows.
    const int64_t next = std::min(n, t + kTile), next_n = std::min(kTile, n - next);
    const int64_t share = (next_n + kv_count - 1) / kv_count;
    for (int64_t h = 0; h < kv_count; ++h) {
      prefetch_rows(k_cache, v_cache, scratch.rows + next, std::min(next_n, h * share),
                    std::min(next_n, (h + 1) * share), row_bytes);
      for (int64_t r = 0; r < tokens; ++r) {
        const int64_t seen = pos + r - first + 1;  // the context rows token r attends to
        if (t >= seen) continue;
        const int64_t count = std::min(kTile, seen - t);
        if constexpr (K == KvKind::kSame) {
          walks[r * kv_count + h].tile(k_cache + h * D, v_cache + h * D, scratch.rows + t, count, scale);
        } else {
#if defined(PAGEDLLM_FP8_IN_REGISTERS)
          static const Fp8Lut lut = make_fp8_lut<K>();
          walks[r * kv_count + h].tile(k_cache + h * D, v_cache + h * D, scratch.rows + t, count, scale * kv.k, lut);
#endif
        }
      }
    }
    prefetch_rows(k_cache, v_cache, scratch.rows + next, 0, next_n, row_bytes);
  }
  for (int64_t r = 0; r < tokens; ++r)
    for (int64_t h = 0; h < kv_count; ++h)
      walks[r * kv_count + h].template finish<K>(out + r * q_stride + h * G * D, K == KvKind::kSame ? 1.f : kv.v,
                                                 sinks != nullptr ? sinks + h * G : nullptr);
}

#endif

template <typename T, KvKind K>
using WalkFn = void (*)(T*, const T*, const CacheT<K, T>*, const CacheT<K, T>*, const int32_t*, int64_t, int64_t,
                        int64_t, int64_t, int64_t, int64_t, int64_t, float, KvScales, const float*, Scratch&);

#define WALK_G(DD)                                \
  switch (group) {                                \
    case 1: return walk_of<DD, 1, K>();           \
    case 2: return walk_of<DD, 2, K>();           \
    case 3: return walk_of<DD, 3, K>();           \
    case 4: return walk_of<DD, 4, K>();           \
    case 8: return walk_of<DD, 8, K>();           \
    default: return nullptr;                      \
  }

#if defined(__AVX512BF16__)
// The walk for these rows: none for fp8 without byte lookups (the portable walk reads them).
template <int64_t D, int64_t G, KvKind K>
constexpr WalkFn<at::BFloat16, K> walk_of() {
#if defined(PAGEDLLM_FP8_IN_REGISTERS)
  return walk_bf16<D, G, K>;
#else
  return K == KvKind::kSame ? walk_bf16<D, G, K> : nullptr;
#endif
}
#endif

// The AVX-512 BF16 walk for this head size and group; null where there is none (other dtypes,
// head sizes or groups, or a build without AVX512-BF16).
template <typename T, KvKind K>
WalkFn<T, K> pick_walk(int64_t d, int64_t group) {
#if defined(__AVX512BF16__)
  if constexpr (std::is_same_v<T, at::BFloat16>) {
    if (d == 64) { WALK_G(64) }
    if (d == 128) { WALK_G(128) }
  }
#endif
  return nullptr;
}
#undef WALK_G

// How many of a sequence's q_len tokens each walk takes together: all of them (each K/V tile read
// once for the run) but at most `most`, and fewer where the runs' walks would otherwise be too few
// to keep the threads busy (a batch-1 verification over a few KV heads). Each token's arithmetic
// is its own walk's, however the tokens are grouped.
inline int64_t run_tokens(int64_t q_len, int64_t runs, int64_t kv_heads, int64_t threads, int64_t most) {
  const int64_t wanted = (2 * threads + runs * kv_heads - 1) / (runs * kv_heads);  // walks a run
  const int64_t parts = std::clamp<int64_t>(wanted, (q_len + most - 1) / most, q_len);
  return (q_len + parts - 1) / parts;
}

// The call's shapes and metadata, read once.
struct Shapes {
  int64_t num_tokens, num_heads, d, block_size, num_kv_heads, group, token_stride, table_stride, num_seqs, threads;
  const int32_t *qsl, *lens;
  Shapes(const torch::Tensor& q, const torch::Tensor& k_cache, const torch::Tensor& block_tables,
         const torch::Tensor& query_start_loc, const torch::Tensor& seq_lens)
      : num_tokens(q.size(0)), num_heads(q.size(1)), d(q.size(2)), block_size(k_cache.size(1)),
        num_kv_heads(k_cache.size(2)), group(num_heads / num_kv_heads), token_stride(num_kv_heads * d),
        table_stride(block_tables.size(1)), num_seqs(seq_lens.size(0)), threads(at::get_num_threads()),
        qsl(query_start_loc.data_ptr<int32_t>()), lens(seq_lens.data_ptr<int32_t>()) {}
  int64_t q_len(int64_t b) const { return qsl[b + 1] - qsl[b]; }
  // A sequence's tokens walk together (each K/V block read once for them) unless a sliding window
  // moves their first positions apart.
  bool is_run(int64_t b, int64_t window) const { return q_len(b) > 1 && (window == 0 || lens[b] <= window); }
};

#if defined(__AVX512BF16__)
// A piece of work for walk_bf16: `tokens` query tokens of one sequence from q's row token0 (at
// position pos0), for the query heads of `kv_count` KV heads from query head h0.
struct Bf16Unit {
  int64_t seq, token0, pos0, h0, kv_count;
  int64_t cost;  // rough: keys read x query rows served
  int64_t tokens = 1;
};

template <KvKind K>
void run_bf16(const WalkFn<at::BFloat16, K> walk_fn, torch::Tensor& out, const torch::Tensor& q,
              const torch::Tensor& k_cache, const torch::Tensor& v_cache, const torch::Tensor& block_tables,
              const Shapes& sh, double scale, int64_t sliding_window, KvScales kv, const float* sinks) {
  using C = CacheT<K, at::BFloat16>;
  const int64_t num_heads = sh.num_heads, group = sh.group, num_kv_heads = sh.num_kv_heads, threads = sh.threads;
  // A walk serves every KV head of its token when there are enough tokens to keep the threads
  // busy; a few decodes split their heads instead.
  const int64_t kv_per_walk = sh.num_tokens >= 4 * threads && num_kv_heads <= kMaxWalkHeads ? num_kv_heads : 1;
  int64_t runs = 0;
  for (int64_t b = 0; b < sh.num_seqs; ++b) runs += sh.is_run(b, sliding_window);
  std::vector<Bf16Unit> units;
  int64_t longest = 1;
  for (int64_t b = 0; b < sh.num_seqs; ++b) {
    const int64_t q_len = sh.q_len(b), pos0 = sh.lens[b] - q_len;
    longest = std::max<int64_t>(longest, sh.lens[b]);
    auto walked = [&](int64_t last) { return sliding_window > 0 ? std::min(last + 1, sliding_window) : last + 1; };
    if (sh.is_run(b, sliding_window)) {
      const int64_t per_walk = run_tokens(q_len, runs, num_kv_heads, threads, kMaxWalkHeads);
      for (int64_t t = 0; t < q_len; t += per_walk) {
        const int64_t tokens = std::min(per_walk, q_len - t);
        for (int64_t h0 = 0; h0 < num_heads; h0 += group)
          units.push_back({b, sh.qsl[b] + t, pos0 + t, h0, 1, walked(pos0 + t + tokens - 1) * group * tokens + 16, tokens});
      }
    } else {
      for (int64_t t = 0; t < q_len; ++t)
        for (int64_t h0 = 0; h0 < num_heads; h0 += kv_per_walk * group)
          units.push_back({b, sh.qsl[b] + t, pos0 + t, h0, kv_per_walk, walked(pos0 + t) * kv_per_walk * group + 16});
    }
  }
  if (units.empty()) return;
  const at::BFloat16* qp = q.data_ptr<at::BFloat16>();
  const C* kp = static_cast<const C*>(k_cache.data_ptr());
  const C* vp = static_cast<const C*>(v_cache.data_ptr());
  at::BFloat16* op = out.data_ptr<at::BFloat16>();
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  const int64_t d = sh.d;

  // Units are shared out by cost, so that one long sequence does not leave the other threads idle
  // at the end, and a thread that is done takes units from the others' shares (work_split.h): the
  // costs are rough, and a thread the OS preempts (a server's HTTP thread) would otherwise hold
  // the step up.
  std::vector<int64_t> costs(units.size());
  for (size_t u = 0; u < units.size(); ++u) costs[u] = units[u].cost;
  WorkSplit split(costs, static_cast<int>(std::min<int64_t>(threads, units.size())));
#pragma omp parallel num_threads(split.threads())
  {
    std::vector<int64_t> rows(longest);
    Scratch scratch{rows.data()};
    for (int64_t u = split.take(omp_get_thread_num()); u >= 0; u = split.take(omp_get_thread_num())) {
      const Bf16Unit& unit = units[u];
      const int32_t* table = tables + unit.seq * sh.table_stride;
      const int64_t kv_head = unit.h0 / group;
      const int64_t pos = unit.pos0;
      const int64_t first = sliding_window > 0 ? std::max<int64_t>(0, pos - sliding_window + 1) : 0;
      const int64_t offset = (unit.token0 * num_heads + unit.h0) * d;
      walk_fn(op + offset, qp + offset, kp + kv_head * d, vp + kv_head * d, table, pos, first, unit.kv_count,
              unit.tokens, num_heads * d, sh.block_size, sh.token_stride, static_cast<float>(scale), kv,
              sinks != nullptr ? sinks + unit.h0 : nullptr, scratch);
    }
  }
}
#endif

// Tokens of context a partition of the split walk holds (attention_walk.h), rounded up to whole
// blocks: fixed, since it decides each token's arithmetic.
constexpr int64_t kPartTokens = 256;
// Most query tokens of a sequence that walk its context together: each K/V tile is read once for
// all their rows (a long prompt's chunk re-reads its context once per run).
constexpr int64_t kRunTokens = 64;

// Everything but the AVX-512 BF16 walk's share: attention_walk.h's walk. Sequences whose tokens
// are few beside the threads (a batch of one or two long decodes) are split by partitions, each
// partition of each token a unit; the others walk all their partitions in one unit.
template <typename T, KvKind K>
void run_split(torch::Tensor& out, const torch::Tensor& q, const torch::Tensor& k_cache, const torch::Tensor& v_cache,
               const torch::Tensor& block_tables, const Shapes& sh, double scale, int64_t window, KvScales kv,
               const float* sinks) {
  namespace aw = attention_walk;
  using C = CacheT<K, T>;
  std::vector<int64_t> first_slot(sh.num_tokens, -1);
  aw::Call c{};
  c.d = sh.d;
  c.dd = (sh.d + 7) / 8 * 8;
  c.group = sh.group;
  c.num_heads = sh.num_heads;
  c.num_kv_heads = sh.num_kv_heads;
  c.block_size = sh.block_size;
  c.token_stride = sh.token_stride;
  c.table_stride = sh.table_stride;
  c.part = (kPartTokens + sh.block_size - 1) / sh.block_size * sh.block_size;
  c.window = window;
  c.scale = static_cast<float>(scale);
  c.out_scale = 1.f;
  if constexpr (is_fp8(K)) {  // the shares of K's and V's 2^E (Call)
    constexpr int E = fp8_float_exponent<K>();
    c.scale *= kv.k * std::ldexp(1.f, E - aw::kFp8ScoreShare);
    c.factors = {std::ldexp(1.f, aw::kFp8ScoreShare), std::ldexp(1.f, aw::kFp8ProbShare)};
    c.out_scale = kv.v * std::ldexp(1.f, E - aw::kFp8ProbShare);
  }
  c.sinks = sinks;
  c.tables = block_tables.data_ptr<int32_t>();
  c.first_slot = first_slot.data();

  struct Span {
    int64_t seq, token0, pos0, tokens;
  };
  std::vector<Span> spans;
  int64_t runs = 0;
  for (int64_t b = 0; b < sh.num_seqs; ++b) runs += sh.is_run(b, window);
  for (int64_t b = 0; b < sh.num_seqs; ++b) {
    const int64_t q_len = sh.q_len(b), pos0 = sh.lens[b] - q_len;
    const int64_t per = sh.is_run(b, window) ? run_tokens(q_len, runs, sh.num_kv_heads, sh.threads, kRunTokens) : 1;
    for (int64_t t = 0; t < q_len; t += per) spans.push_back({b, sh.qsl[b] + t, pos0 + t, std::min(per, q_len - t)});
  }
  // Few spans: split the long ones by partitions (each of all KV heads, read as one stream).
  // Many: a span's KV heads together where that still leaves the threads enough units.
  const bool split = static_cast<int64_t>(spans.size()) * sh.num_kv_heads < 4 * sh.threads;
  const int64_t heads_per_unit =
      split || static_cast<int64_t>(spans.size()) >= 4 * sh.threads ? std::min(sh.num_kv_heads, kMaxWalkHeads) : 1;
  std::vector<aw::Unit> units;
  std::vector<std::pair<int64_t, int64_t>> folds;  // (token, slots) of split tokens
  int64_t slots = 0;
  for (const Span& s : spans) {
    const int64_t first = aw::first_position(c, s.pos0), last = s.pos0 + s.tokens - 1;
    const int64_t p0 = first / c.part, p1 = last / c.part + 1;
    const int64_t rows = s.tokens * sh.group;
    if (split && p1 - p0 > 1) {
      for (int64_t r = 0; r < s.tokens; ++r) {
        first_slot[s.token0 + r] = slots;
        slots += p1 - p0;
        folds.push_back({s.token0 + r, (s.pos0 + r) / c.part - p0 + 1});
      }
      for (int64_t p = p0; p < p1; ++p)
        for (int64_t h0 = 0; h0 < sh.num_kv_heads; h0 += heads_per_unit) {
          const int64_t kv_count = std::min(heads_per_unit, sh.num_kv_heads - h0);
          units.push_back({s.seq, s.token0, s.pos0, s.tokens, h0, kv_count, p, p + 1, c.part * kv_count * rows + 16});
        }
    } else {
      for (int64_t h0 = 0; h0 < sh.num_kv_heads; h0 += heads_per_unit) {
        const int64_t kv_count = std::min(heads_per_unit, sh.num_kv_heads - h0);
        units.push_back({s.seq, s.token0, s.pos0, s.tokens, h0, kv_count, p0, p1, (last - first + 1) * kv_count * rows + 16});
      }
    }
  }
  if (units.empty()) return;
  std::vector<float> partials(slots * sh.num_heads * aw::state_stride(c.dd));
  c.partials = partials.data();
  int64_t max_rows = 1;
  for (const aw::Unit& u : units) max_rows = std::max(max_rows, u.tokens * u.kv_count * sh.group);
  const T* qp = q.data_ptr<T>();
  const C* kp = static_cast<const C*>(k_cache.data_ptr());
  const C* vp = static_cast<const C*>(v_cache.data_ptr());
  T* op = out.data_ptr<T>();
  // bf16 and fp8 caches' decodes read them in place; prompts widen their tiles to fp32, as every
  // other cache.
  using Native = std::conditional_t<is_fp8(K), aw::Fp8<K>, std::conditional_t<std::is_same_v<C, at::BFloat16>, C, float>>;
  auto pick = [&c](auto row) {
    using R = decltype(row);
    return c.d == 64 ? aw::walk_unit<T, K, 64, R> : c.d == 128 ? aw::walk_unit<T, K, 128, R> : aw::walk_unit<T, K, 0, R>;
  };
  const auto walk_native = pick(Native{}), walk_wide = pick(float{});
  bool widen = false;
  for (const aw::Unit& u : units) widen = widen || !aw::read_in_place<C>(c, u.tokens);

  // Units shared out by cost, a thread that is done taking from the others (work_split.h).
  std::vector<int64_t> costs(units.size());
  for (size_t u = 0; u < units.size(); ++u) costs[u] = units[u].cost;
  WorkSplit work(costs, static_cast<int>(std::min<int64_t>(sh.threads, units.size())));
#pragma omp parallel num_threads(work.threads())
  {
    const aw::SubnormalsRead subnormals;
    aw::Scratch scratch(c, max_rows, widen);
    for (int64_t u = work.take(omp_get_thread_num()); u >= 0; u = work.take(omp_get_thread_num())) {
      const auto walk = aw::read_in_place<C>(c, units[u].tokens) ? walk_native : walk_wide;
      walk(c, units[u], qp, kp, vp, op, scratch);
    }
  }
  if (folds.empty()) return;
  const int64_t items = static_cast<int64_t>(folds.size()) * sh.num_heads;
#pragma omp parallel num_threads(static_cast<int>(std::min<int64_t>(sh.threads, items)))
  {
    std::vector<float> total(aw::state_stride(c.dd));
#pragma omp for
    for (int64_t i = 0; i < items; ++i) {
      const auto& [token, count] = folds[i / sh.num_heads];
      aw::fold_partials(c, token, i % sh.num_heads, count, op, total.data());
    }
  }
}

template <typename T, KvKind K>
void run(torch::Tensor& out, const torch::Tensor& q, const torch::Tensor& k_cache, const torch::Tensor& v_cache,
         const torch::Tensor& block_tables, const torch::Tensor& query_start_loc, const torch::Tensor& seq_lens,
         double scale, int64_t sliding_window, KvScales kv, const float* sinks) {
  const Shapes sh(q, k_cache, block_tables, query_start_loc, seq_lens);
#if defined(__AVX512BF16__)
  if constexpr (std::is_same_v<T, at::BFloat16>) {
    const WalkFn<T, K> walk_fn = pick_walk<T, K>(sh.d, sh.group);
    if (walk_fn != nullptr)
      return run_bf16<K>(walk_fn, out, q, k_cache, v_cache, block_tables, sh, scale, sliding_window, kv, sinks);
  }
#endif
  run_split<T, K>(out, q, k_cache, v_cache, block_tables, sh, scale, sliding_window, kv, sinks);
}

}  // namespace

// The caches hold q's dtype, bf16 (fp32 queries), or fp8 (fp32 and bf16 queries) whose values
// are scaled by k_scale and v_scale. sinks: fp32 [num_heads], a logit per query head in each
// softmax's denominator (gpt-oss), or none.
void paged_attention(torch::Tensor out, torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                     torch::Tensor block_tables, torch::Tensor query_start_loc, torch::Tensor seq_lens, double scale,
                     int64_t sliding_window, double k_scale, double v_scale, c10::optional<torch::Tensor> sinks) {
  TORCH_CHECK(q.is_contiguous() && out.is_contiguous() && k_cache.is_contiguous() &&
              v_cache.is_contiguous() && block_tables.is_contiguous(), "contiguous inputs expected");
  TORCH_CHECK(block_tables.scalar_type() == torch::kInt32 && seq_lens.scalar_type() == torch::kInt32 &&
              query_start_loc.scalar_type() == torch::kInt32, "int32 metadata expected");
  const KvKind kind = kv_kind(k_cache, q.scalar_type());
  TORCH_CHECK(kv_kind(v_cache, q.scalar_type()) == kind, "K and V caches of one dtype expected");
  const KvScales kv{static_cast<float>(k_scale), static_cast<float>(v_scale)};
  if (sinks.has_value())
    TORCH_CHECK(sinks->scalar_type() == torch::kFloat && sinks->is_contiguous() && sinks->dim() == 1 &&
                    sinks->size(0) == q.size(1), "sinks: contiguous fp32 [num_heads] expected");
  const float* sink_logits = sinks.has_value() ? sinks->data_ptr<float>() : nullptr;
#define RUN(T, K) return run<T, K>(out, q, k_cache, v_cache, block_tables, query_start_loc, seq_lens, scale, \
                                   sliding_window, kv, sink_logits)
  switch (q.scalar_type()) {
    case torch::kFloat:
      if (kind == KvKind::kE4M3) RUN(float, KvKind::kE4M3);
      if (kind == KvKind::kE5M2) RUN(float, KvKind::kE5M2);
      if (kind == KvKind::kBF16) RUN(float, KvKind::kBF16);
      RUN(float, KvKind::kSame);
    case torch::kBFloat16:
      if (kind == KvKind::kE4M3) RUN(at::BFloat16, KvKind::kE4M3);
      if (kind == KvKind::kE5M2) RUN(at::BFloat16, KvKind::kE5M2);
      RUN(at::BFloat16, KvKind::kSame);
    case torch::kHalf:
      TORCH_CHECK(kind == KvKind::kSame, "fp8 KV caches serve fp32 and bf16 queries");
      RUN(at::Half, KvKind::kSame);
    default: TORCH_CHECK(false, "unsupported dtype ", q.scalar_type());
  }
#undef RUN
}

void rms_norm(torch::Tensor out, torch::Tensor x, c10::optional<torch::Tensor> delta, torch::Tensor weight,
              double eps);
void gemma_rms_norm(torch::Tensor out, torch::Tensor x, torch::Tensor weight, double eps);
void silu_and_mul(torch::Tensor out, torch::Tensor gate_up);
void rotary_and_cache(torch::Tensor qkv, torch::Tensor cos, torch::Tensor sin, torch::Tensor k_cache,
                      torch::Tensor v_cache, torch::Tensor slots, int64_t num_heads, double k_scale, double v_scale);
void packed_linear_rows(torch::Tensor out, torch::Tensor x, int64_t weight_ptr, int64_t n_padded,
                        int64_t k_padded, c10::optional<torch::Tensor> bias, bool silu_mul);
bool packed_linear_available();
void blocked_linear_rows(torch::Tensor out, torch::Tensor x, torch::Tensor packed, c10::optional<torch::Tensor> bias);
std::vector<std::pair<int64_t, int64_t>> work_split_trace(int64_t items, int64_t threads, int64_t delay_us,
                                                          const std::vector<int64_t>& weights);
void argmax_rows(torch::Tensor out, torch::Tensor x);
void apply_token_mask(torch::Tensor logits, torch::Tensor rows, torch::Tensor words);
void bind_decoder_stack(pybind11::module& m);  // decoder_stack.cpp
void lora_add(torch::Tensor out, torch::Tensor x, torch::Tensor a, torch::Tensor bt, torch::Tensor row_slot,
              torch::Tensor ranks, torch::Tensor runs);  // lora.cpp
void bind_quant_linear(pybind11::module& m);   // quant_linear.cpp
void bind_lora(pybind11::module& m);           // lora.cpp
void bind_blocked_linear(pybind11::module& m);  // packed_linear.cpp
void bind_shm_collectives(pybind11::module& m);  // shm_collectives.cpp
void bind_moe(pybind11::module& m);            // moe.cpp

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  // The GIL is released while a kernel runs, as PyTorch's own operators do, so that a server's
  // HTTP thread can work meanwhile.
  using release = py::call_guard<py::gil_scoped_release>;
  m.def("paged_attention", &paged_attention, "paged attention over a block-table KV cache (CPU)", py::arg("out"),
        py::arg("q"), py::arg("k_cache"), py::arg("v_cache"), py::arg("block_tables"), py::arg("query_start_loc"),
        py::arg("seq_lens"), py::arg("scale"), py::arg("sliding_window"), py::arg("k_scale"), py::arg("v_scale"),
        py::arg("sinks") = py::none(), release());
  m.def("rms_norm", &rms_norm, "RMSNorm, optionally after adding delta into x (in place)", release());
  m.def("gemma_rms_norm", &gemma_rms_norm, "Gemma's RMSNorm: the weight an offset from 1, scaled in fp32", release());
  m.def("silu_and_mul", &silu_and_mul, "silu(gate) * up over [.., 2n] -> [.., n]", release());
  m.def("rotary_and_cache", &rotary_and_cache, "rotary on q and k of qkv rows in place, k and v into the cache",
        release());
  m.def("packed_linear_rows", &packed_linear_rows, "x W^T over oneDNN's packed bf16 weights (then silu-and-mul)",
        release());
  m.def("argmax_rows", &argmax_rows, "torch.argmax(x, dim=-1) of fp32 rows", release());
  m.def("apply_token_mask", &apply_token_mask, "logits[rows[j], t] = -inf where bit t of mask row j is clear",
        release());
  m.def("packed_linear_available", &packed_linear_available, "whether packed_linear_rows was built");
  m.def("blocked_linear_rows", &blocked_linear_rows, "x W^T (+ bias) over fp32 or bf16 weights packed [N / 16, K, 16]",
        release());
  m.def("lora_add", &lora_add, "out[r] += x[r] A^T B^T by each row's adapter slot (LoRA), in place", release());
  bind_decoder_stack(m);  // first: it binds LinearOp, which quant_linear's class derives from
  bind_quant_linear(m);
  bind_lora(m);
  bind_blocked_linear(m);
  bind_shm_collectives(m);
  bind_moe(m);
  m.def("work_split_trace", &work_split_trace, "for tests: (item, thread) in the order taken, thread 0 late",
        py::arg("items"), py::arg("threads"), py::arg("delay_us"), py::arg("weights") = std::vector<int64_t>(),
        release());
}
