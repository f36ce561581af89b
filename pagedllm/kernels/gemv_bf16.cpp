// Skinny bf16 matrix products for decode: out[m, o] = sum_i x[m, i] * w[o, i], for up to a few
// dozen rows m. At such sizes oneDNN's GEMM is slow on this layout, and the work is mostly reading
// w once: this streams it with AVX512-BF16 dot products (fp32 accumulation) in 4x4 tiles of
// (weight rows x input rows), across threads.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <immintrin.h>

bool has_avx512_bf16() {
#if defined(__AVX512BF16__)
  return true;
#else
  return false;
#endif
}

#if defined(__AVX512BF16__)
namespace {

constexpr int64_t kRows = 4;  // weight rows in flight: four streams keep the prefetchers busy
constexpr int64_t kCols = 4;  // rows of x per pass: 16 accumulators, each load used 4 times

inline __m512bh load_bf16(const at::BFloat16* p) {
  return (__m512bh)_mm512_loadu_si512(reinterpret_cast<const void*>(p));
}

// out[b, r0 + j] for j < rows (<= kRows) and b in [b0, b0 + cols) (cols <= kCols).
template <int64_t R, int64_t C>
inline void tile(at::BFloat16* out, const at::BFloat16* x, const at::BFloat16* w, int64_t r0, int64_t b0,
                 int64_t in, int64_t out_stride) {
  __m512 acc[R][C];
  for (int64_t j = 0; j < R; ++j)
    for (int64_t b = 0; b < C; ++b) acc[j][b] = _mm512_setzero_ps();
  for (int64_t i = 0; i < in; i += 32) {
    __m512bh xv[C];
    for (int64_t b = 0; b < C; ++b) xv[b] = load_bf16(x + (b0 + b) * in + i);
    for (int64_t j = 0; j < R; ++j) {
      const __m512bh wv = load_bf16(w + (r0 + j) * in + i);
      for (int64_t b = 0; b < C; ++b) acc[j][b] = _mm512_dpbf16_ps(acc[j][b], wv, xv[b]);
    }
  }
  for (int64_t j = 0; j < R; ++j)
    for (int64_t b = 0; b < C; ++b)
      out[(b0 + b) * out_stride + r0 + j] = at::BFloat16(_mm512_reduce_add_ps(acc[j][b]));
}

template <int64_t R>
void rows_block(at::BFloat16* out, const at::BFloat16* x, const at::BFloat16* w, int64_t r0, int64_t m,
                int64_t in, int64_t out_stride) {
  int64_t b = 0;
  for (; b + kCols <= m; b += kCols) tile<R, kCols>(out, x, w, r0, b, in, out_stride);
  for (; b < m; ++b) tile<R, 1>(out, x, w, r0, b, in, out_stride);
}

void block(at::BFloat16* out, const at::BFloat16* x, const at::BFloat16* w, int64_t r0, int64_t rows,
           int64_t m, int64_t in, int64_t out_stride) {
  if (rows == kRows) {
    rows_block<kRows>(out, x, w, r0, m, in, out_stride);
  } else {
    for (int64_t j = 0; j < rows; ++j) rows_block<1>(out, x, w, r0 + j, m, in, out_stride);
  }
}

}  // namespace
#endif

void gemv_bf16(torch::Tensor out, torch::Tensor x, torch::Tensor w) {
  TORCH_CHECK(x.scalar_type() == torch::kBFloat16 && w.scalar_type() == torch::kBFloat16 &&
              out.scalar_type() == torch::kBFloat16, "bf16 tensors expected");
  TORCH_CHECK(x.is_contiguous() && w.is_contiguous() && out.is_contiguous(), "contiguous tensors expected");
  const int64_t m = x.size(0), in = x.size(1), rows = w.size(0);
  TORCH_CHECK(w.size(1) == in && in % 32 == 0, "in_features must match and divide by 32");
#if defined(__AVX512BF16__)
  const at::BFloat16* xp = x.data_ptr<at::BFloat16>();
  const at::BFloat16* wp = w.data_ptr<at::BFloat16>();
  at::BFloat16* op = out.data_ptr<at::BFloat16>();
  const int64_t blocks = (rows + kRows - 1) / kRows;
  at::parallel_for(0, blocks, 16, [&](int64_t begin, int64_t end) {
    for (int64_t blk = begin; blk < end; ++blk) {
      const int64_t r0 = blk * kRows;
      block(op, xp, wp, r0, std::min(kRows, rows - r0), m, in, rows);
    }
  });
#else
  TORCH_CHECK(false, "built without AVX512-BF16");
#endif
}
