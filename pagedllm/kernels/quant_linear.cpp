// Linear layers on quantized weights, read in the records of layers/quantization/formats.py (its
// docstring has the layout), and rows of a quantized embedding table.
//
// Activations are quantized once a call, per 32 values, to int8 with a float scale (and their sums
// per 16). A record gives 16 output rows' codes so that each 32-bit lane of a 512-bit register holds
// 4 codes of one row: dpbusd (AVX512-VNNI) multiplies them with 4 activation codes broadcast to
// every lane and adds into that lane, so 16 rows' integer dot products build up side by side, with
// no reduction across lanes; each block's sums then take their scales in float. Every weight is
// read once a call and unpacked once for up to 4 rows of activations; where a layer is many rows,
// a group's records (a few KiB) stay in L1 across the row passes.
//
// The portable path computes the same sums in plain C++, for CPUs without AVX512-VNNI (and for the
// tests, which run both). Both are held to formats.reference_linear: the int sums are exact, only
// the float order of the scaled sums differs.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <memory>
#include <tuple>
#include <vector>

#include <torch/extension.h>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif
#include <omp.h>

#include "linear_op.h"
#include "work_split.h"

void silu_and_mul(torch::Tensor out, torch::Tensor gate_up);  // fused_ops.cpp

namespace {

constexpr int64_t kGroup = 16;  // output rows a record holds
constexpr int64_t kBlock = 32;  // values an activation scale covers
constexpr int kMaxRows = 4;     // activation rows a pass over a group's records serves

enum Format : int { kQ4_0 = 0, kQ4_1, kQ5_0, kQ5_1, kQ8_0, kQ4_K, kQ5_K, kQ6_K, kNumFormats };

// A format's constants, as formats.Format computes them.
template <int F>
struct Traits {
  static constexpr int bits = F == kQ8_0 ? 8 : F == kQ6_K ? 6 : (F == kQ5_0 || F == kQ5_1 || F == kQ5_K) ? 5 : 4;
  static constexpr bool k_quant = F >= kQ4_K;
  static constexpr bool has_min = F == kQ4_1 || F == kQ5_1;
  static constexpr int offset = F == kQ4_0 ? 8 : F == kQ5_0 ? 16 : F == kQ8_0 ? 128 : F == kQ6_K ? 32 : 0;
  static constexpr int blocks = k_quant ? 8 : 1;  // 32-value blocks a record
  static constexpr int64_t code_bytes = (bits == 8 ? 512 : 256);  // a block's
  static constexpr int64_t high_bytes = bits == 5 ? 64 : bits == 6 ? 128 : 0;  // a block's
  static constexpr int64_t high_at = code_bytes * blocks;
  static constexpr int64_t scales_at = high_at + high_bytes * blocks;
  // K types: sub-scales [subs][16] (Q6_K: 16 int8 subs, else 8 uint8), then 8 uint8 sub-minimums
  // a lane (Q4_K, Q5_K), then d (and dmin) as 16 float16.
  static constexpr int subs = F == kQ6_K ? 16 : 8;
  static constexpr int64_t sub_min_at = scales_at + subs * kGroup;
  static constexpr int64_t d_at = k_quant ? sub_min_at + (F == kQ6_K ? 0 : 8 * kGroup) : scales_at;
  static constexpr int64_t record_bytes =
      k_quant ? d_at + 2 * kGroup * (F == kQ6_K ? 1 : 2) : scales_at + 2 * kGroup * (has_min ? 2 : 1);
  static constexpr int64_t record_values = kBlock * blocks;
};

int64_t record_bytes(int format) {
  switch (format) {
    case kQ4_0: return Traits<kQ4_0>::record_bytes;
    case kQ4_1: return Traits<kQ4_1>::record_bytes;
    case kQ5_0: return Traits<kQ5_0>::record_bytes;
    case kQ5_1: return Traits<kQ5_1>::record_bytes;
    case kQ8_0: return Traits<kQ8_0>::record_bytes;
    case kQ4_K: return Traits<kQ4_K>::record_bytes;
    case kQ5_K: return Traits<kQ5_K>::record_bytes;
    case kQ6_K: return Traits<kQ6_K>::record_bytes;
    default: TORCH_CHECK(false, "unknown quantized format ", format);
  }
  return 0;
}

int64_t record_values(int format) { return format >= kQ4_K ? 256 : kBlock; }

// -- activations --------------------------------------------------------------------------------
// One call's activations, quantized: codes, a scale per 32 values, code sums per 16.
struct Activations {
  torch::Tensor codes, scales, sums;
  int64_t rows, k;
  const int8_t* q(int64_t row) const { return codes.data_ptr<int8_t>() + row * k; }
  const float* d(int64_t row) const { return scales.data_ptr<float>() + row * (k / kBlock); }
  const int32_t* s(int64_t row) const { return sums.data_ptr<int32_t>() + row * (k / 16); }
};

template <typename T>
void quantize_row(const T* x, int64_t k, int8_t* q, float* d, int32_t* s) {
  for (int64_t b = 0; b < k / kBlock; ++b) {
    const T* xb = x + b * kBlock;
    float amax = 0.f;
    for (int i = 0; i < kBlock; ++i) amax = std::max(amax, std::fabs(static_cast<float>(xb[i])));
    const float scale = amax / 127.f, inverse = scale > 0.f ? 1.f / scale : 0.f;
    int32_t sum[2] = {0, 0};
    for (int i = 0; i < kBlock; ++i) {
      // nearbyint rounds half to even, as torch.round and the vector path's conversion do.
      const float v = std::nearbyint(static_cast<float>(xb[i]) * inverse);
      q[b * kBlock + i] = static_cast<int8_t>(std::clamp(v, -127.f, 127.f));
      sum[i / 16] += q[b * kBlock + i];
    }
    d[b] = scale;
    s[2 * b] = sum[0];
    s[2 * b + 1] = sum[1];
  }
}

#if defined(__AVX512BW__)
inline __m512 load16(const float* x) { return _mm512_loadu_ps(x); }
inline __m512 load16(const at::BFloat16* x) {
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}

template <typename T>
void quantize_row_avx512(const T* x, int64_t k, int8_t* q, float* d, int32_t* s) {
  const __m512 sign = _mm512_set1_ps(-0.f);
  for (int64_t b = 0; b < k / kBlock; ++b) {
    const __m512 v0 = load16(x + b * kBlock), v1 = load16(x + b * kBlock + 16);
    const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_andnot_ps(sign, v0), _mm512_andnot_ps(sign, v1)));
    const float scale = amax / 127.f, inverse = scale > 0.f ? 1.f / scale : 0.f;
    const __m512 inv = _mm512_set1_ps(inverse);
    // Conversion under the default rounding mode: to nearest, half to even.
    const __m512i q0 = _mm512_cvtps_epi32(_mm512_mul_ps(v0, inv)), q1 = _mm512_cvtps_epi32(_mm512_mul_ps(v1, inv));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + b * kBlock), _mm512_cvtsepi32_epi8(q0));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + b * kBlock + 16), _mm512_cvtsepi32_epi8(q1));
    d[b] = scale;
    s[2 * b] = _mm512_reduce_add_epi32(q0);
    s[2 * b + 1] = _mm512_reduce_add_epi32(q1);
  }
}
#endif

template <typename T>
void quantize_rows(const T* x, int64_t rows, int64_t k, Activations& a, bool portable) {
  int8_t* q = a.codes.data_ptr<int8_t>();
  float* d = a.scales.data_ptr<float>();
  int32_t* s = a.sums.data_ptr<int32_t>();
#pragma omp parallel for if (rows * k >= 32768)
  for (int64_t r = 0; r < rows; ++r) {
#if defined(__AVX512BW__)
    if (!portable) {
      quantize_row_avx512(x + r * k, k, q + r * k, d + r * (k / kBlock), s + r * (k / 16));
      continue;
    }
#endif
    quantize_row(x + r * k, k, q + r * k, d + r * (k / kBlock), s + r * (k / 16));
  }
}

Activations quantize_activations(const torch::Tensor& x, bool portable) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "contiguous [rows, k] activations expected");
  const int64_t rows = x.size(0), k = x.size(1);
  TORCH_CHECK(k % kBlock == 0, "activations of ", k, " values a row: not whole blocks of 32");
  Activations a{torch::empty({rows, k}, x.options().dtype(torch::kInt8)),
                torch::empty({rows, k / kBlock}, x.options().dtype(torch::kFloat)),
                torch::empty({rows, k / 16}, x.options().dtype(torch::kInt)), rows, k};
  if (x.scalar_type() == torch::kBFloat16)
    quantize_rows(x.data_ptr<at::BFloat16>(), rows, k, a, portable);
  else if (x.scalar_type() == torch::kFloat)
    quantize_rows(x.data_ptr<float>(), rows, k, a, portable);
  else
    TORCH_CHECK(false, "quantized linear layers take float32 or bfloat16 activations, not ", x.scalar_type());
  return a;
}

// -- one group of 16 output rows, for up to kMaxRows activation rows: float sums [rows][16] ------
// Portable: code u of lane `lane`, value v of a block's codes (and high bits).
template <int F>
inline int code_at(const uint8_t* codes, const uint8_t* high, int lane, int v) {
  using Tr = Traits<F>;
  if constexpr (Tr::bits == 8) {
    return codes[64 * (v / 4) + 4 * lane + v % 4];
  } else {
    const int h = v / 16, step = v % 16 / 4, i = v % 4;
    const uint8_t byte = codes[64 * step + 4 * lane + i];
    int u = h ? byte >> 4 : byte & 0x0F;
    if constexpr (Tr::bits >= 5) {
      uint64_t mask;
      std::memcpy(&mask, high + 8 * (4 * h + step), 8);
      u |= static_cast<int>((mask >> (4 * lane + i)) & 1) << 4;
      if constexpr (Tr::bits == 6) {
        std::memcpy(&mask, high + 64 + 8 * (4 * h + step), 8);
        u |= static_cast<int>((mask >> (4 * lane + i)) & 1) << 5;
      }
    }
    return u;
  }
}

inline float half_at(const uint8_t* p, int lane) {
  uint16_t h;
  std::memcpy(&h, p + 2 * lane, 2);
  return c10::detail::fp16_ieee_to_fp32_value(h);
}

template <int F>
void group_portable(const uint8_t* group, int64_t records, const Activations& a, int64_t row0, int rows,
                    float* sums) {
  using Tr = Traits<F>;
  for (int r = 0; r < rows; ++r) {
    const int8_t* xq = a.q(row0 + r);
    const float* dx = a.d(row0 + r);
    const int32_t* sx = a.s(row0 + r);
    for (int lane = 0; lane < kGroup; ++lane) {
      float total = 0.f;
      for (int64_t rec = 0; rec < records; ++rec) {
        const uint8_t* p = group + rec * Tr::record_bytes;
        float scaled = 0.f, minimums = 0.f;
        for (int j = 0; j < Tr::blocks; ++j) {
          const int64_t block = rec * Tr::blocks + j;
          int32_t dot[2] = {0, 0};
          for (int v = 0; v < kBlock; ++v)
            dot[v / 16] += code_at<F>(p + j * Tr::code_bytes, p + Tr::high_at + j * Tr::high_bytes, lane, v) *
                           xq[block * kBlock + v];
          const int32_t s0 = sx[2 * block], s1 = sx[2 * block + 1];
          if constexpr (!Tr::k_quant) {
            const float scale = half_at(p + Tr::scales_at, lane);
            if constexpr (Tr::has_min) {
              total += static_cast<float>(dot[0] + dot[1]) * dx[block] * scale;
              total += half_at(p + Tr::scales_at + 2 * kGroup, lane) * (dx[block] * static_cast<float>(s0 + s1));
            } else {
              total += static_cast<float>(dot[0] + dot[1] - Tr::offset * (s0 + s1)) * dx[block] * scale;
            }
          } else if constexpr (F == kQ6_K) {
            const auto* sc = reinterpret_cast<const int8_t*>(p + Tr::scales_at);
            const int32_t v = (dot[0] - 32 * s0) * sc[(2 * j) * kGroup + lane] +
                              (dot[1] - 32 * s1) * sc[(2 * j + 1) * kGroup + lane];
            scaled += static_cast<float>(v) * dx[block];
          } else {
            const uint8_t* sc = p + Tr::scales_at;
            const uint8_t* mn = p + Tr::sub_min_at;
            scaled += static_cast<float>((dot[0] + dot[1]) * sc[j * kGroup + lane]) * dx[block];
            minimums += static_cast<float>(mn[j * kGroup + lane]) * (dx[block] * static_cast<float>(s0 + s1));
          }
        }
        if constexpr (Tr::k_quant) {
          total += half_at(p + Tr::d_at, lane) * scaled;
          if constexpr (F != kQ6_K) total -= half_at(p + Tr::d_at + 2 * kGroup, lane) * minimums;
        }
      }
      sums[r * kGroup + lane] = total;
    }
  }
}

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
// A block's codes as 8 registers: w[t] pairs with activation bytes 4t..4t+3 in every lane.
template <int Bits>
inline void unpack(const uint8_t* codes, const uint8_t* high, __m512i w[8]) {
  if constexpr (Bits == 8) {
    for (int t = 0; t < 8; ++t) w[t] = _mm512_loadu_si512(codes + 64 * t);
  } else {
    const __m512i low4 = _mm512_set1_epi8(0x0F);
    for (int s = 0; s < 4; ++s) {
      const __m512i q = _mm512_loadu_si512(codes + 64 * s);
      w[s] = _mm512_and_si512(q, low4);
      w[4 + s] = _mm512_and_si512(_mm512_srli_epi16(q, 4), low4);
    }
    if constexpr (Bits >= 5) {
      const __m512i sixteen = _mm512_set1_epi8(16);
      for (int t = 0; t < 8; ++t) {
        uint64_t mask;
        std::memcpy(&mask, high + 8 * t, 8);
        w[t] = _mm512_mask_add_epi8(w[t], mask, w[t], sixteen);
      }
    }
    if constexpr (Bits == 6) {
      const __m512i thirty_two = _mm512_set1_epi8(32);
      for (int t = 0; t < 8; ++t) {
        uint64_t mask;
        std::memcpy(&mask, high + 64 + 8 * t, 8);
        w[t] = _mm512_mask_add_epi8(w[t], mask, w[t], thirty_two);
      }
    }
  }
}

// The integer dot products of a block's 16 rows with one activation row's 32 codes: over all 32
// values, or (Split) over each half of 16.
template <bool Split>
inline void dots(const __m512i w[8], const int8_t* x, __m512i& low, __m512i& high) {
  int32_t words[8];
  std::memcpy(words, x, 32);
  low = _mm512_setzero_si512();
  high = _mm512_setzero_si512();
  for (int t = 0; t < 4; ++t) low = _mm512_dpbusd_epi32(low, w[t], _mm512_set1_epi32(words[t]));
  __m512i& rest = Split ? high : low;
  for (int t = 4; t < 8; ++t) rest = _mm512_dpbusd_epi32(rest, w[t], _mm512_set1_epi32(words[t]));
}

inline __m512 halves(const uint8_t* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

template <int F, int R>
void group_vnni(const uint8_t* group, int64_t records, const Activations& a, int64_t row0, float* sums) {
  using Tr = Traits<F>;
  __m512 total[R];
  const int8_t* xq[R];
  const float* dx[R];
  const int32_t* sx[R];
  for (int r = 0; r < R; ++r) {
    total[r] = _mm512_setzero_ps();
    xq[r] = a.q(row0 + r);
    dx[r] = a.d(row0 + r);
    sx[r] = a.s(row0 + r);
  }
  __m512i w[8];
  for (int64_t rec = 0; rec < records; ++rec) {
    const uint8_t* p = group + rec * Tr::record_bytes;
    if constexpr (!Tr::k_quant) {
      unpack<Tr::bits>(p, p + Tr::high_at, w);
      const __m512 scale = halves(p + Tr::scales_at);
      for (int r = 0; r < R; ++r) {
        __m512i dot, unused;
        dots<false>(w, xq[r] + rec * kBlock, dot, unused);
        const int32_t sum = sx[r][2 * rec] + sx[r][2 * rec + 1];
        const __m512 d = _mm512_set1_ps(dx[r][rec]);
        if constexpr (Tr::has_min) {
          total[r] = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(dot), d), scale, total[r]);
          total[r] = _mm512_fmadd_ps(halves(p + Tr::scales_at + 2 * kGroup),
                                     _mm512_set1_ps(dx[r][rec] * static_cast<float>(sum)), total[r]);
        } else {
          const __m512i centred = _mm512_sub_epi32(dot, _mm512_set1_epi32(Tr::offset * sum));
          total[r] = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(centred), d), scale, total[r]);
        }
      }
    } else {
      __m512 scaled[R], minimums[R];
      for (int r = 0; r < R; ++r) scaled[r] = minimums[r] = _mm512_setzero_ps();
      for (int j = 0; j < Tr::blocks; ++j) {
        const int64_t block = rec * Tr::blocks + j;
        unpack<Tr::bits>(p + j * Tr::code_bytes, p + Tr::high_at + j * Tr::high_bytes, w);
        if constexpr (F == kQ6_K) {
          const auto* sc = reinterpret_cast<const __m128i*>(p + Tr::scales_at + 2 * j * kGroup);
          const __m512i sc0 = _mm512_cvtepi8_epi32(_mm_loadu_si128(sc)), sc1 = _mm512_cvtepi8_epi32(_mm_loadu_si128(sc + 1));
          for (int r = 0; r < R; ++r) {
            __m512i low, high;
            dots<true>(w, xq[r] + block * kBlock, low, high);
            low = _mm512_mullo_epi32(_mm512_sub_epi32(low, _mm512_set1_epi32(32 * sx[r][2 * block])), sc0);
            high = _mm512_mullo_epi32(_mm512_sub_epi32(high, _mm512_set1_epi32(32 * sx[r][2 * block + 1])), sc1);
            scaled[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_add_epi32(low, high)), _mm512_set1_ps(dx[r][block]),
                                        scaled[r]);
          }
        } else {
          const auto* sc = reinterpret_cast<const __m128i*>(p + Tr::scales_at + j * kGroup);
          const auto* mn = reinterpret_cast<const __m128i*>(p + Tr::sub_min_at + j * kGroup);
          const __m512i sub_scale = _mm512_cvtepu8_epi32(_mm_loadu_si128(sc));
          const __m512 sub_min = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(mn)));
          for (int r = 0; r < R; ++r) {
            __m512i dot, unused;
            dots<false>(w, xq[r] + block * kBlock, dot, unused);
            const float d = dx[r][block];
            scaled[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_mullo_epi32(dot, sub_scale)), _mm512_set1_ps(d),
                                        scaled[r]);
            const float sum = static_cast<float>(sx[r][2 * block] + sx[r][2 * block + 1]);
            minimums[r] = _mm512_fmadd_ps(sub_min, _mm512_set1_ps(d * sum), minimums[r]);
          }
        }
      }
      const __m512 d = halves(p + Tr::d_at);
      for (int r = 0; r < R; ++r) {
        total[r] = _mm512_fmadd_ps(d, scaled[r], total[r]);
        if constexpr (F != kQ6_K) total[r] = _mm512_fnmadd_ps(halves(p + Tr::d_at + 2 * kGroup), minimums[r], total[r]);
      }
    }
  }
  for (int r = 0; r < R; ++r) _mm512_storeu_ps(sums + r * kGroup, total[r]);
}
#endif

using GroupFn = void (*)(const uint8_t*, int64_t, const Activations&, int64_t, int, float*);

template <int F>
void group_rows(const uint8_t* group, int64_t records, const Activations& a, int64_t row0, int rows, float* sums) {
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
  switch (rows) {
    case 1: return group_vnni<F, 1>(group, records, a, row0, sums);
    case 2: return group_vnni<F, 2>(group, records, a, row0, sums);
    case 3: return group_vnni<F, 3>(group, records, a, row0, sums);
    default: return group_vnni<F, 4>(group, records, a, row0, sums);
  }
#else
  group_portable<F>(group, records, a, row0, rows, sums);
#endif
}

template <int F>
constexpr GroupFn kFns[2] = {group_rows<F>, group_portable<F>};

GroupFn group_fn(int format, bool portable) {
  switch (format) {
    case kQ4_0: return kFns<kQ4_0>[portable];
    case kQ4_1: return kFns<kQ4_1>[portable];
    case kQ5_0: return kFns<kQ5_0>[portable];
    case kQ5_1: return kFns<kQ5_1>[portable];
    case kQ8_0: return kFns<kQ8_0>[portable];
    case kQ4_K: return kFns<kQ4_K>[portable];
    case kQ5_K: return kFns<kQ5_K>[portable];
    case kQ6_K: return kFns<kQ6_K>[portable];
    default: TORCH_CHECK(false, "unknown quantized format ", format);
  }
  return nullptr;
}

template <typename T>
void store(T* out, int64_t stride, const float* sums, int rows, int64_t cols, const T* bias) {
  for (int r = 0; r < rows; ++r)
    for (int64_t j = 0; j < cols; ++j) {
      const float v = sums[r * kGroup + j] + (bias != nullptr ? static_cast<float>(bias[j]) : 0.f);
      out[r * stride + j] = static_cast<T>(v);
    }
}

// out[:, col:col + n] = x W^T (+ bias) for one packed matrix of n rows.
template <typename T>
void matmul(torch::Tensor& out, const Activations& a, const torch::Tensor& packed, int format, int64_t n, int64_t col,
            const T* bias, bool portable) {
  const int64_t groups = packed.size(0), records = packed.size(1), rb = packed.size(2), rows = a.rows;
  const int64_t stride = out.size(1);
  const uint8_t* weights = packed.data_ptr<uint8_t>();
  T* y = out.data_ptr<T>() + col;
  const GroupFn fn = group_fn(format, portable);
  // Items: (group, chunk of rows). With groups enough for every thread a chunk is all the rows, so
  // a group's records are read from memory once and stay in cache across the passes.
  const int64_t passes = (rows + kMaxRows - 1) / kMaxRows;
  const int64_t chunks = std::min(passes, std::max<int64_t>(1, (4 * omp_get_max_threads() + groups - 1) / groups));
  const int64_t chunk_rows = (passes + chunks - 1) / chunks * kMaxRows;
  WorkSplit split(groups * chunks, omp_get_max_threads());
#pragma omp parallel num_threads(split.threads())
  for (int64_t item = split.take(omp_get_thread_num()); item >= 0; item = split.take(omp_get_thread_num())) {
    alignas(64) float sums[kMaxRows * kGroup];
    const int64_t g = item / chunks, first = item % chunks * chunk_rows, last = std::min(rows, first + chunk_rows);
    const int64_t cols = std::min<int64_t>(kGroup, n - g * kGroup);
    for (int64_t r0 = first; r0 < last; r0 += kMaxRows) {
      const int count = static_cast<int>(std::min<int64_t>(kMaxRows, last - r0));
      fn(weights + g * records * rb, records, a, r0, count, sums);
      store(y + r0 * stride + g * kGroup, stride, sums, count, cols, bias == nullptr ? nullptr : bias + g * kGroup);
    }
  }
}

// A quantized linear layer: one or more packed matrices (a fused layer's shards of different
// types), side by side in the output's columns.
class QuantLinear : public LinearOp {
 public:
  using Segment = std::tuple<torch::Tensor, int64_t, int64_t>;  // packed records, format, rows

  QuantLinear(std::vector<Segment> segments, int64_t in_features, c10::optional<torch::Tensor> bias, bool silu_mul,
              bool portable)
      : segments_(std::move(segments)), in_features_(in_features), bias_(std::move(bias)), silu_mul_(silu_mul),
        portable_(portable) {
    out_features_ = 0;
    for (const auto& [packed, format, n] : segments_) {
      TORCH_CHECK(packed.dim() == 3 && packed.scalar_type() == torch::kUInt8 && packed.is_contiguous(),
                  "packed records expected as contiguous uint8 [groups, records, bytes]");
      TORCH_CHECK(packed.size(2) == record_bytes(static_cast<int>(format)), "records of ", packed.size(2),
                  " bytes do not match format ", format);
      TORCH_CHECK(packed.size(1) * record_values(static_cast<int>(format)) == in_features_, "packed rows of ",
                  packed.size(1) * record_values(static_cast<int>(format)), " values, the layer takes ", in_features_);
      TORCH_CHECK(packed.size(0) == (n + kGroup - 1) / kGroup, "packed groups do not cover ", n, " rows");
      out_features_ += n;
    }
    TORCH_CHECK(!silu_mul_ || out_features_ % 2 == 0, "silu_mul needs gate and up halves");
  }

  torch::Tensor forward(const torch::Tensor& x) const override {
    TORCH_CHECK(x.dim() == 2 && x.size(1) == in_features_, "[rows, ", in_features_, "] activations expected");
    const torch::Tensor input = x.contiguous();
    const Activations a = quantize_activations(input, portable_);
    torch::Tensor out = torch::empty({x.size(0), out_features_}, x.options());
    int64_t col = 0;
    for (const auto& [packed, format, n] : segments_) {
      if (x.scalar_type() == torch::kBFloat16)
        matmul<at::BFloat16>(out, a, packed, static_cast<int>(format), n, col, bias_data<at::BFloat16>(col), portable_);
      else
        matmul<float>(out, a, packed, static_cast<int>(format), n, col, bias_data<float>(col), portable_);
      col += n;
    }
    if (!silu_mul_) return out;
    torch::Tensor result = torch::empty({x.size(0), out_features_ / 2}, x.options());
    silu_and_mul(result, out);
    return result;
  }

 private:
  template <typename T>
  const T* bias_data(int64_t col) const {
    if (!bias_.has_value()) return nullptr;
    TORCH_CHECK(bias_->scalar_type() == c10::CppTypeToScalarType<T>::value, "bias and activations differ in dtype");
    return bias_->data_ptr<T>() + col;
  }

  std::vector<Segment> segments_;
  int64_t in_features_, out_features_;
  c10::optional<torch::Tensor> bias_;
  bool silu_mul_, portable_;
};

// -- embedding rows ---------------------------------------------------------------------------
template <int F>
void dequantize_row(const uint8_t* group, int64_t records, int lane, float* out) {
  using Tr = Traits<F>;
  for (int64_t rec = 0; rec < records; ++rec) {
    const uint8_t* p = group + rec * Tr::record_bytes;
    for (int j = 0; j < Tr::blocks; ++j) {
      float* y = out + (rec * Tr::blocks + j) * kBlock;
      for (int v = 0; v < kBlock; ++v) {
        const float u = static_cast<float>(code_at<F>(p + j * Tr::code_bytes, p + Tr::high_at + j * Tr::high_bytes, lane, v));
        if constexpr (!Tr::k_quant) {
          const float d = half_at(p + Tr::scales_at, lane);
          y[v] = Tr::has_min ? d * u + half_at(p + Tr::scales_at + 2 * kGroup, lane) : d * (u - Tr::offset);
        } else if constexpr (F == kQ6_K) {
          const auto* sc = reinterpret_cast<const int8_t*>(p + Tr::scales_at);
          y[v] = half_at(p + Tr::d_at, lane) * static_cast<float>(sc[(2 * j + v / 16) * kGroup + lane]) * (u - 32.f);
        } else {
          const float scale = half_at(p + Tr::d_at, lane) * static_cast<float>(p[Tr::scales_at + j * kGroup + lane]);
          const float minimum = half_at(p + Tr::d_at + 2 * kGroup, lane) * static_cast<float>(p[Tr::sub_min_at + j * kGroup + lane]);
          y[v] = scale * u - minimum;
        }
      }
    }
  }
}

using RowFn = void (*)(const uint8_t*, int64_t, int, float*);
RowFn row_fn(int format) {
  switch (format) {
    case kQ4_0: return dequantize_row<kQ4_0>;
    case kQ4_1: return dequantize_row<kQ4_1>;
    case kQ5_0: return dequantize_row<kQ5_0>;
    case kQ5_1: return dequantize_row<kQ5_1>;
    case kQ8_0: return dequantize_row<kQ8_0>;
    case kQ4_K: return dequantize_row<kQ4_K>;
    case kQ5_K: return dequantize_row<kQ5_K>;
    case kQ6_K: return dequantize_row<kQ6_K>;
    default: TORCH_CHECK(false, "unknown quantized format ", format);
  }
  return nullptr;
}

}  // namespace

// out [ids, k] (float32 or bfloat16) = rows `ids` of a packed matrix, dequantized.
void quant_embedding(torch::Tensor out, torch::Tensor ids, torch::Tensor packed, int64_t format) {
  TORCH_CHECK(ids.scalar_type() == torch::kLong && ids.dim() == 1 && out.dim() == 2 && out.is_contiguous(),
              "int64 ids and a contiguous [ids, k] output expected");
  const int64_t records = packed.size(1), rb = packed.size(2), k = out.size(1), count = ids.size(0);
  TORCH_CHECK(records * record_values(static_cast<int>(format)) == k && rb == record_bytes(static_cast<int>(format)),
              "packed records do not match the output's width");
  const RowFn fn = row_fn(static_cast<int>(format));
  const int64_t* id = ids.data_ptr<int64_t>();
  const uint8_t* weights = packed.data_ptr<uint8_t>();
  for (int64_t i = 0; i < count; ++i)
    TORCH_CHECK(id[i] >= 0 && id[i] < packed.size(0) * kGroup, "token id ", id[i], " out of the table");
#pragma omp parallel for if (count * k >= 65536)
  for (int64_t i = 0; i < count; ++i) {
    std::vector<float> row(k);
    fn(weights + id[i] / kGroup * records * rb, records, static_cast<int>(id[i] % kGroup), row.data());
    if (out.scalar_type() == torch::kBFloat16) {
      auto* y = out.data_ptr<at::BFloat16>() + i * k;
      for (int64_t j = 0; j < k; ++j) y[j] = static_cast<at::BFloat16>(row[j]);
    } else {
      std::memcpy(out.data_ptr<float>() + i * k, row.data(), k * sizeof(float));
    }
  }
}

// For the tests: the activations as the kernels quantize them.
std::tuple<torch::Tensor, torch::Tensor, torch::Tensor> quantize_activations_for_test(torch::Tensor x, bool portable) {
  Activations a = quantize_activations(x.contiguous(), portable);
  return {a.codes, a.scales, a.sums};
}

bool quant_linear_has_vnni() {
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
  return true;
#else
  return false;
#endif
}

void bind_quant_linear(pybind11::module& m) {
  pybind11::class_<QuantLinear, LinearOp, std::shared_ptr<QuantLinear>>(m, "QuantLinear")
      .def(pybind11::init<std::vector<QuantLinear::Segment>, int64_t, c10::optional<torch::Tensor>, bool, bool>(),
           pybind11::arg("segments"), pybind11::arg("in_features"), pybind11::arg("bias"),
           pybind11::arg("silu_mul") = false, pybind11::arg("portable") = false);
  using release = pybind11::call_guard<pybind11::gil_scoped_release>;
  m.def("quant_embedding", &quant_embedding, "rows of a packed quantized matrix, dequantized", release());
  m.def("quantize_activations", &quantize_activations_for_test, "activations as the quantized kernels quantize them",
        release());
  m.def("quant_linear_has_vnni", &quant_linear_has_vnni, "whether the AVX512-VNNI path was built");
}
