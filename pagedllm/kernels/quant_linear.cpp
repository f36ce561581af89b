// Linear layers on quantized weights, read in the records of layers/quantization/formats.py (its
// docstring has the layout), and rows of a quantized embedding table.
//
// Activations are quantized once a call to int8 with a float scale per 32 values (a record of the
// types of 32), or per 256 for the K types (a record of theirs, as llama.cpp's Q8_K), and their sums
// per 16. A record gives 16 output rows' codes so that each 32-bit lane of a 512-bit register holds
// 4 codes of one row: dpbusd (AVX512-VNNI) multiplies them with 4 activation codes broadcast to
// every lane and adds into that lane, so 16 rows' integer dot products build up side by side, with
// no reduction across lanes. A record's sums take their scales in float once a record: a K record's
// sub-block scales (and minimums) go in as integers first, which keeps the per-block work of the
// many-row case to the dot products and one multiply (the 4-row pass on Q4_K: 1.2x as fast as with
// float sums per 32-value block); the minimums' term (and the offset of the formats with int8
// sub-scales: Q6_K's 32, Q3_K's 4, IQ4_XS's and IQ3_S's 128) is one vpdpwssd a block on int16
// activation sums (Q4_K and Q6_K at 64 rows 4-10% faster than a multiply each). A table format's
// 4-bit indices become its values + 128 as they are unpacked (one vpshufb a register), unsigned
// 8-bit codes for dpbusd.
// Every weight is read once a call and unpacked once for a pass of up to 8 rows of activations (a
// K record's float sums wait in memory); where a call is more rows than a pass, the AVX-512 path
// keeps a group's unpacked codes (16 bytes an input) from its first pass for the others (Kept).
// On CPUs with AMX, most formats' passes of such a call take 16 rows on tiles (group_amx): one
// tile product a block gives the same integer dot products as the VNNI passes.
// Batch invariance: a row's sums are the same whatever rows share its call (the integer sums are
// exact and each row's float sums run in record order, in a pass of any size), and there is one
// path per format whatever the step's rows (bf16 dot products on dequantized tiles, once taken
// from 256 bf16 rows of Q5_0/Q5_1, no longer ran faster than the int8 passes: removed).
//
// CPUs without AVX-512 take an AVX2 path over the same records (group_avx2: 8 rows a register,
// maddubs for dpbusd). The portable path computes the same sums in plain C++, for CPUs with
// neither (and for the tests, which run it beside the vector path). All are held to
// formats.reference_linear: the int sums are exact, only the float order of the scaled sums differs.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <memory>
#include <string>
#include <tuple>
#include <type_traits>
#include <vector>

#include <torch/extension.h>

#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif
#include <omp.h>
#if defined(__AMX_TILE__)
#include <sys/syscall.h>
#include <unistd.h>
#endif

#include "linear_op.h"
#include "stream_hint.h"
#include "widen.h"
#include "work_split.h"

void silu_and_mul(torch::Tensor out, torch::Tensor gate_up);  // fused_ops.cpp
#if defined(__AVX512BF16__)
void silu_mul_sums_bf16(at::BFloat16* out, const float* g, const float* u, int64_t n);  // fused_ops.cpp
#endif

namespace {

constexpr int64_t kGroup = 16;  // output rows a record holds
constexpr int64_t kBlock = 32;  // values an activation scale covers
constexpr int kPassRows = 8;    // activation rows a pass over a group's records serves (int8 path)
constexpr int kMaxPassRows = 16;  // on AMX tiles (group_amx)

enum Format : int {
  kQ4_0 = 0, kQ4_1, kQ5_0, kQ5_1, kQ8_0, kQ4_K, kQ5_K, kQ6_K, kQ2_K, kQ3_K, kIQ4_NL, kIQ4_XS, kMXFP4, kIQ3_S,
  kNumFormats
};

// The value tables that IQ4_NL's, IQ4_XS's, MXFP4's and IQ3_S's 4-bit codes index (MXFP4's e2m1
// doubled; IQ3_S's: a grid point's odd values with their signs).
constexpr int8_t kIQ4NLValues[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};
constexpr int8_t kIQ3SValues[16] = {-15, -13, -11, -9, -7, -5, -3, -1, 1, 3, 5, 7, 9, 11, 13, 15};
constexpr int8_t kMXFP4Values[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};

// A format's constants, as formats.Format computes them.
template <int F>
struct Traits {
  static constexpr int bits = F == kQ8_0                                                ? 8
                              : F == kQ6_K                                              ? 6
                              : (F == kQ5_0 || F == kQ5_1 || F == kQ5_K)                ? 5
                              : F == kQ3_K                                              ? 3
                              : F == kQ2_K                                              ? 2
                                                                                        : 4;
  static constexpr bool k_quant = F >= kQ4_K && F != kIQ4_NL && F != kMXFP4;
  static constexpr bool has_min = F == kQ4_1 || F == kQ5_1;
  // 4-bit codes that index a table: once unpacked, u = value + 128, 8-bit codes (wide).
  static constexpr bool lookup = F == kIQ4_NL || F == kIQ4_XS || F == kMXFP4 || F == kIQ3_S;
  static constexpr const int8_t* table = F == kMXFP4 ? kMXFP4Values : F == kIQ3_S ? kIQ3SValues : kIQ4NLValues;
  static constexpr int wide = lookup ? 8 : bits;
  static constexpr int offset = F == kQ4_0                 ? 8
                                : F == kQ5_0               ? 16
                                : (F == kQ8_0 || lookup)   ? 128
                                : F == kQ6_K               ? 32
                                : F == kQ3_K               ? 4
                                                           : 0;
  // K types: int8 sub-scales of u - offset (Q6_K, Q3_K, IQ4_XS, IQ3_S), or uint8 ones with uint8
  // sub-minimums and a dmin (Q4_K, Q5_K, Q2_K); one a 16 values or one a 32.
  static constexpr bool signed_subs = F == kQ6_K || F == kQ3_K || F == kIQ4_XS || F == kIQ3_S;
  static constexpr bool sub_min = k_quant && !signed_subs;
  static constexpr int subs = (F == kQ6_K || F == kQ2_K || F == kQ3_K) ? 16 : 8;
  // Q2_K's 4-bit sub-scale and sub-minimum share a byte (scale in the low nibble), as in the file.
  static constexpr bool paired = F == kQ2_K;
  static constexpr int64_t scale_bytes = F == kMXFP4 ? 4 : 2;  // d as float32 or float16
  static constexpr int blocks = k_quant ? 8 : 1;  // 32-value blocks a record
  static constexpr int64_t code_bytes = bits == 8 ? 512 : bits <= 3 ? 128 : 256;  // a block's
  static constexpr int64_t high_bytes = (bits == 3 || bits == 5) ? 64 : bits == 6 ? 128 : 0;  // a block's
  static constexpr int64_t high_at = code_bytes * blocks;
  static constexpr int64_t scales_at = high_at + high_bytes * blocks;
  // K types: sub-scales [subs][16], then the sub-minimums [subs][16] (Q2_K: pairs of both in one
  // table), then d (and dmin) as 16 float16.
  static constexpr int64_t sub_min_at = paired ? scales_at : scales_at + subs * kGroup;
  static constexpr int64_t d_at = k_quant ? scales_at + subs * kGroup * (sub_min && !paired ? 2 : 1) : scales_at;
  static constexpr int64_t used_bytes = d_at + scale_bytes * kGroup * ((k_quant ? sub_min : has_min) ? 2 : 1);
  // A K type's record ends on a cache line (formats.Format.record_padding): Q6_K's 3360 bytes are
  // padded to 3392, so that no record starts mid-line.
  static constexpr int64_t record_bytes = k_quant ? (used_bytes + 63) / 64 * 64 : used_bytes;
  static constexpr int64_t record_values = kBlock * blocks;
  // The sub-scale (or sub-minimum) of block j's half h (values 16 h .. 16 h + 15), as an index [.][16].
  static constexpr int sub(int j, int h) { return subs == 16 ? 2 * j + h : j; }
  // Passes of 16 rows on AMX tiles where the CPU has them (group_amx): the formats they made faster
  // (BENCHMARKS.md), not Q8_0, MXFP4 or those of a sub-scale a 16 values (two half-block products a
  // block), which ran slower or no faster than the VNNI passes.
  static constexpr bool tiles = subs == 8 && bits != 8 && F != kMXFP4;
};

// fn(std::integral_constant<int, F>) for the format F given at run time: where a format number
// meets the templates.
template <typename Fn>
auto by_format(int format, Fn&& fn) {
  using C = std::integral_constant<int, kQ4_0>;
  switch (format) {
    case kQ4_0: return fn(C{});
    case kQ4_1: return fn(std::integral_constant<int, kQ4_1>{});
    case kQ5_0: return fn(std::integral_constant<int, kQ5_0>{});
    case kQ5_1: return fn(std::integral_constant<int, kQ5_1>{});
    case kQ8_0: return fn(std::integral_constant<int, kQ8_0>{});
    case kQ4_K: return fn(std::integral_constant<int, kQ4_K>{});
    case kQ5_K: return fn(std::integral_constant<int, kQ5_K>{});
    case kQ6_K: return fn(std::integral_constant<int, kQ6_K>{});
    case kQ2_K: return fn(std::integral_constant<int, kQ2_K>{});
    case kQ3_K: return fn(std::integral_constant<int, kQ3_K>{});
    case kIQ4_NL: return fn(std::integral_constant<int, kIQ4_NL>{});
    case kIQ4_XS: return fn(std::integral_constant<int, kIQ4_XS>{});
    case kMXFP4: return fn(std::integral_constant<int, kMXFP4>{});
    case kIQ3_S: return fn(std::integral_constant<int, kIQ3_S>{});
    default: TORCH_CHECK(false, "unknown quantized format ", format);
  }
  return fn(C{});
}

int64_t record_bytes(int format) {
  return by_format(format, [](auto f) { return Traits<decltype(f)::value>::record_bytes; });
}

int64_t record_values(int format) {
  return by_format(format, [](auto f) { return Traits<decltype(f)::value>::record_values; });
}

// -- activations --------------------------------------------------------------------------------
// One call's activations, quantized: codes, a scale per `block` values, code sums per 16. The K types
// take blocks of 256, one scale a record (as llama.cpp's Q8_K), so that a record's block sums stay
// integers until its end; the others blocks of 32, one a record.
struct Activations {
  const int8_t* codes;
  const float* scales;
  const int16_t* sums;  // |sum| <= 16 x 127: int16, so that pairs of them feed vpdpwssd
  const int16_t* sums32;  // per 32 (blocks of 256 only): the sub-block sums of the K types of 8 sub-blocks
  int64_t rows, k, block;
  const int8_t* q(int64_t row) const { return codes + row * k; }
  const float* d(int64_t row) const { return scales + row * (k / block); }
  const int16_t* s(int64_t row) const { return sums + row * (k / 16); }
  const int16_t* s32(int64_t row) const { return sums32 + row * (k / 32); }
};

int64_t activation_block(int format) { return record_values(format); }

// A group's codes as its first row pass unpacked them, kept for the passes after it (a call of
// more rows than a pass): they load from this scratch (L1 or L2) instead of being unpacked again.
// The AVX-512 path keeps them for every type but Q8_0 (whose codes are bytes already); the others
// unpack every pass. Loads or unpacking, the same codes: the sums do not change.
// A thread's AMX tile configuration in one parallel region (-1: none): loaded by its first pass
// that takes tiles (a load and a release a pass cost a third of a 64-row call) and released as the
// region ends, before other kernels (oneDNN's) load their own on the thread.
struct TileState {
  int config = -1;
  ~TileState();
};

struct Kept {
  uint8_t* codes;      // [records x blocks][8][64], 64-byte aligned
  bool filled;         // by the first pass
  TileState* tiles;    // the thread's, for AMX passes
};

// This thread's scratch for the kept codes of `jobs` groups of k inputs (512 bytes a 32-value block).
uint8_t* kept_scratch(int64_t k, int jobs) {
  thread_local std::vector<uint8_t> buffer;
  const size_t bytes = static_cast<size_t>(k) * 16 * jobs + 64;
  if (buffer.size() < bytes) buffer.resize(bytes);
  return reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(buffer.data()) + 63) & ~uintptr_t{63});
}

template <typename T>
void quantize_row(const T* x, int64_t k, int64_t block, int8_t* q, float* d, int16_t* s) {
  for (int64_t b = 0; b < k / block; ++b) {
    const T* xb = x + b * block;
    float amax = 0.f;
    for (int64_t i = 0; i < block; ++i) amax = std::max(amax, std::fabs(static_cast<float>(xb[i])));
    const float scale = amax / 127.f, inverse = scale > 0.f ? 1.f / scale : 0.f;
    for (int64_t i = 0; i < block; ++i) {
      // nearbyint rounds half to even, as torch.round and the vector path's conversion do.
      const float v = std::nearbyint(static_cast<float>(xb[i]) * inverse);
      q[b * block + i] = static_cast<int8_t>(std::clamp(v, -127.f, 127.f));
    }
    d[b] = scale;
  }
  for (int64_t i = 0; i < k / 16; ++i) {
    int32_t sum = 0;
    for (int v = 0; v < 16; ++v) sum += q[16 * i + v];
    s[i] = static_cast<int16_t>(sum);
  }
}

#if defined(__AVX512BW__)
inline __m512 load16(const float* x) { return _mm512_loadu_ps(x); }
inline __m512 load16(const at::BFloat16* x) {
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}

// 64 values' codes, the first 32 scaled by lo and the others by hi, and their sums per 16. The
// packs interleave 128-bit lanes (lane L: 4 codes of each vector in turn): one permute of 32-bit
// words puts the bytes back in order. The sums: psadbw's sums per 8 of the codes + 128, paired,
// less 16 x 128 (no code is past +-127, so the bytes' sums are the codes').
template <typename T>
inline void codes64(const T* x, __m512 lo, __m512 hi, int8_t* q, int16_t* s) {
  __m512i c[4];
  for (int i = 0; i < 4; ++i) c[i] = _mm512_cvtps_epi32(_mm512_mul_ps(load16(x + 16 * i), i < 2 ? lo : hi));
  const __m512i packed = _mm512_packs_epi16(_mm512_packs_epi32(c[0], c[1]), _mm512_packs_epi32(c[2], c[3]));
  const __m512i codes =
      _mm512_permutexvar_epi32(_mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15), packed);
  _mm512_storeu_si512(q, codes);
  const __m512i eights =
      _mm512_sad_epu8(_mm512_xor_si512(codes, _mm512_set1_epi8(static_cast<char>(0x80))), _mm512_setzero_si512());
  const __m128i words = _mm512_cvtepi64_epi16(eights);
  _mm_storel_epi64(reinterpret_cast<__m128i*>(s), _mm_sub_epi16(_mm_hadd_epi16(words, words), _mm_set1_epi16(2048)));
}

// 16 values' codes and their sum (a row's last 32 values where it is not whole 64s).
template <typename T>
inline void codes16(const T* x, __m512 inv, int8_t* q, int16_t* s) {
  const __m512i c = _mm512_cvtps_epi32(_mm512_mul_ps(load16(x), inv));  // to nearest, half to even
  _mm_storeu_si128(reinterpret_cast<__m128i*>(q), _mm512_cvtsepi32_epi8(c));
  *s = static_cast<int16_t>(_mm512_reduce_add_epi32(c));
}

template <typename T>
void quantize_row_avx512(const T* x, int64_t k, int64_t block, int8_t* q, float* d, int16_t* s) {
  const __m512 sign = _mm512_set1_ps(-0.f);
  for (int64_t b = 0; b < k / block; ++b) {
    const T* xb = x + b * block;
    __m512 m = _mm512_setzero_ps();
    for (int64_t i = 0; i < block; i += 16) m = _mm512_max_ps(m, _mm512_andnot_ps(sign, load16(xb + i)));
    d[b] = _mm512_reduce_max_ps(m) / 127.f;
  }
  // Each code under its block's inverse scale, converted under the default rounding mode (to
  // nearest, half to even), as the portable path's nearbyint.
  auto inverse = [&](int64_t i) { return _mm512_set1_ps(d[i / block] > 0.f ? 1.f / d[i / block] : 0.f); };
  int64_t i = 0;
  for (; i + 64 <= k; i += 64) codes64(x + i, inverse(i), inverse(i + 32), q + i, s + i / 16);
  for (; i < k; i += 16) codes16(x + i, inverse(i), q + i, s + i / 16);
}
#elif defined(__AVX2__)
inline float max8(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
}

inline int32_t sum8(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_unpackhi_epi64(s, s));
  return _mm_cvtsi128_si32(_mm_add_epi32(s, _mm_shuffle_epi32(s, 1)));
}

template <typename T>
void quantize_row_avx2(const T* x, int64_t k, int64_t block, int8_t* q, float* d, int16_t* s) {
  const __m256 sign = _mm256_set1_ps(-0.f);
  for (int64_t b = 0; b < k / block; ++b) {
    const T* xb = x + b * block;
    __m256 m = _mm256_setzero_ps();
    for (int64_t i = 0; i < block; i += 8) m = _mm256_max_ps(m, _mm256_andnot_ps(sign, load8(xb + i)));
    const float amax = max8(m);
    const float scale = amax / 127.f, inverse = scale > 0.f ? 1.f / scale : 0.f;
    const __m256 inv = _mm256_set1_ps(inverse);
    for (int64_t i = 0; i < block; i += kBlock) {
      __m256i c[4];  // under the default rounding mode: to nearest, half to even
      for (int t = 0; t < 4; ++t) c[t] = _mm256_cvtps_epi32(_mm256_mul_ps(load8(xb + i + 8 * t), inv));
      // The packs interleave 128-bit lanes; one permute puts the 32 bytes back in order.
      const __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(c[0], c[1]), _mm256_packs_epi32(c[2], c[3]));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + b * block + i),
                          _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
      s[(b * block + i) / 16] = static_cast<int16_t>(sum8(_mm256_add_epi32(c[0], c[1])));
      s[(b * block + i) / 16 + 1] = static_cast<int16_t>(sum8(_mm256_add_epi32(c[2], c[3])));
    }
    d[b] = scale;
  }
}
#endif

template <typename T>
void quantize_rows(const T* x, int64_t rows, int64_t k, int64_t block, int8_t* q, float* d, int16_t* s,
                   bool portable) {
#pragma omp parallel for if (rows * k >= 32768)
  for (int64_t r = 0; r < rows; ++r) {
    int8_t* qr = q + r * k;
    float* dr = d + r * (k / block);
    int16_t* sr = s + r * (k / 16);
#if defined(__AVX512BW__)
    if (!portable) {
      quantize_row_avx512(x + r * k, k, block, qr, dr, sr);
      continue;
    }
#elif defined(__AVX2__)
    if (!portable) {
      quantize_row_avx2(x + r * k, k, block, qr, dr, sr);
      continue;
    }
#endif
    quantize_row(x + r * k, k, block, qr, dr, sr);
  }
}

// x quantized in blocks of `block` (32 or 256) into buffers that the calling thread reuses call after
// call (a decode step's many small calls allocate nothing), one set per block size (a layer of both
// kinds of segment holds both): valid until its next call for that block size.
Activations quantize_activations(const torch::Tensor& x, bool portable, int64_t block) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "contiguous [rows, k] activations expected");
  TORCH_CHECK(block == kBlock || block == 256, "activations quantize in blocks of 32 or 256");
  const int64_t rows = x.size(0), k = x.size(1);
  TORCH_CHECK(k % block == 0, "activations of ", k, " values a row: not whole blocks of ", block);
  struct Buffers {
    std::vector<int8_t> codes;
    std::vector<float> scales;
    std::vector<int16_t> sums, sums32;
  };
  thread_local Buffers sets[2];
  Buffers& b = sets[block == kBlock ? 0 : 1];
  b.codes.resize(std::max<size_t>(b.codes.size(), rows * k));
  b.scales.resize(std::max<size_t>(b.scales.size(), rows * k / block));
  b.sums.resize(std::max<size_t>(b.sums.size(), rows * k / 16));
  if (block != kBlock) b.sums32.resize(std::max<size_t>(b.sums32.size(), rows * k / 32));
  if (x.scalar_type() == torch::kBFloat16)
    quantize_rows(x.data_ptr<at::BFloat16>(), rows, k, block, b.codes.data(), b.scales.data(), b.sums.data(), portable);
  else if (x.scalar_type() == torch::kFloat)
    quantize_rows(x.data_ptr<float>(), rows, k, block, b.codes.data(), b.scales.data(), b.sums.data(), portable);
  else
    TORCH_CHECK(false, "quantized linear layers take float32 or bfloat16 activations, not ", x.scalar_type());
  if (block != kBlock)
    for (int64_t i = 0; i < rows * k / 32; ++i) b.sums32[i] = static_cast<int16_t>(b.sums[2 * i] + b.sums[2 * i + 1]);
  return {b.codes.data(), b.scales.data(), b.sums.data(), block != kBlock ? b.sums32.data() : nullptr, rows, k, block};
}

// -- one group of 16 output rows, for up to 4 activation rows: float sums [rows][16] -------------
// Portable: code u of lane `lane`, value v of a block's codes (and high bits).
template <int F>
inline int code_at(const uint8_t* codes, const uint8_t* high, int lane, int v) {
  using Tr = Traits<F>;
  const int t = v / 4, at = 4 * lane + v % 4;  // the step, and the byte of a step (or high-bits plane)
  int u;
  if constexpr (Tr::bits == 8) {
    u = codes[64 * t + at];
  } else if constexpr (Tr::bits <= 3) {  // value 8c + 4s + i: bits 2c of step s's byte
    u = (codes[64 * (t % 2) + at] >> (2 * (t / 2))) & 3;
    if constexpr (Tr::bits == 3) u |= ((high[at] >> t) & 1) << 2;
  } else {
    const uint8_t byte = codes[64 * (t % 4) + at];
    u = t >= 4 ? byte >> 4 : byte & 0x0F;
    if constexpr (Tr::bits == 5) u |= ((high[at] >> t) & 1) << 4;
    if constexpr (Tr::bits == 6) u |= ((high[64 * (t / 4) + at] >> (2 * (t % 4))) & 3) << 4;
  }
  if constexpr (Tr::lookup) u = Tr::table[u] + 128;
  return u;
}

inline float half_at(const uint8_t* p, int lane) {
  uint16_t h;
  std::memcpy(&h, p + 2 * lane, 2);
  return c10::detail::fp16_ieee_to_fp32_value(h);
}

// Lane `lane`'s d (or m) of a table of 16, float16 or (MXFP4) float32.
template <int F>
inline float scale_at(const uint8_t* p, int lane) {
  if constexpr (Traits<F>::scale_bytes == 4) {
    float d;
    std::memcpy(&d, p + 4 * lane, 4);
    return d;
  } else {
    return half_at(p, lane);
  }
}

// Record p's sub-scale (Min: sub-minimum) of block j's half h, lane `lane`.
template <int F, bool Min = false>
inline int sub_at(const uint8_t* p, int j, int h, int lane) {
  using Tr = Traits<F>;
  const uint8_t byte = p[(Min ? Tr::sub_min_at : Tr::scales_at) + Tr::sub(j, h) * kGroup + lane];
  if constexpr (Tr::paired) return Min ? byte >> 4 : byte & 0x0F;
  return Tr::signed_subs ? static_cast<int8_t>(byte) : byte;
}

template <int F>
void group_portable(const uint8_t* group, int64_t records, const Activations& a, int64_t row0, int rows,
                    float* sums, bool /*stream*/, Kept* /*kept*/) {
  using Tr = Traits<F>;
  for (int r = 0; r < rows; ++r) {
    const int8_t* xq = a.q(row0 + r);
    const float* dx = a.d(row0 + r);
    const int16_t* sx = a.s(row0 + r);
    for (int lane = 0; lane < kGroup; ++lane) {
      float total = 0.f;
      for (int64_t rec = 0; rec < records; ++rec) {
        const uint8_t* p = group + rec * Tr::record_bytes;
        int32_t scaled = 0, minimums = 0;  // a K record's, over its blocks (one activation scale)
        for (int j = 0; j < Tr::blocks; ++j) {
          const int64_t block = rec * Tr::blocks + j;
          int32_t dot[2] = {0, 0};
          for (int v = 0; v < kBlock; ++v)
            dot[v / 16] += code_at<F>(p + j * Tr::code_bytes, p + Tr::high_at + j * Tr::high_bytes, lane, v) *
                           xq[block * kBlock + v];
          const int32_t sum[2] = {sx[2 * block], sx[2 * block + 1]};
          if constexpr (!Tr::k_quant) {
            const float scale = scale_at<F>(p + Tr::scales_at, lane);
            if constexpr (Tr::has_min) {
              total += static_cast<float>(dot[0] + dot[1]) * dx[block] * scale;
              total += scale_at<F>(p + Tr::scales_at + Tr::scale_bytes * kGroup, lane) *
                       (dx[block] * static_cast<float>(sum[0] + sum[1]));
            } else {
              total += static_cast<float>(dot[0] + dot[1] - Tr::offset * (sum[0] + sum[1])) * dx[block] * scale;
            }
          } else {
            for (int h = 0; h < 2; ++h) {
              const int sc = sub_at<F>(p, j, h, lane);
              if constexpr (Tr::signed_subs) {
                scaled += (dot[h] - Tr::offset * sum[h]) * sc;
              } else {
                scaled += dot[h] * sc;
                minimums += sum[h] * sub_at<F, true>(p, j, h, lane);
              }
            }
          }
        }
        if constexpr (Tr::k_quant) {
          total += half_at(p + Tr::d_at, lane) * (static_cast<float>(scaled) * dx[rec]);
          if constexpr (Tr::sub_min)
            total -= half_at(p + Tr::d_at + 2 * kGroup, lane) * (static_cast<float>(minimums) * dx[rec]);
        }
      }
      sums[r * kGroup + lane] = total;
    }
  }
}

#if defined(__AVX2__) || defined(__AVX512F__)
// A lone pass over a group (a decode's rows: one pass of up to 4) reads each record once a call, from
// memory; the hardware prefetchers stop at each 4 KiB page, so it asks for its stream 4 KiB ahead,
// non-temporal (the records are not read again this step). The 250M model's Q4_K_M layers at batch
// 1 in turn, alternated in one process: 27.5 GB/s against 25.6 without (4 KiB T0: 28.1 but one slow
// round of six; 8 KiB: 27.4 and 26.8; 16 KiB: 25.0). The requests go out spread over a K record's
// blocks, a few lines between one block's dot products and the next: all of its 37 to 53 lines
// asked for at once overran the core's miss buffers and stalled it (16 layers of the 250M shapes
// from memory, alternated in one process: Q6_K 20.1 GB/s at once against 33.5 spread, Q4_K 26.6
// against 33.0; a second, far prefetch into L2 did not help).
constexpr int64_t kStreamAhead = 4096;

// Part j of `Parts` of a record's cache lines, kStreamAhead bytes on: non-temporal (on a Xeon, into
// L2) for a lone pass, into every level (Reused) for the first of several, whose later passes read
// the records' scales again.
template <int64_t Bytes, int Parts, bool Reused = false>
inline void prefetch_part(const uint8_t* record, int j) {
  constexpr int64_t lines = (Bytes + 63) / 64, per_part = (lines + Parts - 1) / Parts;
  for (int64_t line = j * per_part; line < std::min<int64_t>((j + 1) * per_part, lines); ++line)
    _mm_prefetch(reinterpret_cast<const char*>(record + kStreamAhead + 64 * line), Reused ? _MM_HINT_T0 : kStreamHint);
}
#endif

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
// A block's codes as 8 registers: w[t] pairs with activation bytes 4t..4t+3 in every lane.
template <int F>
inline void unpack(const uint8_t* codes, const uint8_t* high, __m512i w[8]) {
  constexpr int Bits = Traits<F>::bits;
  if constexpr (Bits == 8) {
    for (int t = 0; t < 8; ++t) w[t] = _mm512_loadu_si512(codes + 64 * t);
  } else if constexpr (Bits <= 3) {
    const __m512i low2 = _mm512_set1_epi8(0x03);
    for (int s = 0; s < 2; ++s) {
      const __m512i q = _mm512_loadu_si512(codes + 64 * s);
      for (int c = 0; c < 4; ++c) w[2 * c + s] = _mm512_and_si512(c ? _mm512_srli_epi16(q, 2 * c) : q, low2);
    }
    if constexpr (Bits == 3) {  // bit t of the plane's bytes to bit 2 of step t's
      const __m512i plane = _mm512_loadu_si512(high), bit = _mm512_set1_epi8(0x04);
      for (int t = 0; t < 8; ++t) {
        const __m512i at2 = t <= 2 ? _mm512_slli_epi16(plane, 2 - t) : _mm512_srli_epi16(plane, t - 2);
        w[t] = _mm512_ternarylogic_epi32(w[t], at2, bit, 0xF8);  // w | (at2 & bit)
      }
    }
  } else {
    const __m512i low4 = _mm512_set1_epi8(0x0F);
    for (int s = 0; s < 4; ++s) {
      const __m512i q = _mm512_loadu_si512(codes + 64 * s);
      w[s] = _mm512_and_si512(q, low4);
      w[4 + s] = _mm512_and_si512(_mm512_srli_epi16(q, 4), low4);
    }
    // The high bits, shifted to bit 4 (and 5) of their bytes and or-ed in: in 16-bit lanes, as
    // AVX-512 has no byte shifts; what crosses from the neighbouring byte is masked off.
    if constexpr (Bits == 5) {
      const __m512i plane = _mm512_loadu_si512(high), bit = _mm512_set1_epi8(0x10);
      for (int t = 0; t < 8; ++t) {
        const __m512i at4 = t <= 4 ? _mm512_slli_epi16(plane, 4 - t) : _mm512_srli_epi16(plane, t - 4);
        w[t] = _mm512_ternarylogic_epi32(w[t], at4, bit, 0xF8);  // w | (at4 & bit)
      }
    }
    if constexpr (Bits == 6) {
      const __m512i bits = _mm512_set1_epi8(0x30);
      for (int h = 0; h < 2; ++h) {
        const __m512i plane = _mm512_loadu_si512(high + 64 * h);
        const __m512i at4[4] = {_mm512_slli_epi16(plane, 4), _mm512_slli_epi16(plane, 2), plane,
                                _mm512_srli_epi16(plane, 2)};
        for (int q = 0; q < 4; ++q) w[4 * h + q] = _mm512_ternarylogic_epi32(w[4 * h + q], at4[q], bits, 0xF8);
      }
    }
  }
  if constexpr (Traits<F>::lookup) {  // each code's table value + 128, one byte shuffle a register
    const __m128i values = _mm_loadu_si128(reinterpret_cast<const __m128i*>(Traits<F>::table));
    const __m512i table = _mm512_broadcast_i32x4(_mm_xor_si128(values, _mm_set1_epi8(static_cast<char>(0x80))));
    for (int t = 0; t < 8; ++t) w[t] = _mm512_shuffle_epi8(table, w[t]);
  }
}

// Block `block` of a group's codes: unpacked from its record, and kept for the passes after the
// first (Kept), or loaded as the first pass kept them.
template <int F>
inline void block_codes(const uint8_t* codes, const uint8_t* high, __m512i w[8], Kept* kept, int64_t block) {
  constexpr bool keeps = Traits<F>::bits != 8;
  if (keeps && kept != nullptr) {
    uint8_t* at = kept->codes + 512 * block;
    if (kept->filled) {
      for (int t = 0; t < 8; ++t) w[t] = _mm512_load_si512(at + 64 * t);
      return;
    }
    unpack<F>(codes, high, w);
    for (int t = 0; t < 8; ++t) _mm512_store_si512(at + 64 * t, w[t]);
    return;
  }
  unpack<F>(codes, high, w);
}

// The integer dot products of a block's 16 rows with one activation row's 32 codes: over all 32
// values, or (Split) over each half of 16. Each 4-byte word of activations is broadcast straight
// from memory (dpbusd's embedded broadcast), and the sums build in two chains that meet at the end,
// so that one row's products do not wait on each other (a decode has no other row to overlap).
inline __m512i word(const int8_t* x, int t) {
  int32_t value;
  std::memcpy(&value, x + 4 * t, 4);
  return _mm512_set1_epi32(value);
}

// Of several rows: each row's products in one chain a half (values 0-15, 16-31), the rows' chains
// overlapping one another; a lone row takes dots' four.
inline void half_chains(const __m512i w[8], const int8_t* x, __m512i& low, __m512i& high) {
  low = high = _mm512_setzero_si512();
  for (int t = 0; t < 4; ++t) {
    low = _mm512_dpbusd_epi32(low, w[t], word(x, t));
    high = _mm512_dpbusd_epi32(high, w[4 + t], word(x, 4 + t));
  }
}

template <bool Split>
inline void dots(const __m512i w[8], const int8_t* x, __m512i& low, __m512i& high) {
  __m512i a = _mm512_setzero_si512(), b = _mm512_setzero_si512(), c = _mm512_setzero_si512(),
          d = _mm512_setzero_si512();
  a = _mm512_dpbusd_epi32(a, w[0], word(x, 0));
  b = _mm512_dpbusd_epi32(b, w[1], word(x, 1));
  c = _mm512_dpbusd_epi32(c, w[4], word(x, 4));
  d = _mm512_dpbusd_epi32(d, w[5], word(x, 5));
  a = _mm512_dpbusd_epi32(a, w[2], word(x, 2));
  b = _mm512_dpbusd_epi32(b, w[3], word(x, 3));
  c = _mm512_dpbusd_epi32(c, w[6], word(x, 6));
  d = _mm512_dpbusd_epi32(d, w[7], word(x, 7));
  low = _mm512_add_epi32(a, b);
  high = _mm512_add_epi32(c, d);
  if constexpr (!Split) {
    low = _mm512_add_epi32(low, high);
    high = _mm512_setzero_si512();
  }
}

// Two int16 activation sums (per 16 values) broadcast as one 32-bit word, for vpdpwssd.
inline __m512i pair_word(const int16_t* s) {
  int32_t value;
  std::memcpy(&value, s, 4);
  return _mm512_set1_epi32(value);
}

// A block's 16 integer dot products with one row of a pass of R rows.
template <int R>
inline __m512i row_dot(const __m512i w[8], const int8_t* x) {
  __m512i low, high;
  if constexpr (R == 1) {
    dots<false>(w, x, low, high);
    return low;
  } else {
    half_chains(w, x, low, high);
    return _mm512_add_epi32(low, high);
  }
}

// Record p's sub-scales (Min: sub-minimums) of row `row` of its table as int32 lanes, signed or not
// as the format's are.
template <int F, bool Min = false>
inline __m512i sub_row(const uint8_t* p, int row) {
  using Tr = Traits<F>;
  const uint8_t* at = p + (Min ? Tr::sub_min_at : Tr::scales_at) + row * kGroup;
  const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(at));
  if constexpr (Tr::signed_subs) return _mm512_cvtepi8_epi32(bytes);
  const __m512i v = _mm512_cvtepu8_epi32(bytes);
  if constexpr (Tr::paired) return Min ? _mm512_srli_epi32(v, 4) : _mm512_and_si512(v, _mm512_set1_epi32(0x0F));
  return v;
}

// The same, of block j's half h.
template <int F, bool Min = false>
inline __m512i sub_lanes(const uint8_t* p, int j, int h) {
  return sub_row<F, Min>(p, Traits<F>::sub(j, h));
}

// A K record's int16 weight pairs for its activation sums, pair i: rows 2i and 2i + 1 of its table
// of sub-minimums, or of sub-scales where its codes are offset. Against the sums of the values
// that those rows cover (per 16 where a record has 16 sub-blocks, else per 32): subs / 2 pairs.
template <int F>
inline __m512i sum_weights(const uint8_t* p, int i) {
  using Tr = Traits<F>;
  const __m512i lo = sub_row<F, Tr::sub_min>(p, 2 * i), hi = sub_row<F, Tr::sub_min>(p, 2 * i + 1);
  return _mm512_mask_blend_epi16(0xAAAAAAAA, lo, _mm512_slli_epi32(hi, 16));
}

inline __m512 halves(const uint8_t* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

// A table of 16 d (or m), float16 or float32.
template <int F>
inline __m512 scales16(const uint8_t* p) {
  if constexpr (Traits<F>::scale_bytes == 4)
    return _mm512_loadu_ps(reinterpret_cast<const float*>(p));
  else
    return halves(p);
}

// v x the format's code offset, as int32 lanes (a shift where it is a power of two).
template <int F>
inline __m512i times_offset(__m512i v) {
  constexpr int offset = Traits<F>::offset;
  if constexpr ((offset & (offset - 1)) == 0)
    return _mm512_slli_epi32(v, __builtin_ctz(offset));
  else
    return _mm512_mullo_epi32(v, _mm512_set1_epi32(offset));
}

// A K record's block j for N rows of a pass of R: the codes' integer sums, scaled by the sub-block
// scales, into scaled.
template <int F, int R, int N>
inline void k_rows(__m512i (&scaled)[N], const __m512i w[8], const uint8_t* p, int j, const int8_t* const* xq,
                   int64_t at) {
  using Tr = Traits<F>;
  if constexpr (Tr::subs == 16) {
    const __m512i sc0 = sub_lanes<F>(p, j, 0), sc1 = sub_lanes<F>(p, j, 1);
    for (int r = 0; r < N; ++r) {
      __m512i low, high;
      if constexpr (R == 1)
        dots<true>(w, xq[r] + at, low, high);
      else
        half_chains(w, xq[r] + at, low, high);
      scaled[r] = _mm512_add_epi32(scaled[r], _mm512_add_epi32(_mm512_mullo_epi32(low, sc0), _mm512_mullo_epi32(high, sc1)));
    }
  } else {
    const __m512i sub_scale = sub_lanes<F>(p, j, 0);
    for (int r = 0; r < N; ++r)
      scaled[r] = _mm512_add_epi32(scaled[r], _mm512_mullo_epi32(row_dot<R>(w, xq[r] + at), sub_scale));
  }
}

// A K record's end for N rows: the activation sums' terms (weights from sum_weights) and the
// record's scales, added into the float sums [N][16].
template <int F, int N>
inline void k_record(const __m512i (&scaled)[N], const __m512i weights[8], const uint8_t* p, int64_t rec,
                     const int16_t* const* sx, const float* const* dx, float* sums) {
  using Tr = Traits<F>;
  const __m512 d = halves(p + Tr::d_at);
  for (int r = 0; r < N; ++r) {
    __m512i minimums = _mm512_setzero_si512();
    for (int i = 0; i < Tr::subs / 2; ++i)
      minimums = _mm512_dpwssd_epi32(minimums, weights[i], pair_word(sx[r] + rec * Tr::subs + 2 * i));
    const __m512 dx_rec = _mm512_set1_ps(dx[r][rec]);
    __m512 sum = _mm512_loadu_ps(sums + r * kGroup);
    if constexpr (Tr::signed_subs) {  // codes are `offset` over their values: sum (code - offset) x scale
      const __m512i centred = _mm512_sub_epi32(scaled[r], times_offset<F>(minimums));
      sum = _mm512_fmadd_ps(d, _mm512_mul_ps(_mm512_cvtepi32_ps(centred), dx_rec), sum);
    } else {
      sum = _mm512_fmadd_ps(d, _mm512_mul_ps(_mm512_cvtepi32_ps(scaled[r]), dx_rec), sum);
      sum = _mm512_fnmadd_ps(halves(p + Tr::d_at + 2 * kGroup), _mm512_mul_ps(_mm512_cvtepi32_ps(minimums), dx_rec), sum);
    }
    _mm512_storeu_ps(sums + r * kGroup, sum);
  }
}

// A record of a format of 32 values a record (not a K type) added into one row's float sums: its 16
// integer dot products with the row, `sum` the row's code sum over the record, dx its scale.
template <int F>
inline __m512 record_sum(__m512 total, __m512i dot, int32_t sum, float dx, const uint8_t* p) {
  using Tr = Traits<F>;
  const __m512 scale = scales16<F>(p + Tr::scales_at), d = _mm512_set1_ps(dx);
  if constexpr (Tr::has_min) {
    total = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(dot), d), scale, total);
    return _mm512_fmadd_ps(scales16<F>(p + Tr::scales_at + Tr::scale_bytes * kGroup),
                           _mm512_set1_ps(dx * static_cast<float>(sum)), total);
  }
  const __m512i centred = _mm512_sub_epi32(dot, _mm512_set1_epi32(Tr::offset * sum));
  return _mm512_fmadd_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(centred), d), scale, total);
}

template <int F, int R>
void group_vnni(const uint8_t* group, int64_t records, const Activations& a, int64_t row0, float* sums,
                bool stream, Kept* kept) {
  using Tr = Traits<F>;
  __m512 total[R];
  const int8_t* xq[R];
  const float* dx[R];
  const int16_t* sx[R];
  const int16_t* sw[R];  // the sums sum_weights pairs with: per 16, or per 32 (8 sub-blocks a record)
  for (int r = 0; r < R; ++r) {
    total[r] = _mm512_setzero_ps();
    if constexpr (Tr::k_quant) _mm512_storeu_ps(sums + r * kGroup, total[r]);
    xq[r] = a.q(row0 + r);
    dx[r] = a.d(row0 + r);
    sx[r] = a.s(row0 + r);
    if constexpr (Tr::k_quant) sw[r] = Tr::subs == 16 ? sx[r] : a.s32(row0 + r);
  }
  __m512i w[8];
  // The first of a call's passes reads the records from memory, the others from cache.
  const bool first_of_several = kept != nullptr && !kept->filled;
  for (int64_t rec = 0; rec < records; ++rec) {
    const uint8_t* p = group + rec * Tr::record_bytes;
    if (!Tr::k_quant && stream) prefetch_part<Tr::record_bytes, 1>(p, 0);
    if (!Tr::k_quant && first_of_several) prefetch_part<Tr::record_bytes, 1, true>(p, 0);
    if constexpr (!Tr::k_quant) {
      block_codes<F>(p, p + Tr::high_at, w, kept, rec);
      for (int r = 0; r < R; ++r)
        total[r] = record_sum<F>(total[r], row_dot<R>(w, xq[r] + rec * kBlock), sx[r][2 * rec] + sx[r][2 * rec + 1],
                                 dx[r][rec], p);
    } else {
      // The record's block sums stay integers (one activation scale covers the record): at most
      // 8 x 32 x 31 x 127 x 63 for Q5_K, 16 x 16 x 63 x 127 x 128 for Q6_K, 8 x 32 x 241 x 127 x 32
      // for IQ4_XS, inside int32.
      // Rows in two arrays of at most 4 (k_rows'): GCC keeps such an array in registers, one of
      // 8 on the stack.
      constexpr int A = R < 4 ? R : 4, B = R - A;
      __m512i scaled_a[A], scaled_b[B > 0 ? B : 1];
      for (int r = 0; r < A; ++r) scaled_a[r] = _mm512_setzero_si512();
      for (int r = 0; r < B; ++r) scaled_b[r] = _mm512_setzero_si512();
      for (int j = 0; j < Tr::blocks; ++j) {
        if (stream) prefetch_part<Tr::record_bytes, Tr::blocks>(p, j);
        if (first_of_several) prefetch_part<Tr::record_bytes, Tr::blocks, true>(p, j);
        block_codes<F>(p + j * Tr::code_bytes, p + Tr::high_at + j * Tr::high_bytes, w, kept, rec * Tr::blocks + j);
        const int64_t at = (rec * Tr::blocks + j) * kBlock;
        k_rows<F, R, A>(scaled_a, w, p, j, xq, at);
        if constexpr (B > 0) k_rows<F, R, B>(scaled_b, w, p, j, xq + A, at);
      }
      // The terms of the activation sums (the minimums', Q6_K's offset of 32), once the codes' are
      // done and their registers free: one vpdpwssd a block, a lane's two int16 weights (the
      // sub-minimum twice; Q6_K's two half-block scales) against the block's two int16 sums per 16,
      // broadcast as one word. The float sums wait in memory, a record's work apart.
      for (int i = 0; i < Tr::subs / 2; ++i) w[i] = sum_weights<F>(p, i);
      k_record<F, A>(scaled_a, w, p, rec, sw, dx, sums);
      if constexpr (B > 0) k_record<F, B>(scaled_b, w, p, rec, sw + A, dx + A, sums + A * kGroup);
    }
  }
  if constexpr (!Tr::k_quant)
    for (int r = 0; r < R; ++r) _mm512_storeu_ps(sums + r * kGroup, total[r]);
}
#if defined(__AMX_TILE__) && defined(__AMX_INT8__)
#define PAGEDLLM_QUANT_AMX 1
// -- AMX: passes of 16 activation rows -----------------------------------------------------------
// A block's unpacked codes are already the layout of an AMX B tile (row t: each lane's 4 codes at
// inputs 4t..4t+3), and 16 activation rows' codes, `k` bytes apart, an A tile: one tdpbsud (signed
// activations, unsigned codes) a block gives the 16 x 16 int32 dot products that dpbusd builds
// lane by lane, the same integers. The rest of a pass (sub-scales, minimums, float sums in record
// order) is group_vnni's, row by row: a row's sums are bit for bit those of a pass of 1 to 8 rows.

// Whether this process may use AMX tiles: Linux hands out the tile state on request, once a process.
bool amx_allowed() {
  static const bool allowed = [] {
    constexpr long kRequestPermission = 0x1023, kTileData = 18;  // ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA
    return syscall(SYS_arch_prctl, kRequestPermission, kTileData) == 0;
  }();
  return allowed;
}

// The tiles: 0, 1 two blocks' activations (16 rows x 32 bytes), 2, 3 their codes (8 rows x 64
// bytes), 4, 5 their dot products (16 rows x 16 int32), so that one block's products build while
// the other's are stored.
void configure_tiles() {
  struct alignas(64) {
    uint8_t palette = 1, start_row = 0, reserved[14] = {};
    uint16_t colsb[16] = {32, 32, 64, 64, 64, 64};
    uint8_t rows[16] = {kMaxPassRows, kMaxPassRows, 8, 8, kMaxPassRows, kMaxPassRows};
  } config;
  _tile_loadconfig(&config);
}

// Dot products [block][row][lane] of a record's blocks' codes (codes[j]: 8 x 64 bytes, as unpack's
// registers) with 16 activation rows (from x, `stride` bytes apart).
template <int Blocks>
inline void record_dots(const int8_t* x, int64_t stride, const uint8_t* const* codes,
                        int32_t (*dots)[kMaxPassRows][kGroup]) {
  for (int j = 0; j < Blocks; j += 2) {
    _tile_zero(4);
    _tile_loadd(0, x + j * kBlock, stride);
    _tile_loadd(2, codes[j], 64);
    _tile_dpbsud(4, 0, 2);
    if (j + 1 < Blocks) {
      _tile_zero(5);
      _tile_loadd(1, x + (j + 1) * kBlock, stride);
      _tile_loadd(3, codes[j + 1], 64);
      _tile_dpbsud(5, 1, 3);
    }
    _tile_stored(4, dots[j], 64);
    if (j + 1 < Blocks) _tile_stored(5, dots[j + 1], 64);
  }
}

// Block `block` of a record as record_dots reads it: the pass's kept codes (unpacked into them by
// the call's first pass).
template <int F>
inline const uint8_t* tile_codes(const uint8_t* codes, const uint8_t* high, Kept* kept, int64_t block) {
  __m512i w[8];
  block_codes<F>(codes, high, w, kept, block);
  return kept->codes + 512 * block;
}

// group_vnni's sums for 16 rows (a pass of a call of several, whose codes are kept): sums [16][16].
template <int F>
void group_amx(const uint8_t* group, int64_t records, const Activations& a, int64_t row0, float* sums, Kept* kept) {
  using Tr = Traits<F>;
  static_assert(Tr::tiles, "a format of Traits::tiles");
  constexpr int Blocks = Tr::blocks, R = kMaxPassRows;
  if (kept->tiles->config < 0) {
    configure_tiles();
    kept->tiles->config = 0;
  }
  alignas(64) int32_t dots[Blocks][R][kGroup];
  const int8_t* x = a.q(row0);
  const float* dx[R];
  const int16_t* sw[R];
  for (int r = 0; r < R; ++r) {
    _mm512_storeu_ps(sums + r * kGroup, _mm512_setzero_ps());
    dx[r] = a.d(row0 + r);
    sw[r] = Tr::k_quant ? a.s32(row0 + r) : a.s(row0 + r);
  }
  const bool first_of_several = !kept->filled;
  for (int64_t rec = 0; rec < records; ++rec) {
    const uint8_t* p = group + rec * Tr::record_bytes;
    const uint8_t* codes[Blocks];
    for (int j = 0; j < Blocks; ++j) {
      if (first_of_several) prefetch_part<Tr::record_bytes, Blocks, true>(p, j);
      codes[j] = tile_codes<F>(p + j * Tr::code_bytes, p + Tr::high_at + j * Tr::high_bytes, kept, rec * Blocks + j);
    }
    record_dots<Blocks>(x + rec * Blocks * kBlock, a.k, codes, dots);
    if constexpr (!Tr::k_quant) {
      for (int r = 0; r < R; ++r) {
        const __m512 total = _mm512_loadu_ps(sums + r * kGroup);
        _mm512_storeu_ps(sums + r * kGroup, record_sum<F>(total, _mm512_load_si512(dots[0][r]),
                                                          sw[r][2 * rec] + sw[r][2 * rec + 1], dx[r][rec], p));
      }
    } else {
      __m512i weights[8];
      for (int i = 0; i < Tr::subs / 2; ++i) weights[i] = sum_weights<F>(p, i);
      for (int r0 = 0; r0 < R; r0 += 4) {
        __m512i scaled[4];
        for (int r = 0; r < 4; ++r) {
          scaled[r] = _mm512_setzero_si512();
          for (int j = 0; j < Blocks; ++j)
            scaled[r] = _mm512_add_epi32(
                scaled[r], _mm512_mullo_epi32(_mm512_load_si512(dots[j][r0 + r]), sub_lanes<F>(p, j, 0)));
        }
        k_record<F, 4>(scaled, weights, p, rec, sw + r0, dx + r0, sums + r0 * kGroup);
      }
    }
  }
}
#endif

#endif

#if !(defined(__AVX512VNNI__) && defined(__AVX512BW__)) && defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define PAGEDLLM_QUANT_AVX2 1
// -- CPUs without AVX-512 (AVX2: AMD Zen 2/3, Intel's client cores) ----------------------------
// The same records, half a record's lanes (8 rows) a 256-bit register. AVX2 has no dpbusd:
// maddubs multiplies a lane's 4 codes by 4 activation codes into two int16 sums, which add up in
// int16 as long as they cannot overflow and are then widened to int32 by madd (by ones).

// Codes and high-bit planes of one half, already offset by 32 bytes a half: as unpack's.
template <int F>
inline void unpack8(const uint8_t* codes, const uint8_t* high, __m256i w[8]) {
  constexpr int Bits = Traits<F>::bits;
  auto load = [](const uint8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); };
  if constexpr (Bits == 8) {
    for (int t = 0; t < 8; ++t) w[t] = load(codes + 64 * t);
  } else if constexpr (Bits <= 3) {
    const __m256i low2 = _mm256_set1_epi8(0x03);
    for (int s = 0; s < 2; ++s) {
      const __m256i q = load(codes + 64 * s);
      for (int c = 0; c < 4; ++c) w[2 * c + s] = _mm256_and_si256(c ? _mm256_srli_epi16(q, 2 * c) : q, low2);
    }
    if constexpr (Bits == 3) {
      const __m256i plane = load(high), bit = _mm256_set1_epi8(0x04);
      for (int t = 0; t < 8; ++t) {
        const __m256i at2 = t <= 2 ? _mm256_slli_epi16(plane, 2 - t) : _mm256_srli_epi16(plane, t - 2);
        w[t] = _mm256_or_si256(w[t], _mm256_and_si256(at2, bit));
      }
    }
  } else {
    const __m256i low4 = _mm256_set1_epi8(0x0F);
    for (int s = 0; s < 4; ++s) {
      const __m256i q = load(codes + 64 * s);
      w[s] = _mm256_and_si256(q, low4);
      w[4 + s] = _mm256_and_si256(_mm256_srli_epi16(q, 4), low4);
    }
    if constexpr (Bits == 5) {
      const __m256i plane = load(high), bit = _mm256_set1_epi8(0x10);
      for (int t = 0; t < 8; ++t) {
        const __m256i at4 = t <= 4 ? _mm256_slli_epi16(plane, 4 - t) : _mm256_srli_epi16(plane, t - 4);
        w[t] = _mm256_or_si256(w[t], _mm256_and_si256(at4, bit));
      }
    }
    if constexpr (Bits == 6) {
      const __m256i bits = _mm256_set1_epi8(0x30);
      for (int h = 0; h < 2; ++h) {
        const __m256i plane = load(high + 64 * h);
        const __m256i at4[4] = {_mm256_slli_epi16(plane, 4), _mm256_slli_epi16(plane, 2), plane,
                                _mm256_srli_epi16(plane, 2)};
        for (int q = 0; q < 4; ++q) w[4 * h + q] = _mm256_or_si256(w[4 * h + q], _mm256_and_si256(at4[q], bits));
      }
    }
  }
  if constexpr (Traits<F>::lookup) {
    const __m128i values = _mm_loadu_si128(reinterpret_cast<const __m128i*>(Traits<F>::table));
    const __m256i table = _mm256_broadcastsi128_si256(_mm_xor_si128(values, _mm_set1_epi8(static_cast<char>(0x80))));
    for (int t = 0; t < 8; ++t) w[t] = _mm256_shuffle_epi8(table, w[t]);
  }
}

// Step t's int16 pair sums: codes w times activation bytes 4t..4t+3. 8-bit codes are u = q + 128,
// whose products with int8 would overflow maddubs' int16: they go as |q| times x with q's sign.
template <int Wide>
inline __m256i products(__m256i w, const int8_t* x, int t) {
  int32_t value;
  std::memcpy(&value, x + 4 * t, 4);
  const __m256i xs = _mm256_set1_epi32(value);
  if constexpr (Wide == 8) {
    const __m256i q = _mm256_xor_si256(w, _mm256_set1_epi8(static_cast<char>(0x80)));
    return _mm256_maddubs_epi16(_mm256_abs_epi8(q), _mm256_sign_epi8(xs, q));
  }
  return _mm256_maddubs_epi16(w, xs);
}

inline __m256i widen16(__m256i s) { return _mm256_madd_epi16(s, _mm256_set1_epi16(1)); }

// Steps first..first + 3's int16 pair sums, added and widened to int32 by madd with the int16
// factors f: in int16 as many at a time as cannot overflow (a pair sum is at most 2 x 15 x 127 for
// codes of up to 4 bits, 2 x 31 x 127 for 5, 2 x 63 x 127 for 6, 2 x 128 x 127 for 8: 4, 4, 2, 1).
template <int Wide>
inline __m256i half_sum(const __m256i m[8], int first, __m256i f) {
  constexpr int per = Wide <= 5 ? 4 : Wide == 6 ? 2 : 1;
  __m256i total = _mm256_setzero_si256();
  for (int c = first; c < first + 4; c += per) {
    __m256i part = m[c];
    for (int k = 1; k < per; ++k) part = _mm256_add_epi16(part, m[c + k]);
    total = _mm256_add_epi32(total, _mm256_madd_epi16(part, f));
  }
  return total;
}

// The int32 dot products of 8 rows with one activation row's 32 codes, over values 0..15 (low)
// and 16..31 (high); 4-bit codes give all 32 in low. For 8-bit codes (tables' values included)
// these are the products of q = u - 128, not of u.
template <int Wide>
inline void dots8(const __m256i w[8], const int8_t* x, __m256i& low, __m256i& high) {
  __m256i m[8];
  for (int t = 0; t < 8; ++t) m[t] = products<Wide>(w[t], x, t);
  if constexpr (Wide <= 4) {  // all 8 steps in int16: at most 16 products of 15 x 127
    const __m256i a = _mm256_add_epi16(_mm256_add_epi16(m[0], m[1]), _mm256_add_epi16(m[2], m[3]));
    const __m256i b = _mm256_add_epi16(_mm256_add_epi16(m[4], m[5]), _mm256_add_epi16(m[6], m[7]));
    low = widen16(_mm256_add_epi16(a, b));
    high = _mm256_setzero_si256();
  } else {
    const __m256i ones = _mm256_set1_epi16(1);
    low = half_sum<Wide>(m, 0, ones);
    high = half_sum<Wide>(m, 4, ones);
  }
}

inline __m256 halves8(const uint8_t* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

// Half `lanes`' d (or m), float16 or float32, from a table of 16.
template <int F>
inline __m256 scales8(const uint8_t* p, int64_t lanes) {
  if constexpr (Traits<F>::scale_bytes == 4)
    return _mm256_loadu_ps(reinterpret_cast<const float*>(p) + lanes);
  else
    return halves8(p + 2 * lanes);
}

// A K block's codes times one activation row's, each lane's sum times its sub-scales (lo for
// values 0..15, hi for 16..31; the same where one covers 32 values): the int16 pair sums of the
// products are widened by madd with the scale in both halves of the lane, (a + b) x scale exactly
// as int32.
template <int Wide>
inline __m256i scaled_dots8(const __m256i w[8], const int8_t* x, __m256i lo, __m256i hi) {
  __m256i m[8];
  for (int t = 0; t < 8; ++t) m[t] = products<Wide>(w[t], x, t);
  return _mm256_add_epi32(half_sum<Wide>(m, 0, lo), half_sum<Wide>(m, 4, hi));
}

// 8 bytes (a half's lanes of a [.][16] table) as int32, unsigned or signed.
inline __m256i u8x8(const uint8_t* p) { return _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))); }
inline __m256i i8x8(const uint8_t* p) { return _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))); }
// Two int32 lanes' low halves as one lane's int16 pair (lo, hi): madd's factors.
inline __m256i pair16(__m256i lo, __m256i hi) {
  return _mm256_or_si256(_mm256_and_si256(lo, _mm256_set1_epi32(0xFFFF)), _mm256_slli_epi32(hi, 16));
}
inline __m256i twice16(__m256i v) { return pair16(v, v); }

// Half `lanes` of sub_lanes.
template <int F, bool Min = false>
inline __m256i sub_lanes8(const uint8_t* p, int j, int h, int64_t lanes) {
  using Tr = Traits<F>;
  const uint8_t* at = p + (Min ? Tr::sub_min_at : Tr::scales_at) + Tr::sub(j, h) * kGroup + lanes;
  if constexpr (Tr::signed_subs) return i8x8(at);
  const __m256i v = u8x8(at);
  if constexpr (Tr::paired) return Min ? _mm256_srli_epi32(v, 4) : _mm256_and_si256(v, _mm256_set1_epi32(0x0F));
  return v;
}

// A K record's int16 pairs for block j's activation sums per 16 (half `lanes`), as sum_weights.
template <int F>
inline __m256i sum_weights8(const uint8_t* p, int j, int64_t lanes) {
  using Tr = Traits<F>;
  return pair16(sub_lanes8<F, Tr::sub_min>(p, j, 0, lanes), sub_lanes8<F, Tr::sub_min>(p, j, 1, lanes));
}

// v x the format's code offset, as int32 lanes.
template <int F>
inline __m256i times_offset8(__m256i v) {
  return _mm256_mullo_epi32(v, _mm256_set1_epi32(Traits<F>::offset));
}

// group_vnni's sums for one half (rows 8 half .. 8 half + 7) of a record, added into total.
template <int F, int R>
inline void half_avx2(const uint8_t* p, int64_t rec, int half, const int8_t* const* xq, const float* const* dx,
                      const int16_t* const* sx, __m256* total) {
  using Tr = Traits<F>;
  constexpr int offset = Tr::wide == 8 ? 0 : Tr::offset;  // 8-bit codes' products are already signed
  const int64_t at = 32 * half, lanes = 8 * half;  // bytes into a step or plane; lanes into a table
  __m256i w[8];
  if constexpr (!Tr::k_quant) {
    unpack8<F>(p + at, p + Tr::high_at + at, w);
    const __m256 scale = scales8<F>(p + Tr::scales_at, lanes);
    for (int r = 0; r < R; ++r) {
      __m256i low, high;
      dots8<Tr::wide>(w, xq[r] + rec * kBlock, low, high);
      const __m256i dot = _mm256_add_epi32(low, high);
      const int32_t sum = sx[r][2 * rec] + sx[r][2 * rec + 1];
      const __m256 d = _mm256_set1_ps(dx[r][rec]);
      if constexpr (Tr::has_min) {
        total[r] = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(dot), d), scale, total[r]);
        total[r] = _mm256_fmadd_ps(scales8<F>(p + Tr::scales_at + Tr::scale_bytes * kGroup, lanes),
                                   _mm256_set1_ps(dx[r][rec] * static_cast<float>(sum)), total[r]);
      } else {
        const __m256i centred = _mm256_sub_epi32(dot, _mm256_set1_epi32(offset * sum));
        total[r] = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(centred), d), scale, total[r]);
      }
    }
    return;
  }
  // Integers over the record, as group_vnni's: the sub-scaled dots, and the activations' sums per
  // 16 times sum_weights8 (the sub-minimums' term; the offset of a signed format's codes).
  __m256i scaled[R], minimums[R];
  for (int r = 0; r < R; ++r) scaled[r] = minimums[r] = _mm256_setzero_si256();
  for (int j = 0; j < Tr::blocks; ++j) {
    const int64_t block = rec * Tr::blocks + j;
    unpack8<F>(p + j * Tr::code_bytes + at, p + Tr::high_at + j * Tr::high_bytes + at, w);
    const __m256i lo = twice16(sub_lanes8<F>(p, j, 0, lanes));
    const __m256i hi = Tr::subs == 16 ? twice16(sub_lanes8<F>(p, j, 1, lanes)) : lo;
    for (int r = 0; r < R; ++r)
      scaled[r] = _mm256_add_epi32(scaled[r], scaled_dots8<Tr::wide>(w, xq[r] + block * kBlock, lo, hi));
  }
  if constexpr (Tr::sub_min || offset != 0) {
    for (int j = 0; j < Tr::blocks; ++j) {
      const __m256i weights = sum_weights8<F>(p, j, lanes);
      for (int r = 0; r < R; ++r) {
        int32_t sums;  // the block's two activation sums per 16, an int16 pair
        std::memcpy(&sums, sx[r] + 2 * (rec * Tr::blocks + j), 4);
        minimums[r] = _mm256_add_epi32(minimums[r], _mm256_madd_epi16(weights, _mm256_set1_epi32(sums)));
      }
    }
  }
  if constexpr (Tr::signed_subs && offset != 0)
    for (int r = 0; r < R; ++r) scaled[r] = _mm256_sub_epi32(scaled[r], times_offset8<F>(minimums[r]));
  const __m256 d = halves8(p + Tr::d_at + 2 * lanes);
  for (int r = 0; r < R; ++r) {
    const __m256 dx_rec = _mm256_set1_ps(dx[r][rec]);
    total[r] = _mm256_fmadd_ps(d, _mm256_mul_ps(_mm256_cvtepi32_ps(scaled[r]), dx_rec), total[r]);
    if constexpr (Tr::sub_min)
      total[r] = _mm256_fnmadd_ps(halves8(p + Tr::d_at + 2 * kGroup + 2 * lanes),
                                  _mm256_mul_ps(_mm256_cvtepi32_ps(minimums[r]), dx_rec), total[r]);
  }
}

template <int F, int R>
void group_avx2(const uint8_t* group, int64_t records, const Activations& a, int64_t row0, float* sums,
                bool stream, Kept* /*kept*/) {
  using Tr = Traits<F>;
  __m256 total[2][R];
  const int8_t* xq[R];
  const float* dx[R];
  const int16_t* sx[R];
  for (int r = 0; r < R; ++r) {
    total[0][r] = total[1][r] = _mm256_setzero_ps();
    xq[r] = a.q(row0 + r);
    dx[r] = a.d(row0 + r);
    sx[r] = a.s(row0 + r);
  }
  for (int64_t rec = 0; rec < records; ++rec) {
    const uint8_t* p = group + rec * Tr::record_bytes;
    for (int half = 0; half < 2; ++half) {
      if (stream) prefetch_part<Tr::record_bytes, 2>(p, half);
      half_avx2<F, R>(p, rec, half, xq, dx, sx, total[half]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int half = 0; half < 2; ++half) _mm256_storeu_ps(sums + r * kGroup + 8 * half, total[half][r]);
}
#endif


TileState::~TileState() {
#if defined(PAGEDLLM_QUANT_AMX)
  if (config >= 0) _tile_release();
#endif
}

using GroupFn = void (*)(const uint8_t*, int64_t, const Activations&, int64_t, int, float*, bool, Kept*);

template <int F>
void group_rows(const uint8_t* group, int64_t records, const Activations& a, int64_t row0, int rows, float* sums,
                bool stream, Kept* kept) {
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#if defined(PAGEDLLM_QUANT_AMX)
  if constexpr (Traits<F>::tiles)
    if (rows == kMaxPassRows) return group_amx<F>(group, records, a, row0, sums, kept);
#endif
  // A record's unpacking is shared by the rows of a pass: up to 8 rows a pass (BENCHMARKS.md). Q8_0's
  // codes need no unpacking: it takes more rows in passes of 4 (no faster in 8), the group's records
  // staying in L1 for the next pass, but 5 to 8 rows (a verification of speculative drafts) in one
  // pass as they stream from memory, where two passes of 4 took about as long as memory and
  // arithmetic one after the other.
  if (F != kQ8_0 || stream) {
    switch (rows) {
      case 5: return group_vnni<F, 5>(group, records, a, row0, sums, stream, kept);
      case 6: return group_vnni<F, 6>(group, records, a, row0, sums, stream, kept);
      case 7: return group_vnni<F, 7>(group, records, a, row0, sums, stream, kept);
      case 8: return group_vnni<F, 8>(group, records, a, row0, sums, stream, kept);
    }
  } else if (rows > 4) {
    group_rows<F>(group, records, a, row0, 4, sums, stream, kept);
    return group_rows<F>(group, records, a, row0 + 4, rows - 4, sums + 4 * kGroup, false, kept);
  }
  switch (rows) {
    case 1: return group_vnni<F, 1>(group, records, a, row0, sums, stream, kept);
    case 2: return group_vnni<F, 2>(group, records, a, row0, sums, stream, kept);
    case 3: return group_vnni<F, 3>(group, records, a, row0, sums, stream, kept);
    default: return group_vnni<F, 4>(group, records, a, row0, sums, stream, kept);
  }
#elif defined(PAGEDLLM_QUANT_AVX2)
  // Passes of up to 8 rows share each record's unpacking, but the sub-minimum types' 8 rows spill
  // their accumulators: two passes of 4 where the records stay in cache (not streamed).
  if (Traits<F>::sub_min && !stream && rows > 4) {
    group_rows<F>(group, records, a, row0, 4, sums, stream, kept);
    return group_rows<F>(group, records, a, row0 + 4, rows - 4, sums + 4 * kGroup, false, kept);
  }
  switch (rows) {
    case 1: return group_avx2<F, 1>(group, records, a, row0, sums, stream, kept);
    case 2: return group_avx2<F, 2>(group, records, a, row0, sums, stream, kept);
    case 3: return group_avx2<F, 3>(group, records, a, row0, sums, stream, kept);
    case 4: return group_avx2<F, 4>(group, records, a, row0, sums, stream, kept);
    case 5: return group_avx2<F, 5>(group, records, a, row0, sums, stream, kept);
    case 6: return group_avx2<F, 6>(group, records, a, row0, sums, stream, kept);
    case 7: return group_avx2<F, 7>(group, records, a, row0, sums, stream, kept);
    default: return group_avx2<F, 8>(group, records, a, row0, sums, stream, kept);
  }
#else
  group_portable<F>(group, records, a, row0, rows, sums, stream, kept);
#endif
}

GroupFn group_fn(int format, bool portable) {
  return by_format(format, [portable](auto f) -> GroupFn {
    return portable ? group_portable<decltype(f)::value> : group_rows<decltype(f)::value>;
  });
}

// Sums [rows][sums_stride] (+ bias) rounded once into the output's dtype.
template <typename T>
void store(T* out, int64_t stride, const float* sums, int64_t sums_stride, int rows, int64_t cols, const T* bias) {
  for (int r = 0; r < rows; ++r)
    for (int64_t j = 0; j < cols; ++j) {
      const float v = sums[r * sums_stride + j] + (bias != nullptr ? static_cast<float>(bias[j]) : 0.f);
      out[r * stride + j] = static_cast<T>(v);
    }
}

// A gated MLP's output from the sums of its gate and up rows (+ their biases): each rounded to the
// output's dtype, then silu(gate) * up as silu_and_mul computes it on such an output, bit for bit,
// without the [rows, 2n] product ever being written.
template <typename T>
void store_silu_mul(T* out, int64_t stride, float* gate, float* up, int64_t sums_stride, int rows, int64_t cols,
                    const T* gate_bias, const T* up_bias) {
  for (int r = 0; r < rows; ++r) {
    float* g = gate + r * sums_stride;
    float* u = up + r * sums_stride;
    for (int64_t j = 0; gate_bias != nullptr && j < cols; ++j) {
      g[j] += static_cast<float>(gate_bias[j]);
      u[j] += static_cast<float>(up_bias[j]);
    }
#if defined(__AVX512BF16__)
    if constexpr (std::is_same_v<T, at::BFloat16>) {
      silu_mul_sums_bf16(out + r * stride, g, u, cols);
      continue;
    }
#endif
    for (int64_t j = 0; j < cols; ++j) {
      const float gf = static_cast<float>(static_cast<T>(g[j]));
      const T act = static_cast<T>(gf / (1.f + std::exp(-gf)));
      out[r * stride + j] = static_cast<T>(static_cast<float>(act) * static_cast<float>(static_cast<T>(u[j])));
    }
  }
}

// Whether a format's passes of several rows take AMX tiles on this CPU (Traits::tiles).
bool takes_tiles(int format) {
#if defined(PAGEDLLM_QUANT_AMX)
  return by_format(format, [](auto f) { return Traits<decltype(f)::value>::tiles; }) && amx_allowed();
#else
  (void)format;
  return false;
#endif
}

// The rows of a call's next pass, of `rows` left (in a call of several passes where `passes`): 16
// where AMX tiles take them (`tiles`), else up to 8.
inline int pass_rows(int64_t rows, bool passes, bool tiles) {
  if (passes && tiles && rows >= kMaxPassRows) return kMaxPassRows;
  return static_cast<int>(std::min<int64_t>(kPassRows, rows));
}

// One packed matrix of n rows, whose results go to the output's columns col..col + n.
struct Job {
  const uint8_t* weights;
  int64_t records, record_bytes, groups, n, col;
  GroupFn fn;
  int64_t activation_block;  // 256 for the K types, else 32
  bool tiles;                // its passes of several rows on AMX tiles (takes_tiles)
};

// Where a flat index over every job's groups falls: (job, group in it).
std::pair<size_t, int64_t> locate(const std::vector<int64_t>& first_unit, int64_t unit) {
  const size_t job = std::upper_bound(first_unit.begin(), first_unit.end(), unit) - first_unit.begin() - 1;
  return {job, unit - first_unit[job]};
}


// out[:, job.col:job.col + job.n] = x W^T (+ bias) for every job, in one parallel region.
template <typename T>
void matmul(torch::Tensor& out, const Activations& a, const std::vector<Job>& jobs, const T* bias) {
  const int64_t rows = a.rows, stride = out.size(1);
  T* y = out.data_ptr<T>();
  int64_t groups = 0;
  std::vector<int64_t> first_group;  // of each job, counting all jobs' groups in order
  for (const Job& job : jobs) {
    first_group.push_back(groups);
    groups += job.groups;
  }
  const RowChunks chunks(rows, groups, kPassRows, omp_get_max_threads());
  WorkSplit split(groups * chunks.count, omp_get_max_threads());
#pragma omp parallel num_threads(split.threads())
  {
  TileState tiles;
  for (int64_t item = split.take(omp_get_thread_num()); item >= 0; item = split.take(omp_get_thread_num())) {
    alignas(64) float sums[kMaxPassRows * kGroup];
    const int64_t first = item % chunks.count * chunks.rows, last = std::min(rows, first + chunks.rows);
    const auto [j, g] = locate(first_group, item / chunks.count);
    const Job& job = jobs[j];
    const int64_t cols = std::min<int64_t>(kGroup, job.n - g * kGroup), col = job.col + g * kGroup;
    const bool passes = last - first > kPassRows;
    Kept kept{passes ? kept_scratch(a.k, 1) : nullptr, false, &tiles};
    for (int64_t r0 = first; r0 < last;) {
      const int count = pass_rows(last - r0, passes, job.tiles);
      job.fn(job.weights + g * job.records * job.record_bytes, job.records, a, r0, count, sums, !passes,
             passes ? &kept : nullptr);
      kept.filled = true;
      store(y + r0 * stride + col, stride, sums, kGroup, count, cols, bias == nullptr ? nullptr : bias + col);
      r0 += count;
    }
  }
  }
}

// out [rows, n] = silu(x Wg^T) * (x Wu^T) for a gate and an up job of n rows each: each item
// computes a group's gate and up sums and stores their product.
template <typename T>
void matmul_silu_mul(torch::Tensor& out, const Activations& a, const Job& gate, const Job& up, const T* bias) {
  const int64_t rows = a.rows, stride = out.size(1);
  T* y = out.data_ptr<T>();
  const RowChunks chunks(rows, gate.groups, kPassRows, omp_get_max_threads());
  WorkSplit split(gate.groups * chunks.count, omp_get_max_threads());
#pragma omp parallel num_threads(split.threads())
  {
  TileState tiles;
  for (int64_t item = split.take(omp_get_thread_num()); item >= 0; item = split.take(omp_get_thread_num())) {
    alignas(64) float sums[2][kMaxPassRows * kGroup];
    const int64_t first = item % chunks.count * chunks.rows, last = std::min(rows, first + chunks.rows);
    const int64_t g = item / chunks.count, col = g * kGroup, cols = std::min<int64_t>(kGroup, gate.n - col);
    const bool passes = last - first > kPassRows;
    uint8_t* scratch = passes ? kept_scratch(a.k, 2) : nullptr;
    Kept kept[2] = {{scratch, false, &tiles}, {scratch + (passes ? 16 * a.k : 0), false, &tiles}};
    for (int64_t r0 = first; r0 < last;) {
      const int count = pass_rows(last - r0, passes, gate.tiles && up.tiles);
      int h = 0;
      for (const Job* job : {&gate, &up}) {
        job->fn(job->weights + g * job->records * job->record_bytes, job->records, a, r0, count, sums[h],
                !passes, passes ? &kept[h] : nullptr);
        kept[h++].filled = true;
      }
      store_silu_mul(y + r0 * stride + col, stride, sums[0], sums[1], kGroup, count, cols,
                     bias == nullptr ? nullptr : bias + col, bias == nullptr ? nullptr : bias + gate.n + col);
      r0 += count;
    }
  }
  }
}


// A quantized linear layer: one or more packed matrices (a fused layer's shards of different
// types), side by side in the output's columns.
class QuantLinear : public LinearOp {
 public:
  using Segment = std::tuple<torch::Tensor, int64_t, int64_t>;  // packed records, format, rows (held)

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
      jobs_.push_back({packed.data_ptr<uint8_t>(), packed.size(1), packed.size(2), packed.size(0), n, out_features_,
                       group_fn(static_cast<int>(format), portable_), activation_block(static_cast<int>(format)),
                       !portable_ && takes_tiles(static_cast<int>(format))});
      out_features_ += n;
    }
    TORCH_CHECK(!silu_mul_ || out_features_ % 2 == 0, "silu_mul needs gate and up halves");
    const int64_t half = out_features_ / 2;
    if (silu_mul_ && jobs_.size() == 1 && half % kGroup == 0) {  // gate and up of one type: two jobs
      Job up = jobs_[0];
      up.weights += half / kGroup * up.records * up.record_bytes;
      up.groups = jobs_[0].groups = half / kGroup;
      up.n = jobs_[0].n = half;
      up.col = half;
      jobs_.push_back(up);
    }
    // SiLU-and-mul as the results are stored: a gate job and an up job of whole groups each.
    fused_silu_ = silu_mul_ && jobs_.size() == 2 && jobs_[0].n == half && half % kGroup == 0 &&
                  jobs_[0].activation_block == jobs_[1].activation_block;
  }

  int64_t out_features() const override { return silu_mul_ ? out_features_ / 2 : out_features_; }

  torch::Tensor forward(const torch::Tensor& x, const torch::Tensor& given) const override {
    TORCH_CHECK(x.dim() == 2 && x.size(1) == in_features_, "[rows, ", in_features_, "] activations expected");
    const torch::Tensor input = x.contiguous();
    const int64_t rows = x.size(0);
    if (fused_silu_) return silu_forward(input, output(input, given));
    // Unfused SiLU-and-mul: the [rows, 2n] product first, then the result.
    torch::Tensor out = silu_mul_ ? torch::empty({rows, out_features_}, x.options()) : output(input, given);
    std::vector<Job> by_block[2];  // by activation block, 32 then 256
    for (const Job& job : jobs_) by_block[job.activation_block == kBlock ? 0 : 1].push_back(job);
    for (const std::vector<Job>& jobs : by_block) {
      if (jobs.empty()) continue;
      const Activations a = quantize_activations(input, portable_, jobs[0].activation_block);
      if (x.scalar_type() == torch::kBFloat16)
        matmul<at::BFloat16>(out, a, jobs, bias_data<at::BFloat16>());
      else
        matmul<float>(out, a, jobs, bias_data<float>());
    }
    return finish(out, given);
  }

 private:
  torch::Tensor silu_forward(const torch::Tensor& x, torch::Tensor out) const {
    const Activations a = quantize_activations(x, portable_, jobs_[0].activation_block);
    if (x.scalar_type() == torch::kBFloat16)
      matmul_silu_mul<at::BFloat16>(out, a, jobs_[0], jobs_[1], bias_data<at::BFloat16>());
    else
      matmul_silu_mul<float>(out, a, jobs_[0], jobs_[1], bias_data<float>());
    return out;
  }

  torch::Tensor finish(const torch::Tensor& out, const torch::Tensor& given) const {
    if (!silu_mul_) return out;
    torch::Tensor result = output(out, given);
    silu_and_mul(result, out);
    return result;
  }

  template <typename T>
  const T* bias_data() const {
    if (!bias_.has_value()) return nullptr;
    TORCH_CHECK(bias_->scalar_type() == c10::CppTypeToScalarType<T>::value, "bias and activations differ in dtype");
    return bias_->data_ptr<T>();
  }

  std::vector<Segment> segments_;
  std::vector<Job> jobs_;
  int64_t in_features_, out_features_;
  c10::optional<torch::Tensor> bias_;
  bool silu_mul_, portable_, fused_silu_;
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
          const float d = scale_at<F>(p + Tr::scales_at, lane);
          y[v] = Tr::has_min ? d * u + scale_at<F>(p + Tr::scales_at + Tr::scale_bytes * kGroup, lane)
                             : d * (u - Tr::offset);
        } else {
          const float scale = half_at(p + Tr::d_at, lane) * static_cast<float>(sub_at<F>(p, j, v / 16, lane));
          if constexpr (Tr::signed_subs) {
            y[v] = scale * (u - Tr::offset);
          } else {
            const float minimum = half_at(p + Tr::d_at + 2 * kGroup, lane) *
                                  static_cast<float>(sub_at<F, true>(p, j, v / 16, lane));
            y[v] = scale * u - minimum;
          }
        }
      }
    }
  }
}

using RowFn = void (*)(const uint8_t*, int64_t, int, float*);
RowFn row_fn(int format) {
  return by_format(format, [](auto f) -> RowFn { return dequantize_row<decltype(f)::value>; });
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
std::tuple<torch::Tensor, torch::Tensor, torch::Tensor> quantize_activations_for_test(torch::Tensor x, bool portable,
                                                                                      int64_t block) {
  const Activations a = quantize_activations(x.contiguous(), portable, block);
  auto copy = [](const auto* data, int64_t rows, int64_t cols, torch::ScalarType type) {
    return torch::from_blob(const_cast<void*>(static_cast<const void*>(data)), {rows, cols}, type).clone();
  };
  return {copy(a.codes, a.rows, a.k, torch::kInt8), copy(a.scales, a.rows, a.k / a.block, torch::kFloat),
          copy(a.sums, a.rows, a.k / 16, torch::kShort)};
}

// The vector path the kernels were built with: "avx512-vnni", "avx2", or "" (the portable one only).
std::string quant_linear_simd() {
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
  return "avx512-vnni";
#elif defined(PAGEDLLM_QUANT_AVX2)
  return "avx2";
#else
  return "";
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
        pybind11::arg("x"), pybind11::arg("portable"), pybind11::arg("block") = kBlock, release());
  m.def("quant_linear_simd", &quant_linear_simd, "the vector path of the quantized kernels, \"\" for none");
}
