// LoRA adapters in a mixed batch: out[r] += (x[r] A_s^T) B_s^T for every row r whose adapter slot
// s = row_slot[r] is not -1, the other rows left alone (lora/layers.py holds the slots).
//
// A layer's slots: a [S, P * R, K], the A matrices of its P parts (q, k and v of a fused qkv layer;
// gate and up; one part otherwise), part p's rank-r rows at p * R; bt [S, R, N], B transposed and
// compacted: column n of the output takes its part's B, whose rows past the slot's rank are zeros
// and are skipped (ranks[s]). runs [Q, 3]: the output's columns as runs (first, end, part) in the
// order the layer's base method writes them (a packed gate/up layer interleaves its halves).
//
// Each row is one thread's: its shrink t = x A^T (each sum in 16 fp32 lanes in k order, folded in
// a fixed tree), then its expansion (each output one chain of fused multiply-adds over the rank in
// order), added to the base's output in fp32 and rounded once. A row's bits therefore do not depend
// on which rows share the call or how many threads run it: outputs stay batch-invariant.
#include <cmath>
#include <vector>

#include <torch/extension.h>
#include <omp.h>

#include "work_split.h"

namespace {
constexpr int kLanes = 16;
// Below this many multiply-adds a call runs on one thread: a parallel region's start costs more.
constexpr int64_t kParallelWork = 1 << 16;

inline float widen(float v) { return v; }
inline float widen(at::BFloat16 v) { return static_cast<float>(v); }

template <typename T>
float dot(const float* x, const T* a, int64_t k) {
  float acc[kLanes] = {};
  int64_t p = 0;
  for (; p + kLanes <= k; p += kLanes)
    for (int l = 0; l < kLanes; ++l) acc[l] = std::fma(x[p + l], widen(a[p + l]), acc[l]);
  for (int l = 0; p < k; ++p, ++l) acc[l] = std::fma(x[p], widen(a[p]), acc[l]);
  for (int width = kLanes / 2; width > 0; width /= 2)
    for (int l = 0; l < width; ++l) acc[l] += acc[l + width];
  return acc[0];
}

template <typename T, typename O>
void lora_rows(O* out, const T* x, const T* a, const T* bt, const std::vector<std::pair<int64_t, int64_t>>& rows,
               const int64_t* ranks, const int64_t* runs, int64_t num_runs, int64_t k, int64_t n, int64_t parts,
               int64_t max_rank, int threads) {
  WorkSplit split(static_cast<int64_t>(rows.size()), threads);
#pragma omp parallel num_threads(split.threads())
  {
    std::vector<float> xs(k), t(parts * max_rank), acc(n);
    for (int64_t item = split.take(omp_get_thread_num()); item >= 0; item = split.take(omp_get_thread_num())) {
      const int64_t row = rows[item].first, slot = rows[item].second, rank = ranks[slot];
      for (int64_t p = 0; p < k; ++p) xs[p] = widen(x[row * k + p]);
      const T* a_slot = a + slot * parts * max_rank * k;
      for (int64_t part = 0; part < parts; ++part)
        for (int64_t j = 0; j < rank; ++j)
          t[part * max_rank + j] = dot(xs.data(), a_slot + (part * max_rank + j) * k, k);
      const T* b_slot = bt + slot * max_rank * n;
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t q = 0; q < num_runs; ++q) {
        const int64_t first = runs[3 * q], end = runs[3 * q + 1], part = runs[3 * q + 2];
        for (int64_t j = 0; j < rank; ++j) {
          const float tj = t[part * max_rank + j];
          const T* b = b_slot + j * n;
          for (int64_t c = first; c < end; ++c) acc[c] = std::fma(tj, widen(b[c]), acc[c]);
        }
      }
      O* y = out + row * n;
      for (int64_t c = 0; c < n; ++c) y[c] = static_cast<O>(widen(y[c]) + acc[c]);
    }
  }
}
}  // namespace

// out: [M, N] of x's dtype, or fp32 (a tensor-parallel share), added to in place; x: [M, K] fp32 or
// bf16; a: [S, P * R, K] and bt: [S, R, N] of x's dtype; row_slot: int32 [M]; ranks: int64 [S];
// runs: int64 [Q, 3] covering the N columns.
void lora_add(torch::Tensor out, torch::Tensor x, torch::Tensor a, torch::Tensor bt, torch::Tensor row_slot,
              torch::Tensor ranks, torch::Tensor runs) {
  const auto dtype = x.scalar_type();
  TORCH_CHECK((dtype == torch::kFloat || dtype == torch::kBFloat16) && a.scalar_type() == dtype &&
                  bt.scalar_type() == dtype && (out.scalar_type() == dtype || out.scalar_type() == torch::kFloat),
              "fp32 or bf16 activations and adapters of one dtype, output of theirs or fp32 expected");
  TORCH_CHECK(x.dim() == 2 && out.dim() == 2 && a.dim() == 3 && bt.dim() == 3 && x.is_contiguous() &&
                  out.is_contiguous() && a.is_contiguous() && bt.is_contiguous(),
              "contiguous x [M, K], out [M, N], a [S, P * R, K], bt [S, R, N] expected");
  const int64_t m = x.size(0), k = x.size(1), n = out.size(1), slots = a.size(0), max_rank = bt.size(1);
  TORCH_CHECK(out.size(0) == m && a.size(2) == k && bt.size(0) == slots && bt.size(2) == n && max_rank > 0 &&
                  a.size(1) % max_rank == 0,
              "shapes of out, x, a and bt disagree");
  TORCH_CHECK(row_slot.scalar_type() == torch::kInt && row_slot.numel() == m && row_slot.is_contiguous() &&
                  ranks.scalar_type() == torch::kLong && ranks.numel() == slots &&
                  runs.scalar_type() == torch::kLong && runs.dim() == 2 && runs.size(1) == 3 && runs.is_contiguous(),
              "int32 row_slot [M], int64 ranks [S] and runs [Q, 3] expected");
  const int64_t parts = a.size(1) / max_rank, num_runs = runs.size(0);
  const int64_t* rank_of = ranks.data_ptr<int64_t>();
  const int64_t* run = runs.data_ptr<int64_t>();
  for (int64_t s = 0; s < slots; ++s) TORCH_CHECK(rank_of[s] >= 0 && rank_of[s] <= max_rank, "rank out of range");
  for (int64_t q = 0; q < num_runs; ++q)
    TORCH_CHECK(run[3 * q] >= 0 && run[3 * q] <= run[3 * q + 1] && run[3 * q + 1] <= n && run[3 * q + 2] >= 0 &&
                    run[3 * q + 2] < parts,
                "a run out of range");
  std::vector<std::pair<int64_t, int64_t>> rows;  // (row, slot) of the rows with an adapter
  const int32_t* slot_of = row_slot.data_ptr<int32_t>();
  int64_t work = 0;
  for (int64_t r = 0; r < m; ++r) {
    if (slot_of[r] < 0) continue;
    TORCH_CHECK(slot_of[r] < slots, "row ", r, "'s slot ", slot_of[r], " is not one of the ", slots);
    rows.emplace_back(r, slot_of[r]);
    work += rank_of[slot_of[r]] * (parts * k + n);
  }
  if (rows.empty()) return;
  const int threads = rows.size() > 1 && work >= kParallelWork ? omp_get_max_threads() : 1;
  if (dtype == torch::kFloat) {
    lora_rows(out.data_ptr<float>(), x.data_ptr<float>(), a.data_ptr<float>(), bt.data_ptr<float>(), rows, rank_of,
              run, num_runs, k, n, parts, max_rank, threads);
    return;
  }
  using bf16 = at::BFloat16;
  const bf16 *xs = x.data_ptr<bf16>(), *as = a.data_ptr<bf16>(), *bs = bt.data_ptr<bf16>();
  if (out.scalar_type() == torch::kFloat)
    lora_rows(out.data_ptr<float>(), xs, as, bs, rows, rank_of, run, num_runs, k, n, parts, max_rank, threads);
  else
    lora_rows(out.data_ptr<bf16>(), xs, as, bs, rows, rank_of, run, num_runs, k, n, parts, max_rank, threads);
}
