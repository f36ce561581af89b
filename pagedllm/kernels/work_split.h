// Items 0..n-1 shared out among the threads of one parallel region, for loops whose items cost
// about the same. Each thread owns one contiguous range and works through it from the front,
// as a static split would: its reads stay in address order and each item can prefetch the
// next. A thread that has finished its own takes items one at a time from the back of the
// others' ranges. With a static split, a thread the OS preempts (here: the server's HTTP
// thread, the benchmark client, a neighbour on the host) holds the whole region up for as long
// as it is away; with this, the others carry on with its items meanwhile.
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <memory>
#include <vector>

class WorkSplit {
 public:
  WorkSplit(int64_t items, int threads) : threads_(threads), ranges_(new Range[threads]) {
    for (int t = 0; t < threads; ++t) ranges_[t].bounds.store(pack(items * t / threads, items * (t + 1) / threads));
  }

  // Shares of about equal weight, for items whose costs differ: each item goes to the share that
  // holds the middle of its weight.
  WorkSplit(const std::vector<int64_t>& weights, int threads) : threads_(threads), ranges_(new Range[threads]) {
    int64_t total = 0, before = 0, item = 0;  // before: the weight of items [0, item)
    for (int64_t w : weights) total += w;
    const int64_t n = static_cast<int64_t>(weights.size());
    for (int t = 0; t < threads; ++t) {
      const int64_t begin = item;
      while (item < n && 2 * before + weights[item] <= 2 * total * (t + 1) / threads) before += weights[item++];
      ranges_[t].bounds.store(pack(begin, t + 1 == threads ? n : item));
    }
  }

  int threads() const { return threads_; }

  // The next item for thread `self`, or -1 when every range is empty.
  int64_t take(int self) {
    int64_t item = take_from(ranges_[self % threads_], false);
    for (int k = 1; item < 0 && k < threads_; ++k) item = take_from(ranges_[(self + k) % threads_], true);
    return item;
  }

 private:
  struct alignas(64) Range {  // a cache line each: threads taking from their own do not contend
    std::atomic<uint64_t> bounds;  // (end << 32) | begin
  };

  static uint64_t pack(int64_t begin, int64_t end) {
    return static_cast<uint64_t>(end) << 32 | static_cast<uint64_t>(begin);
  }

  // One item from the front of a range, or from its back; -1 if it is empty.
  static int64_t take_from(Range& range, bool back) {
    uint64_t bounds = range.bounds.load(std::memory_order_relaxed);
    while (true) {
      const int64_t begin = bounds & 0xFFFFFFFFu, end = bounds >> 32;
      if (begin >= end) return -1;
      const uint64_t rest = back ? pack(begin, end - 1) : pack(begin + 1, end);
      if (range.bounds.compare_exchange_weak(bounds, rest)) return back ? end - 1 : begin;
    }
  }

  int threads_;
  std::unique_ptr<Range[]> ranges_;
};

// A linear kernel's work items: (unit of output columns, chunk of rows) pairs, `count` chunks of
// `rows` rows (whole passes of pass_rows). With units enough for every thread a chunk is all the
// rows, so that a unit's weights are read from memory once; with fewer (a narrow layer, many
// cores) rows split too, so that no thread idles. A row's arithmetic does not depend on either.
struct RowChunks {
  int64_t count, rows;
  RowChunks(int64_t rows_total, int64_t units, int64_t pass_rows, int threads) {
    const int64_t passes = (rows_total + pass_rows - 1) / pass_rows;
    count = std::min(passes, std::max<int64_t>(1, (4 * threads + units - 1) / units));
    rows = (passes + count - 1) / count * pass_rows;
  }
};
