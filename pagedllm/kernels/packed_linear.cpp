// y = x W^T (+ bias), reading the bf16 weights where oneDNN packed them.
//
// At a handful of rows a linear layer is a pass over its weights, bound by memory bandwidth;
// oneDNN's GEMM streams them at 34-43 GB/s here where the machine reads 45-50. At more rows
// this plain kernel still kept ahead of oneDNN's GEMM on this CPU (Zen 4, AVX512-BF16, no
// AMX) up to 1024 rows (benchmarks/kernels.py). It reads oneDNN's own packed copy (format
// AB16b64a2b: [N/64][K/32][16 k-pairs][64 n][2 k], zero-padded to whole blocks;
// layers/linear.py checks that layout before it calls in), so the model keeps one copy of
// its weights. Threads take whole 64-column blocks, one contiguous stream of weights each;
// every k-pair of x is broadcast against 64 columns with dpbf16, and the sums run in fp32 in
// k order. For a gated MLP's gate_up layer, packed with gate and up interleaved 64 columns at a
// time, it can also apply SiLU-and-mul as it stores (silu_mul): the [M, 2n] product is never
// written.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <thread>
#include <vector>

#include <torch/extension.h>

#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif
#include <omp.h>

#include "linear_op.h"
#include "stream_hint.h"
#include "widen.h"
#include "work_split.h"

namespace {

#if defined(__AVX512BF16__)
constexpr int64_t kBlockN = 64;   // output columns per packed block: 4 vectors of 16 fp32 sums
constexpr int64_t kBlockK = 32;   // input features per packed block
constexpr int64_t kMaxRows = 4;   // rows of x served per pass over a block (accumulators in registers)

// How a pass prefetches: not at all; the next block, spread over the passes of a block (rows in
// several passes); or, for a lone pass, a fixed distance ahead in the thread's stream of blocks.
enum Prefetch { kNone, kNextBlock, kStream };
// The hardware prefetchers stop at each 4 KiB page; 8 KiB ahead carries the stream across.
// Batch 1 on the 250M model's layers in sequence, alternating with no prefetch: 1.056x (mean of
// eight rounds; 4 KiB 1.044x, 16 KiB 1.045x); decode steps 1.026-1.039x.
constexpr int64_t kStreamAhead = 8192;

// One 64-column block for R rows: acc[r][j] += x[r] pair . w pair, over every k-pair. With
// kNextBlock it also prefetches `lines` cache lines from `ahead` along the way: one every
// k_pairs / lines k-pairs, or two a k-pair where there are more lines than k-pairs. Evenly
// spread, because a burst holds the core's miss buffers that this pass's own reads from L2 need
// (bursts at the start of each pass measured 4-9% slower than none from 64 rows up). A template
// parameter, as even an empty prefetch loop cost the plain passes 8-10%.
template <int R, int Ahead>
void block_rows(const uint32_t* const* x_pairs, const at::BFloat16* block, int64_t k_pairs, float* sums,
                const char* ahead, int64_t lines) {
  __m512 acc[R][4];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < 4; ++j) acc[r][j] = _mm512_setzero_ps();
  const int64_t every = lines <= k_pairs ? k_pairs / std::max<int64_t>(lines, 1) : 0;
  int64_t tick = 0, sent = 0;
  for (int64_t p = 0; p < k_pairs; ++p) {
    const at::BFloat16* w = block + p * kBlockN * 2;
    if constexpr (Ahead == kStream) {
      // This k-pair's 4 lines, further on; non-temporal, as a lone pass reads each weight once a
      // step (the point: that the stream displace less of what the ops between the linear layers
      // read, the activations and K/V). Decode steps alternating with T0 in one process: batch 1
      // 0.977 and 0.972 of the time (medians of 12 and 24 rounds; two identical builds the same
      // way 0.997), batch 4 0.962. Several passes over a block keep T0: their later passes need it.
      const char* a = reinterpret_cast<const char*>(w) + kStreamAhead;
      for (int line = 0; line < 4; ++line) _mm_prefetch(a + line * 64, _MM_HINT_NTA);
    }
    if constexpr (Ahead == kNextBlock) {
      if (every == 0) {
        if (2 * p < lines) _mm_prefetch(ahead + 2 * p * 64, _MM_HINT_T0);
        if (2 * p + 1 < lines) _mm_prefetch(ahead + (2 * p + 1) * 64, _MM_HINT_T0);
      } else if (++tick == every) {
        tick = 0;
        if (sent < lines) _mm_prefetch(ahead + sent++ * 64, _MM_HINT_T0);
      }
    }
    const __m512bh w0 = (__m512bh)_mm512_loadu_si512(w), w1 = (__m512bh)_mm512_loadu_si512(w + 32);
    const __m512bh w2 = (__m512bh)_mm512_loadu_si512(w + 64), w3 = (__m512bh)_mm512_loadu_si512(w + 96);
    for (int r = 0; r < R; ++r) {
      const __m512bh xb = (__m512bh)_mm512_set1_epi32(static_cast<int>(x_pairs[r][p]));
      acc[r][0] = _mm512_dpbf16_ps(acc[r][0], xb, w0);
      acc[r][1] = _mm512_dpbf16_ps(acc[r][1], xb, w1);
      acc[r][2] = _mm512_dpbf16_ps(acc[r][2], xb, w2);
      acc[r][3] = _mm512_dpbf16_ps(acc[r][3], xb, w3);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < 4; ++j) _mm512_storeu_ps(sums + r * kBlockN + j * 16, acc[r][j]);
}

using BlockFn = void (*)(const uint32_t* const*, const at::BFloat16*, int64_t, float*, const char*, int64_t);
template <int P>
constexpr BlockFn kRowsFns[kMaxRows + 1] = {nullptr, block_rows<1, P>, block_rows<2, P>, block_rows<3, P>,
                                            block_rows<4, P>};
constexpr const BlockFn* kBlockFns[3] = {kRowsFns<kNone>, kRowsFns<kNextBlock>, kRowsFns<kStream>};

// Adds the bias in fp32 and rounds each sum to bf16 once, as oneDNN does.
void store_rows(at::BFloat16* out, int64_t out_stride, const float* sums, int64_t rows, int64_t n0, int64_t cols,
                const at::BFloat16* bias) {
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t j = 0; j < kBlockN; j += 16) {
      if (j >= cols) break;
      const __mmask16 m = cols - j >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << (cols - j)) - 1);
      __m512 v = _mm512_loadu_ps(sums + r * kBlockN + j);
      if (bias != nullptr) {
        const __m256i b = _mm256_maskz_loadu_epi16(m, bias + n0 + j);
        v = _mm512_add_ps(v, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(b), 16)));
      }
      _mm256_mask_storeu_epi16(out + r * out_stride + n0 + j, m, (__m256i)_mm512_cvtneps_pbh(v));
    }
  }
}

// The same sums (+ bias) kept in fp32: a tensor-parallel rank's share of a row-parallel layer,
// rounded once after the ranks' shares are added, as one rank's sum would be.
void store_rows(float* out, int64_t out_stride, const float* sums, int64_t rows, int64_t n0, int64_t cols,
                const at::BFloat16* bias) {
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t j = 0; j < cols; ++j)
      out[r * out_stride + n0 + j] = sums[r * kBlockN + j] + (bias != nullptr ? static_cast<float>(bias[n0 + j]) : 0.f);
}
#endif

}  // namespace

#if defined(__AVX512BF16__)
void silu_mul_sums_bf16(at::BFloat16* out, const float* g, const float* u, int64_t n);  // fused_ops.cpp

namespace {
void store_silu_mul_rows(at::BFloat16* out, int64_t out_stride, const float* gate_sums, const float* up_sums,
                         int64_t rows, int64_t n0, int64_t cols) {
  for (int64_t r = 0; r < rows; ++r)
    silu_mul_sums_bf16(out + r * out_stride + n0, gate_sums + r * kBlockN, up_sums + r * kBlockN, cols);
}
}  // namespace
#endif

// out: [M, N] bf16 (or fp32: sums not rounded); x: [M, K] bf16 rows with K padded to k_padded (zeros past K);
// weight_ptr: oneDNN's packed buffer of n_padded x k_padded. With silu_mul, the packed blocks
// alternate gate and up columns (block 2i: gate columns 64i.., block 2i + 1: the same up
// columns) and out is [M, N / 2] = silu(gate) * up.
void packed_linear_rows(torch::Tensor out, torch::Tensor x, int64_t weight_ptr, int64_t n_padded,
                        int64_t k_padded, c10::optional<torch::Tensor> bias, bool silu_mul) {
#if defined(__AVX512BF16__)
  const bool fp32_out = out.scalar_type() == torch::kFloat;
  TORCH_CHECK(x.scalar_type() == torch::kBFloat16 && (out.scalar_type() == torch::kBFloat16 || (fp32_out && !silu_mul)),
              "bf16 rows in, bf16 (or, without silu_mul, fp32) out expected");
  TORCH_CHECK(x.is_contiguous() && out.is_contiguous() && x.size(1) == k_padded, "contiguous padded rows expected");
  TORCH_CHECK(n_padded % kBlockN == 0 && k_padded % kBlockK == 0, "whole packed blocks expected");
  const int64_t rows = x.size(0), n = out.size(1), k_pairs = k_padded / 2;
  const int64_t width = silu_mul ? 2 : 1;  // packed blocks a unit of work reads: 64 output columns' worth
  TORCH_CHECK(!silu_mul || (!bias.has_value() && n_padded == 2 * n && n % kBlockN == 0),
              "silu_mul: interleaved gate and up blocks of whole columns, no bias expected");
  const int64_t units = n_padded / kBlockN / width;
  const auto* weight = reinterpret_cast<const at::BFloat16*>(weight_ptr);
  const auto* xs = reinterpret_cast<const uint32_t*>(x.data_ptr<at::BFloat16>());
  const at::BFloat16* b = bias.has_value() ? bias->data_ptr<at::BFloat16>() : nullptr;
  at::BFloat16* y = fp32_out ? nullptr : out.data_ptr<at::BFloat16>();
  float* y32 = fp32_out ? out.data_ptr<float>() : nullptr;
  const RowChunks row_chunks(rows, units, kMaxRows, omp_get_max_threads());
  const int64_t chunks = row_chunks.count, chunk_rows = row_chunks.rows;
  // Items in address order, each thread a contiguous share, so that each block's passes can
  // prefetch the next; a thread that is done takes items from the others' (work_split.h). In the
  // server, steps alternating the two splits: decode steps 1.7-4% faster (mean of 61 steps, five
  // runs), prefill steps about 3%; offline, level.
  WorkSplit split(units * chunks, omp_get_max_threads());
#pragma omp parallel num_threads(split.threads())
  for (int64_t item = split.take(omp_get_thread_num()); item >= 0; item = split.take(omp_get_thread_num())) {
    alignas(64) float sums[2][kMaxRows * kBlockN];
    const uint32_t* x_pairs[kMaxRows];
    const int64_t nb = item / chunks, first = item % chunks * chunk_rows, block_size = kBlockN * k_padded;
    const at::BFloat16* block = weight + nb * width * block_size;
    const int64_t n0 = nb * kBlockN, cols = std::min<int64_t>(kBlockN, n - n0);
    // The first pass over a block waits on memory and the others find it in cache, so each pass
    // also fetches its share of the next block. Same-process runs on the model's layer shapes
    // (benchmarks/kernels.py's set), against prefetching only with 2-8 passes in bursts: 16 rows
    // 1.23x, 32 1.2-1.33x, 64 1.14-1.16x, 128 1.07x, 256 1.02-1.03x, 1024 level.
    const int64_t last = std::min(rows, first + chunk_rows), passes = (last - first + kMaxRows - 1) / kMaxRows;
    const int64_t block_lines = kBlockN * k_padded * 2 / 64;
    const int64_t pass_lines = passes > 1 ? (block_lines + passes - 1) / passes : 0;
    const char* next = reinterpret_cast<const char*>(block + width * block_size);
    for (int64_t r0 = first, pass = 0; r0 < last; r0 += kMaxRows, ++pass) {
      const int64_t count = std::min<int64_t>(kMaxRows, rows - r0);
      for (int64_t r = 0; r < count; ++r) x_pairs[r] = xs + (r0 + r) * k_pairs;
      const int64_t lines = std::clamp<int64_t>(block_lines - pass * pass_lines, 0, pass_lines);
      const Prefetch prefetch = lines > 0 ? kNextBlock : passes == 1 ? kStream : kNone;
      for (int64_t h = 0; h < width; ++h)
        kBlockFns[prefetch][count](x_pairs, block + h * block_size, k_pairs, sums[h],
                                   next + h * block_size * 2 + pass * pass_lines * 64, lines);
      if (silu_mul)
        store_silu_mul_rows(y + r0 * n, n, sums[0], sums[1], count, n0, cols);
      else if (fp32_out)
        store_rows(y32 + r0 * n, n, sums[0], count, n0, cols, b);
      else
        store_rows(y + r0 * n, n, sums[0], count, n0, cols, b);
    }
  }
#else
  TORCH_CHECK(false, "packed_linear_rows needs a build with AVX512-BF16");
#endif
}

// -- 16-column blocks: fp32, and bf16 without AVX512-BF16 -----------------------------------------
// y = x W^T (+ bias) for fp32 or bf16 rows over weights of the same dtype packed [N/16][K][16]
// (layers/linear.py's BlockedLinearMethod): threads take 16-column blocks, rows go in passes of up
// to 6, and each output is one chain of fused multiply-adds in fp32 over k in order (bf16 inputs
// widened exactly), then + bias, rounded once to the output's dtype: the same operations for a row
// whatever rows share its call or how the threads split them, so outputs are batch-invariant
// (MKL's GEMM orders its sums by the call's rows: 1, 2, 3 and 7 rows give other bits). AVX2 and
// AVX-512 machines run the same 256-bit code (the same bits everywhere, std::fma's too). bf16
// comes here only where the AVX512-BF16 kernel above is not built, in place of F.linear's GEMM.
namespace {
constexpr int64_t kColBlock = 16;
constexpr int kPassRows = 6;  // 12 accumulators of AVX2's 16 registers (block_fma_rows' names)

// A lone pass (Stream) prefetches its block's stream 4 KiB ahead (stream_hint.h's level): the
// blocks lie one after another in a thread's range, so that runs on into its next block.
constexpr int64_t kFmaStreamAhead = 4096;

template <typename T, int R, bool Stream>
void block_fma_rows(const T* const* xr, const T* block, int64_t k, float* sums) {
#if defined(__AVX2__) && defined(__FMA__)
  constexpr int64_t k_per_line = 64 / (kColBlock * sizeof(T));  // 1 (fp32) or 2 (bf16)
  // Named accumulators: GCC kept an array of them on the stack, storing all 12 every k.
  const __m256 zero = _mm256_setzero_ps();
  __m256 a0 = zero, b0 = zero, a1 = zero, b1 = zero, a2 = zero, b2 = zero;
  __m256 a3 = zero, b3 = zero, a4 = zero, b4 = zero, a5 = zero, b5 = zero;
#define PAGEDLLM_FMA_ROW(r, a, b)                               \
  if constexpr (R > r) {                                        \
    const __m256 xv = _mm256_set1_ps(widen(xr[r][p]));          \
    a = _mm256_fmadd_ps(xv, w0, a);                             \
    b = _mm256_fmadd_ps(xv, w1, b);                             \
  }
  for (int64_t p = 0; p < k; ++p) {
    if constexpr (Stream)
      if (p % k_per_line == 0)
        _mm_prefetch(reinterpret_cast<const char*>(block + p * kColBlock) + kFmaStreamAhead, kStreamHint);
    const __m256 w0 = load8(block + p * kColBlock), w1 = load8(block + p * kColBlock + 8);
    PAGEDLLM_FMA_ROW(0, a0, b0)
    PAGEDLLM_FMA_ROW(1, a1, b1)
    PAGEDLLM_FMA_ROW(2, a2, b2)
    PAGEDLLM_FMA_ROW(3, a3, b3)
    PAGEDLLM_FMA_ROW(4, a4, b4)
    PAGEDLLM_FMA_ROW(5, a5, b5)
  }
#undef PAGEDLLM_FMA_ROW
  const __m256 out[6][2] = {{a0, b0}, {a1, b1}, {a2, b2}, {a3, b3}, {a4, b4}, {a5, b5}};
  for (int r = 0; r < R; ++r) {
    _mm256_storeu_ps(sums + r * kColBlock, out[r][0]);
    _mm256_storeu_ps(sums + r * kColBlock + 8, out[r][1]);
  }
#else
  for (int r = 0; r < R; ++r)
    for (int64_t c = 0; c < kColBlock; ++c) {
      float acc = 0.f;
      for (int64_t p = 0; p < k; ++p) acc = std::fma(widen(xr[r][p]), widen(block[p * kColBlock + c]), acc);
      sums[r * kColBlock + c] = acc;
    }
#endif
}

template <typename T>
using FmaBlockFn = void (*)(const T* const*, const T*, int64_t, float*);
template <typename T, bool Stream>
constexpr FmaBlockFn<T> kFmaFns[kPassRows + 1] = {nullptr,
                                                  block_fma_rows<T, 1, Stream>,
                                                  block_fma_rows<T, 2, Stream>,
                                                  block_fma_rows<T, 3, Stream>,
                                                  block_fma_rows<T, 4, Stream>,
                                                  block_fma_rows<T, 5, Stream>,
                                                  block_fma_rows<T, 6, Stream>};

// T: the rows' and weights' dtype; O: the output's (T, or fp32 for a tensor-parallel share).
template <typename T, typename O>
void blocked_rows(O* y, const T* xs, const T* weight, const T* b, int64_t rows, int64_t k, int64_t n, int64_t units) {
  const RowChunks chunks(rows, units, kPassRows, omp_get_max_threads());
  WorkSplit split(units * chunks.count, omp_get_max_threads());
#pragma omp parallel num_threads(split.threads())
  for (int64_t item = split.take(omp_get_thread_num()); item >= 0; item = split.take(omp_get_thread_num())) {
    alignas(64) float sums[kPassRows * kColBlock];
    const T* xr[kPassRows];
    const int64_t nb = item / chunks.count, first = item % chunks.count * chunks.rows;
    const int64_t n0 = nb * kColBlock, cols = std::min<int64_t>(kColBlock, n - n0);
    const int64_t last = std::min(rows, first + chunks.rows);
    for (int64_t r0 = first; r0 < last; r0 += kPassRows) {
      const int count = static_cast<int>(std::min<int64_t>(kPassRows, last - r0));
      for (int r = 0; r < count; ++r) xr[r] = xs + (r0 + r) * k;
      const FmaBlockFn<T> fn = last - first <= kPassRows ? kFmaFns<T, true>[count] : kFmaFns<T, false>[count];
      fn(xr, weight + nb * k * kColBlock, k, sums);
      for (int r = 0; r < count; ++r)
        for (int64_t j = 0; j < cols; ++j)
          y[(r0 + r) * n + n0 + j] = static_cast<O>(sums[r * kColBlock + j] + (b != nullptr ? widen(b[n0 + j]) : 0.f));
    }
  }
}
}  // namespace

// out: [M, N] of x's dtype, or fp32; x: [M, K] fp32 or bf16; packed: [ceil(N / 16), K, 16] of x's
// dtype (zeros past N); bias: N of x's dtype.
void blocked_linear_rows(torch::Tensor out, torch::Tensor x, torch::Tensor packed, c10::optional<torch::Tensor> bias) {
  const auto dtype = x.scalar_type();
  TORCH_CHECK((dtype == torch::kFloat || dtype == torch::kBFloat16) && packed.scalar_type() == dtype &&
                  (out.scalar_type() == dtype || out.scalar_type() == torch::kFloat) &&
                  (!bias.has_value() || bias->scalar_type() == dtype),
              "fp32 or bf16 rows and weights of one dtype, output of theirs or fp32 expected");
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && out.is_contiguous() && packed.is_contiguous(),
              "contiguous [rows, k] activations expected");
  const int64_t rows = x.size(0), k = x.size(1), n = out.size(1), units = packed.size(0);
  TORCH_CHECK(packed.dim() == 3 && packed.size(1) == k && packed.size(2) == kColBlock && units * kColBlock >= n &&
                  out.size(0) == rows && (!bias.has_value() || bias->numel() == n),
              "weights packed [N / 16, K, 16] for these shapes expected");
  if (dtype == torch::kFloat) {
    const float* b = bias.has_value() ? bias->data_ptr<float>() : nullptr;
    blocked_rows(out.data_ptr<float>(), x.data_ptr<float>(), packed.data_ptr<float>(), b, rows, k, n, units);
    return;
  }
  using bf16 = at::BFloat16;
  const bf16* b = bias.has_value() ? bias->data_ptr<bf16>() : nullptr;
  if (out.scalar_type() == torch::kFloat)
    blocked_rows(out.data_ptr<float>(), x.data_ptr<bf16>(), packed.data_ptr<bf16>(), b, rows, k, n, units);
  else
    blocked_rows(out.data_ptr<bf16>(), x.data_ptr<bf16>(), packed.data_ptr<bf16>(), b, rows, k, n, units);
}

void silu_and_mul(torch::Tensor out, torch::Tensor gate_up);  // fused_ops.cpp

namespace {
// A linear layer of 16-column blocks as the decoder stack runs it (layers/linear.py's
// BlockedLinearMethod's kernel_spec): blocked_linear_rows, and for a gated MLP's gate_up,
// silu_and_mul on the product, the op-by-op path's two kernels, so the same bits.
class BlockedLinear : public LinearOp {
 public:
  BlockedLinear(torch::Tensor packed, int64_t out_features, c10::optional<torch::Tensor> bias, bool silu_mul)
      : packed_(std::move(packed)), n_(out_features), bias_(std::move(bias)), silu_mul_(silu_mul) {
    TORCH_CHECK(!silu_mul_ || n_ % 2 == 0, "silu_mul needs gate and up halves");
  }

  int64_t out_features() const override { return silu_mul_ ? n_ / 2 : n_; }

  torch::Tensor forward(const torch::Tensor& x, const torch::Tensor& given) const override {
    torch::Tensor out = output(x, given);
    if (!silu_mul_) {
      blocked_linear_rows(out, x, packed_, bias_);
      return out;
    }
    torch::Tensor product = torch::empty({x.size(0), n_}, x.options());
    blocked_linear_rows(product, x, packed_, bias_);
    silu_and_mul(out, product);
    return out;
  }

 private:
  torch::Tensor packed_;
  int64_t n_;
  c10::optional<torch::Tensor> bias_;
  bool silu_mul_;
};
}  // namespace

void bind_blocked_linear(pybind11::module& m) {
  pybind11::class_<BlockedLinear, LinearOp, std::shared_ptr<BlockedLinear>>(m, "BlockedLinear")
      .def(pybind11::init<torch::Tensor, int64_t, c10::optional<torch::Tensor>, bool>(), pybind11::arg("packed"),
           pybind11::arg("out_features"), pybind11::arg("bias"), pybind11::arg("silu_mul") = false);
}

// For the tests of work_split.h: the items in the order they were taken, each with the thread that
// took it, shared out by weight (or evenly where `weights` is empty) among `threads` threads of
// which the first starts `delay_us` late (so that the others take from its share).
std::vector<std::pair<int64_t, int64_t>> work_split_trace(int64_t items, int64_t threads, int64_t delay_us,
                                                          const std::vector<int64_t>& weights) {
  TORCH_CHECK(weights.empty() || static_cast<int64_t>(weights.size()) == items, "one weight an item expected");
  std::vector<std::pair<int64_t, int64_t>> trace(items, {-1, -1});
  std::atomic<int64_t> taken{0};
  WorkSplit split = weights.empty() ? WorkSplit(items, static_cast<int>(threads))
                                    : WorkSplit(weights, static_cast<int>(threads));
#pragma omp parallel num_threads(split.threads())
  {
    const int self = omp_get_thread_num();
    if (self == 0) std::this_thread::sleep_for(std::chrono::microseconds(delay_us));
    for (int64_t item = split.take(self); item >= 0; item = split.take(self)) trace[taken++] = {item, self};
  }
  return trace;
}

bool packed_linear_available() {
#if defined(__AVX512BF16__)
  return true;
#else
  return false;
#endif
}
