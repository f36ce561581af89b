// LoRA adapters in a mixed batch: out[r] += (x[r] A_s^T) B_s^T for every row r whose adapter slot
// s = row_slot[r] is not -1, the other rows left alone (layers/lora.py holds the slots).
//
// A layer's slots: a [S, P * R, K], the A matrices of its P parts (q, k and v of a fused qkv layer;
// gate and up; one part otherwise), part p's rank-r rows at p * R; bt, B transposed and compacted:
// column n of the output takes its part's B, whose rows past the slot's rank are zeros and are
// skipped (ranks[s]). fp32: bt [S, R, N]. bf16: bt [S, R / 2, N, 2], rank rows 2i and 2i + 1 side by
// side for each column (R even), the pairs the bf16 dot-product instructions take. runs [Q, 3]: the
// output's columns as runs (first, end, part) in the order the layer's base method writes them (a
// packed gate/up layer interleaves its halves).
//
// Rows of one slot go through in tiles of up to kTileRows, which share each load of A and B. Each
// row's arithmetic is its own whatever its tile: its shrink t = x A^T (each sum in 16 fp32 lanes in
// k order, folded in a fixed tree), then its expansion (each output one chain of multiply-adds over
// the rank in order), added to the base's output in fp32 and rounded once. So a row's bits do not
// depend on which rows share the call or how many threads run it: outputs stay batch-invariant.
// bf16 rounds t to bf16 before the expansion, as PEFT and vLLM compute in the model's dtype; where
// the CPU has AVX512-BF16, both products run as bf16 pair dot products (dpbf16) summing in fp32.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <memory>
#include <type_traits>
#include <vector>

#include <torch/extension.h>
#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif
#include <omp.h>

#include "linear_op.h"
#include "lora.h"
#include "widen.h"
#include "work_split.h"

void silu_and_mul(torch::Tensor out, torch::Tensor gate_up);  // fused_ops.cpp

namespace {
constexpr int kLanes = 16;
constexpr int kTileRows = 4;
constexpr int64_t kColumns = 16;  // the expansion's columns a pass (kTileRows x 16 sums in registers)
// Below this many multiply-adds a call runs on one thread: a parallel region's start costs more.
constexpr int64_t kParallelWork = 1 << 16;

// t[r] = x_r . a over k, for the tile's Rows rows (x widened to fp32 already): lane l of 16 sums the
// k = l (mod 16) terms of the whole vectors, the tail's terms go to lanes 0.., then a fixed tree.
template <typename T, int Rows>
void shrink(const float* const* x, const T* a, int64_t k, float* t, int64_t t_stride) {
  alignas(32) float acc[Rows][kLanes] = {};
  int64_t p = 0;
#if defined(__AVX2__) && defined(__FMA__)
  __m256 lo[Rows], hi[Rows];
  for (int r = 0; r < Rows; ++r) lo[r] = hi[r] = _mm256_setzero_ps();
  for (; p + kLanes <= k; p += kLanes) {
    const __m256 a0 = load8(a + p), a1 = load8(a + p + 8);
    for (int r = 0; r < Rows; ++r) {
      lo[r] = _mm256_fmadd_ps(_mm256_loadu_ps(x[r] + p), a0, lo[r]);
      hi[r] = _mm256_fmadd_ps(_mm256_loadu_ps(x[r] + p + 8), a1, hi[r]);
    }
  }
  for (int r = 0; r < Rows; ++r) {
    _mm256_store_ps(acc[r], lo[r]);
    _mm256_store_ps(acc[r] + 8, hi[r]);
  }
#else
  for (; p + kLanes <= k; p += kLanes)
    for (int r = 0; r < Rows; ++r)
      for (int l = 0; l < kLanes; ++l) acc[r][l] = std::fma(x[r][p + l], widen(a[p + l]), acc[r][l]);
#endif
  for (int l = 0; p < k; ++p, ++l) {
    const float av = widen(a[p]);
    for (int r = 0; r < Rows; ++r) acc[r][l] = std::fma(x[r][p], av, acc[r][l]);
  }
  for (int r = 0; r < Rows; ++r) {
    for (int width = kLanes / 2; width > 0; width /= 2)
      for (int l = 0; l < width; ++l) acc[r][l] += acc[r][l + width];
    t[r * t_stride] = acc[r][0];
  }
}

// y_r[first, end) += t_r[part's] . bt over the rank, for the tile's Rows rows: each output one chain
// of fused multiply-adds over j in order (16 columns a pass in vectors, the last few one by one).
template <typename T, typename O, int Rows>
void expand(O* const* y, const float* t, int64_t t_stride, const T* bt, int64_t n, int64_t rank, int64_t first,
            int64_t end) {
  int64_t c0 = first;
#if defined(__AVX2__) && defined(__FMA__)
  for (; c0 + kColumns <= end; c0 += kColumns) {
    __m256 lo[Rows], hi[Rows];
    for (int r = 0; r < Rows; ++r) lo[r] = hi[r] = _mm256_setzero_ps();
    for (int64_t j = 0; j < rank; ++j) {
      const __m256 b0 = load8(bt + j * n + c0), b1 = load8(bt + j * n + c0 + 8);
      for (int r = 0; r < Rows; ++r) {
        const __m256 tj = _mm256_set1_ps(t[r * t_stride + j]);
        lo[r] = _mm256_fmadd_ps(tj, b0, lo[r]);
        hi[r] = _mm256_fmadd_ps(tj, b1, hi[r]);
      }
    }
    alignas(32) float sums[kColumns];
    for (int r = 0; r < Rows; ++r) {
      _mm256_store_ps(sums, lo[r]);
      _mm256_store_ps(sums + 8, hi[r]);
      for (int64_t l = 0; l < kColumns; ++l) y[r][c0 + l] = static_cast<O>(widen(y[r][c0 + l]) + sums[l]);
    }
  }
#endif
  for (; c0 < end; ++c0) {
    for (int r = 0; r < Rows; ++r) {
      float acc = 0.f;
      for (int64_t j = 0; j < rank; ++j) acc = std::fma(t[r * t_stride + j], widen(bt[j * n + c0]), acc);
      y[r][c0] = static_cast<O>(widen(y[r][c0]) + acc);
    }
  }
}

using bf16 = at::BFloat16;

// A bf16 pair (lo in the low half, as the dot-product instructions pair them), each rounded to
// nearest even; and its halves back in fp32 (exact).
inline uint32_t bf16_pair(float lo, float hi) {
  return static_cast<uint32_t>(bf16(lo).x) | static_cast<uint32_t>(bf16(hi).x) << 16;
}
inline float bits_to_float(uint32_t bits) {
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}
inline float pair_low(uint32_t pair) { return bits_to_float(pair << 16); }
inline float pair_high(uint32_t pair) { return bits_to_float(pair & 0xFFFF0000u); }

#if defined(__AVX512BF16__) && defined(__AVX512BW__) && defined(__AVX512VL__)
// y[0, 16) += sums where the mask is set, in fp32, rounded once to y's dtype.
inline void add_sums(float* y, __m512 sums, __mmask16 m) {
  _mm512_mask_storeu_ps(y, m, _mm512_add_ps(_mm512_maskz_loadu_ps(m, y), sums));
}
inline void add_sums(bf16* y, __m512 sums, __mmask16 m) {
  const __m512i wide = _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, y)), 16);
  _mm256_mask_storeu_epi16(y, m, (__m256i)_mm512_cvtneps_pbh(_mm512_add_ps(_mm512_castsi512_ps(wide), sums)));
}

// bf16's shrink, J rank rows of A at a time: t[r * stride + j] = x_r . a_j, lane l of 16 summing the
// k-pairs at l (mod 16) with dpbf16 (a tail's missing elements loaded as zeros), then a fixed tree.
template <int Rows, int J>
void shrink_dot_rows(const bf16* const* x, const bf16* a, int64_t k, float* t, int64_t stride) {
  __m512 acc[Rows][J];
  for (int r = 0; r < Rows; ++r)
    for (int j = 0; j < J; ++j) acc[r][j] = _mm512_setzero_ps();
  for (int64_t p = 0; p < k; p += 32) {
    const __mmask32 m = k - p >= 32 ? 0xFFFFFFFFu : (1u << (k - p)) - 1;
    __m512bh av[J];
    for (int j = 0; j < J; ++j) av[j] = (__m512bh)_mm512_maskz_loadu_epi16(m, a + j * k + p);
    for (int r = 0; r < Rows; ++r) {
      const __m512bh xv = (__m512bh)_mm512_maskz_loadu_epi16(m, x[r] + p);
      for (int j = 0; j < J; ++j) acc[r][j] = _mm512_dpbf16_ps(acc[r][j], xv, av[j]);
    }
  }
  for (int r = 0; r < Rows; ++r)
    for (int j = 0; j < J; ++j) t[r * stride + j] = _mm512_reduce_add_ps(acc[r][j]);
}

// A part's rank rows, four at a time (independent chains to hide dpbf16's latency), then one by one.
template <int Rows>
void shrink_dot(const bf16* const* x, const bf16* a, int64_t rank, int64_t k, float* t, int64_t stride) {
  int64_t j = 0;
  for (; j + 4 <= rank; j += 4) shrink_dot_rows<Rows, 4>(x, a + j * k, k, t + j, stride);
  for (; j < rank; ++j) shrink_dot_rows<Rows, 1>(x, a + j * k, k, t + j, stride);
}
#endif

// bf16's expansion from t rounded to bf16, two rank rows a step: tp[j] holds t's rows 2j (low half)
// and 2j + 1, bt_pairs[j * n + c] B^T's rows 2j and 2j + 1 of column c. Each output one chain over
// the pairs in order, the pair's two products added one after the other (as dpbf16 adds them).
template <typename O, int Rows>
void expand_pairs(O* const* y, const uint32_t* tp, int64_t tp_stride, const uint32_t* bt_pairs, int64_t n,
                  int64_t pairs, int64_t first, int64_t end) {
  int64_t c0 = first;
#if defined(__AVX512BF16__) && defined(__AVX512BW__) && defined(__AVX512VL__)
  constexpr int64_t kVectors = 4;  // 64 columns a pass: Rows x 4 sums in registers
  for (; c0 < end; c0 += kVectors * 16) {
    __mmask16 mask[kVectors];
    for (int64_t v = 0; v < kVectors; ++v) {
      const int64_t cols = std::max<int64_t>(0, std::min<int64_t>(16, end - c0 - 16 * v));
      mask[v] = cols == 16 ? 0xFFFF : static_cast<__mmask16>((1u << cols) - 1);
    }
    __m512 acc[Rows][kVectors];
    for (int r = 0; r < Rows; ++r)
      for (int64_t v = 0; v < kVectors; ++v) acc[r][v] = _mm512_setzero_ps();
    for (int64_t j = 0; j < pairs; ++j) {
      __m512bh w[kVectors];
      for (int64_t v = 0; v < kVectors; ++v)
        w[v] = (__m512bh)_mm512_maskz_loadu_epi32(mask[v], bt_pairs + j * n + c0 + 16 * v);
      for (int r = 0; r < Rows; ++r) {
        const __m512bh tj = (__m512bh)_mm512_set1_epi32(static_cast<int>(tp[r * tp_stride + j]));
        for (int64_t v = 0; v < kVectors; ++v) acc[r][v] = _mm512_dpbf16_ps(acc[r][v], tj, w[v]);
      }
    }
    for (int r = 0; r < Rows; ++r)
      for (int64_t v = 0; v < kVectors; ++v) add_sums(y[r] + c0 + 16 * v, acc[r][v], mask[v]);
  }
#else
#if defined(__AVX2__) && defined(__FMA__)
  const __m256i high_half = _mm256_set1_epi32(static_cast<int>(0xFFFF0000u));
  for (; c0 + 8 <= end; c0 += 8) {
    __m256 acc[Rows];
    for (int r = 0; r < Rows; ++r) acc[r] = _mm256_setzero_ps();
    for (int64_t j = 0; j < pairs; ++j) {
      const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(bt_pairs + j * n + c0));
      const __m256 low = _mm256_castsi256_ps(_mm256_slli_epi32(b, 16));
      const __m256 high = _mm256_castsi256_ps(_mm256_and_si256(b, high_half));
      for (int r = 0; r < Rows; ++r) {
        const uint32_t t = tp[r * tp_stride + j];
        acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(pair_high(t)), high, acc[r]);
        acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(pair_low(t)), low, acc[r]);
      }
    }
    alignas(32) float sums[8];
    for (int r = 0; r < Rows; ++r) {
      _mm256_store_ps(sums, acc[r]);
      for (int64_t l = 0; l < 8; ++l) y[r][c0 + l] = static_cast<O>(widen(y[r][c0 + l]) + sums[l]);
    }
  }
#endif
  for (; c0 < end; ++c0) {
    for (int r = 0; r < Rows; ++r) {
      float acc = 0.f;
      for (int64_t j = 0; j < pairs; ++j) {
        const uint32_t t = tp[r * tp_stride + j], b = bt_pairs[j * n + c0];
        acc = std::fma(pair_high(t), pair_high(b), acc);
        acc = std::fma(pair_low(t), pair_low(b), acc);
      }
      y[r][c0] = static_cast<O>(widen(y[r][c0]) + acc);
    }
  }
#endif
}

struct Shape {
  int64_t k, n, parts, max_rank, num_runs;
  const int64_t* runs;
};

#if defined(__AVX512BF16__) && defined(__AVX512BW__) && defined(__AVX512VL__)
constexpr bool kWidenBf16 = false;  // the shrink takes bf16 rows as they are
#else
constexpr bool kWidenBf16 = true;
#endif

// A thread's scratch: the tile's rows widened to fp32 (where they are widened), t, t in bf16 pairs.
// Sized once a call: at one row a layer, allocating them cost as much as the arithmetic.
struct Scratch {
  std::vector<float> xs, t;
  std::vector<uint32_t> tp;
  Scratch(const Shape& s, bool widened)
      : xs(widened ? kTileRows * s.k : 0), t(kTileRows * s.parts * s.max_rank), tp(t.size() / 2) {}
};

// The tile's rows' t = x A^T for every part, t[r * stride + part * R + j] (x widened to fp32).
template <typename T, int Rows>
void shrink_parts(const float* const* x_rows, const T* a_slot, int64_t rank, const Shape& s, float* t) {
  const int64_t stride = s.parts * s.max_rank;
  for (int64_t part = 0; part < s.parts; ++part)
    for (int64_t j = 0; j < rank; ++j)
      shrink<T, Rows>(x_rows, a_slot + (part * s.max_rank + j) * s.k, s.k, t + part * s.max_rank + j, stride);
}

template <typename T, int Rows>
void widen_rows(const T* x, int64_t first_row, const Shape& s, Scratch& w, const float** x_rows) {
  for (int r = 0; r < Rows; ++r) {
    float* row = w.xs.data() + r * s.k;
    for (int64_t p = 0; p < s.k; ++p) row[p] = widen(x[(first_row + r) * s.k + p]);
    x_rows[r] = row;
  }
}

template <typename O, int Rows>
void tile(O* out, const float* x, const float* a, const float* bt, int64_t first_row, int64_t slot, int64_t rank,
          const Shape& s, Scratch& w) {
  const float* x_rows[Rows];
  O* y_rows[Rows];
  widen_rows<float, Rows>(x, first_row, s, w, x_rows);
  for (int r = 0; r < Rows; ++r) y_rows[r] = out + (first_row + r) * s.n;
  const int64_t stride = s.parts * s.max_rank;  // t holds a row's shrink for every part
  shrink_parts<float, Rows>(x_rows, a + slot * stride * s.k, rank, s, w.t.data());
  const float* b_slot = bt + slot * s.max_rank * s.n;
  for (int64_t q = 0; q < s.num_runs; ++q) {
    const int64_t part = s.runs[3 * q + 2];
    expand<float, O, Rows>(y_rows, w.t.data() + part * s.max_rank, stride, b_slot, s.n, rank, s.runs[3 * q],
                           s.runs[3 * q + 1]);
  }
}

template <typename O, int Rows>
void tile(O* out, const bf16* x, const bf16* a, const bf16* bt, int64_t first_row, int64_t slot, int64_t rank,
          const Shape& s, Scratch& w) {
  O* y_rows[Rows];
  for (int r = 0; r < Rows; ++r) y_rows[r] = out + (first_row + r) * s.n;
  const int64_t stride = s.parts * s.max_rank, pairs = (rank + 1) / 2;
  const bf16* a_slot = a + slot * stride * s.k;
#if defined(__AVX512BF16__) && defined(__AVX512BW__) && defined(__AVX512VL__)
  const bf16* x_rows[Rows];
  for (int r = 0; r < Rows; ++r) x_rows[r] = x + (first_row + r) * s.k;
  for (int64_t part = 0; part < s.parts; ++part)
    shrink_dot<Rows>(x_rows, a_slot + part * s.max_rank * s.k, rank, s.k, w.t.data() + part * s.max_rank, stride);
#else
  const float* x_rows[Rows];
  widen_rows<bf16, Rows>(x, first_row, s, w, x_rows);
  shrink_parts<bf16, Rows>(x_rows, a_slot, rank, s, w.t.data());
#endif
  // t in bf16 pairs; a rank past the last even one pairs with zero.
  for (int r = 0; r < Rows; ++r)
    for (int64_t part = 0; part < s.parts; ++part) {
      const float* t = w.t.data() + r * stride + part * s.max_rank;
      uint32_t* tp = w.tp.data() + (r * stride + part * s.max_rank) / 2;
      for (int64_t j = 0; j < pairs; ++j) tp[j] = bf16_pair(t[2 * j], 2 * j + 1 < rank ? t[2 * j + 1] : 0.f);
    }
  const auto* b_slot = reinterpret_cast<const uint32_t*>(bt) + slot * (s.max_rank / 2) * s.n;
  for (int64_t q = 0; q < s.num_runs; ++q) {
    const int64_t part = s.runs[3 * q + 2];
    expand_pairs<O, Rows>(y_rows, w.tp.data() + part * s.max_rank / 2, stride / 2, b_slot, s.n, pairs, s.runs[3 * q],
                          s.runs[3 * q + 1]);
  }
}

struct Tile {
  int64_t first_row, rows, slot;
};

template <typename T, typename O>
void run_tile(O* out, const T* x, const T* a, const T* bt, const Tile& w, int64_t rank, const Shape& s,
              Scratch& scratch) {
  switch (w.rows) {
    case 1: tile<O, 1>(out, x, a, bt, w.first_row, w.slot, rank, s, scratch); break;
    case 2: tile<O, 2>(out, x, a, bt, w.first_row, w.slot, rank, s, scratch); break;
    case 3: tile<O, 3>(out, x, a, bt, w.first_row, w.slot, rank, s, scratch); break;
    default: tile<O, kTileRows>(out, x, a, bt, w.first_row, w.slot, rank, s, scratch); break;
  }
}

template <typename T, typename O>
void lora_tiles(O* out, const T* x, const T* a, const T* bt, const std::vector<Tile>& tiles, const int64_t* ranks,
                const Shape& s, int threads) {
  const bool widened = std::is_same_v<T, float> || kWidenBf16;
  if (threads == 1) {  // no parallel region to start
    Scratch scratch(s, widened);
    for (const Tile& w : tiles) run_tile(out, x, a, bt, w, ranks[w.slot], s, scratch);
    return;
  }
  WorkSplit split(static_cast<int64_t>(tiles.size()), threads);
#pragma omp parallel num_threads(split.threads())
  {
    Scratch scratch(s, widened);
    for (int64_t item = split.take(omp_get_thread_num()); item >= 0; item = split.take(omp_get_thread_num()))
      run_tile(out, x, a, bt, tiles[item], ranks[tiles[item].slot], s, scratch);
  }
}
}  // namespace

// out: [M, N] of x's dtype, or fp32 (a tensor-parallel share), added to in place; x: [M, K] fp32 or
// bf16; a: [S, P * R, K] and bt (fp32 [S, R, N], bf16 [S, R / 2, N, 2]) of x's dtype; row_slot:
// int32 [M]; ranks: int64 [S]; runs: int64 [Q, 3] covering the N columns.
void lora_add(torch::Tensor out, torch::Tensor x, torch::Tensor a, torch::Tensor bt, torch::Tensor row_slot,
              torch::Tensor ranks, torch::Tensor runs) {
  const auto dtype = x.scalar_type();
  TORCH_CHECK((dtype == torch::kFloat || dtype == torch::kBFloat16) && a.scalar_type() == dtype &&
                  bt.scalar_type() == dtype && (out.scalar_type() == dtype || out.scalar_type() == torch::kFloat),
              "fp32 or bf16 activations and adapters of one dtype, output of theirs or fp32 expected");
  const bool paired = dtype == torch::kBFloat16;
  TORCH_CHECK(x.dim() == 2 && out.dim() == 2 && a.dim() == 3 && x.is_contiguous() && out.is_contiguous() &&
                  a.is_contiguous() && bt.is_contiguous() && (paired ? bt.dim() == 4 && bt.size(3) == 2 : bt.dim() == 3),
              "contiguous x [M, K], out [M, N], a [S, P * R, K], bt [S, R, N] (bf16: [S, R / 2, N, 2]) expected");
  const int64_t m = x.size(0), k = x.size(1), n = out.size(1), slots = a.size(0);
  const int64_t max_rank = bt.size(1) * (paired ? 2 : 1);
  TORCH_CHECK(out.size(0) == m && a.size(2) == k && bt.size(0) == slots && bt.size(2) == n && max_rank > 0 &&
                  a.size(1) % max_rank == 0,
              "shapes of out, x, a and bt disagree");
  TORCH_CHECK(row_slot.scalar_type() == torch::kInt && row_slot.numel() == m && row_slot.is_contiguous() &&
                  ranks.scalar_type() == torch::kLong && ranks.numel() == slots &&
                  runs.scalar_type() == torch::kLong && runs.dim() == 2 && runs.size(1) == 3 && runs.is_contiguous(),
              "int32 row_slot [M], int64 ranks [S] and runs [Q, 3] expected");
  const Shape shape{k, n, a.size(1) / max_rank, max_rank, runs.size(0), runs.data_ptr<int64_t>()};
  const int64_t* rank_of = ranks.data_ptr<int64_t>();
  for (int64_t s = 0; s < slots; ++s) TORCH_CHECK(rank_of[s] >= 0 && rank_of[s] <= max_rank, "rank out of range");
  for (int64_t q = 0; q < shape.num_runs; ++q)
    TORCH_CHECK(shape.runs[3 * q] >= 0 && shape.runs[3 * q] <= shape.runs[3 * q + 1] && shape.runs[3 * q + 1] <= n &&
                    shape.runs[3 * q + 2] >= 0 && shape.runs[3 * q + 2] < shape.parts,
                "a run out of range");
  // Consecutive rows of one slot, in tiles of up to kTileRows.
  std::vector<Tile> tiles;
  const int32_t* slot_of = row_slot.data_ptr<int32_t>();
  int64_t work = 0;
  for (int64_t r = 0; r < m; ++r) {
    const int32_t slot = slot_of[r];
    if (slot < 0) continue;
    TORCH_CHECK(slot < slots, "row ", r, "'s slot ", slot, " is not one of the ", slots);
    if (rank_of[slot] == 0) continue;  // adds nothing: the row is left as it is, bit for bit
    Tile* last = tiles.empty() ? nullptr : &tiles.back();
    if (last != nullptr && last->slot == slot && last->first_row + last->rows == r && last->rows < kTileRows)
      ++last->rows;
    else
      tiles.push_back({r, 1, slot});
    work += rank_of[slot] * (shape.parts * k + n);
  }
  if (tiles.empty()) return;
  const int threads = tiles.size() > 1 && work >= kParallelWork ? omp_get_max_threads() : 1;
  if (dtype == torch::kFloat) {
    lora_tiles(out.data_ptr<float>(), x.data_ptr<float>(), a.data_ptr<float>(), bt.data_ptr<float>(), tiles, rank_of,
               shape, threads);
    return;
  }
  const bf16 *xs = x.data_ptr<bf16>(), *as = a.data_ptr<bf16>(), *bs = bt.data_ptr<bf16>();
  if (out.scalar_type() == torch::kFloat)
    lora_tiles(out.data_ptr<float>(), xs, as, bs, tiles, rank_of, shape, threads);
  else
    lora_tiles(out.data_ptr<bf16>(), xs, as, bs, tiles, rank_of, shape, threads);
}

namespace {
// A linear layer with adapter slots as the C++ decoder stack runs it: the base op, then each row's
// update by its slot (layers/lora.py's LoRASlots, the same kernels in the same order, so the same
// bits). A gated MLP's gate/up: rows with an adapter take the base's unfused product (`product`,
// its columns interleaved 64 at a time where `interleaved`), the update, then SiLU-and-mul; the
// others the base op's own path.
class LoRALinear : public LinearOp {
 public:
  LoRALinear(std::shared_ptr<LinearOp> base, std::shared_ptr<LinearOp> product, bool interleaved, torch::Tensor a,
             torch::Tensor bt, torch::Tensor ranks, torch::Tensor runs, std::shared_ptr<LoRARows> rows)
      : base_(std::move(base)), product_(std::move(product)), interleaved_(interleaved), a_(std::move(a)),
        bt_(std::move(bt)), ranks_(std::move(ranks)), runs_(std::move(runs)), rows_(std::move(rows)) {}

  int64_t out_features() const override { return base_->out_features(); }

  torch::Tensor forward(const torch::Tensor& x, const torch::Tensor& given) const override {
    if (!rows_->active()) return base_->forward(x, given);
    if (!product_) {
      torch::Tensor out = base_->forward(x, given);
      lora_add(out, x, a_, bt_, rows_->row_slot(), ranks_, runs_);
      return out;
    }
    if (!rows_->lora_rows().defined()) {  // every row has an adapter
      torch::Tensor out = output(x, given);
      silu_of_product(out, adapted_product(x, rows_->row_slot()));
      return out;
    }
    torch::Tensor out = base_->forward(x, given);
    const torch::Tensor picked = x.index_select(0, rows_->lora_rows());
    torch::Tensor adapted = torch::empty({picked.size(0), out.size(1)}, out.options());
    silu_of_product(adapted, adapted_product(picked, rows_->lora_row_slot()));
    out.index_copy_(0, rows_->lora_rows(), adapted);
    return out;
  }

 private:
  torch::Tensor adapted_product(const torch::Tensor& x, const torch::Tensor& row_slot) const {
    torch::Tensor product = product_->forward(x, torch::Tensor());
    lora_add(product, x, a_, bt_, row_slot, ranks_, runs_);
    return product;
  }

  // As layers/linear.py's silu_of_product: halves interleaved 64 columns at a time put back in order.
  void silu_of_product(torch::Tensor& out, const torch::Tensor& product) const {
    if (!interleaved_) {
      silu_and_mul(out, product);
      return;
    }
    const int64_t rows = product.size(0), n = product.size(1);
    silu_and_mul(out, product.view({rows, n / 128, 2, 64}).transpose(1, 2).reshape({rows, n}));
  }

  std::shared_ptr<LinearOp> base_, product_;
  bool interleaved_;
  torch::Tensor a_, bt_, ranks_, runs_;
  std::shared_ptr<LoRARows> rows_;
};
}  // namespace

void bind_lora(pybind11::module& m) {
  pybind11::class_<LoRARows, std::shared_ptr<LoRARows>>(m, "LoRARows")
      .def(pybind11::init<>())
      .def("set", &LoRARows::set);
  pybind11::class_<LoRALinear, LinearOp, std::shared_ptr<LoRALinear>>(m, "LoRALinear")
      .def(pybind11::init<std::shared_ptr<LinearOp>, std::shared_ptr<LinearOp>, bool, torch::Tensor, torch::Tensor,
                          torch::Tensor, torch::Tensor, std::shared_ptr<LoRARows>>());
}
