// The CPU kernels' threads: a pool of helper threads beside the calling one, and the parallel loop
// over it that every kernel in engine/kernels runs its work through (rows_linear.cpp's weight rows,
// decode_ops.cpp's attention heads). One pool per process: the kernels' translation units share it
// (inline definitions outside an anonymous namespace).
#pragma once

#include <ATen/Parallel.h>

#include <immintrin.h>
#include <pthread.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>

namespace moebench_kernels {

// values read per parallel task at least: below it, a thread costs more than it saves
constexpr int64_t TASK_ELEMS = 1 << 16;

// The kernels' helper threads: as many as the intra-op threads beyond the caller, started on first
// use and kept. Between jobs a helper spins for the next one for SPIN_NS (a decode step calls the
// kernel every few microseconds, and waking a sleeping thread costs a sizeable part of one matrix's
// read at two threads: docs/cpu_experts.md), yielding its core to any other runnable thread as it spins, then
// sleeps until offered one. A helper takes the job on offer when it gets to it, or nothing if a
// newer one replaced it: the caller never waits for a helper to start (see run_chunks). A forked
// child starts a pool of its own (threads do not survive a fork).
constexpr int64_t SPIN_NS = 200000;

class Helpers {
 public:
  static Helpers& get() {
    static std::once_flag registered;
    std::call_once(registered, [] { pthread_atfork(nullptr, nullptr, [] { instance_ = nullptr; }); });
    if (instance_ == nullptr) instance_ = new Helpers();   // never freed: detached threads use it to the end
    return *instance_;
  }

  // Offer `work` to `helpers` helper threads (started here if fewer run).
  void offer(std::function<void()> work, int64_t helpers) {
    {
      std::lock_guard<std::mutex> lock(m_);
      while (static_cast<int64_t>(started_) < helpers) {
        std::thread([this] { loop(); }).detach();
        ++started_;
      }
      work_ = std::move(work);
      wanted_ = helpers;
      gen_.fetch_add(1, std::memory_order_release);
    }
    if (sleeping_.load(std::memory_order_acquire) > 0) cv_.notify_all();
  }

 private:
  void loop() {
    uint64_t seen = gen_.load(std::memory_order_acquire);
    for (;;) {
      const auto since = std::chrono::steady_clock::now();
      for (int spins = 0; gen_.load(std::memory_order_acquire) == seen; ++spins) {
        if ((spins & 63) != 63) { _mm_pause(); continue; }
        if (std::chrono::steady_clock::now() - since < std::chrono::nanoseconds(SPIN_NS)) {
          std::this_thread::yield();
          continue;
        }
        std::unique_lock<std::mutex> lock(m_);
        sleeping_.fetch_add(1, std::memory_order_acq_rel);
        cv_.wait(lock, [&] { return gen_.load(std::memory_order_acquire) != seen; });
        sleeping_.fetch_sub(1, std::memory_order_acq_rel);
      }
      std::function<void()> work;
      {
        std::lock_guard<std::mutex> lock(m_);
        seen = gen_.load(std::memory_order_acquire);
        if (wanted_ > 0) { --wanted_; work = work_; }
      }
      if (work) work();
    }
  }

  static inline Helpers* instance_ = nullptr;
  std::mutex m_;
  std::condition_variable cv_;
  std::atomic<uint64_t> gen_{0};
  std::atomic<int> sleeping_{0};
  std::function<void()> work_;   // the job on offer, and how many helpers may still take it (under m_)
  int64_t wanted_ = 0;
  int started_ = 0;
};

// range(i0, i1) over [0, O) in chunks of `chunk` items (a kernel's weight rows, say) claimed from a
// shared counter by the calling thread and by the helpers (Helpers; as many as the intra-op threads
// beyond the caller). The caller waits for the chunks
// to be done, never for a helper to start: a helper that another process keeps off its core joins
// late and finds nothing left, so a busy machine costs at worst the one-thread speed, where a
// parallel region would wait for that thread at its barrier.
template <typename Range>
struct RangeJob {
  Range range; int64_t O, chunk, chunks;
  std::atomic<int64_t> next{0}, done{0};
  RangeJob(const Range& r, int64_t o, int64_t size, int64_t c) : range(r), O(o), chunk(size), chunks(c) {}
  void work() {
    for (int64_t c = next.fetch_add(1); c < chunks; c = next.fetch_add(1)) {
      range(c * chunk, std::min(O, (c + 1) * chunk));
      done.fetch_add(1, std::memory_order_release);
    }
  }
};

// range(i0, i1) over [0, O) in chunks of `chunk`, `elems` values read in all (how many threads pay off).
template <typename Range>
void run_chunks(const Range& range, int64_t O, int64_t elems, int64_t chunk) {
  const int64_t chunks = (O + chunk - 1) / chunk;
  const int64_t helpers = std::min<int64_t>({at::get_num_threads(), chunks,
                                             std::max<int64_t>(1, elems / TASK_ELEMS)}) - 1;
  auto job = std::make_shared<RangeJob<Range>>(range, O, chunk, chunks);
  if (helpers > 0) Helpers::get().offer([job] { job->work(); }, helpers);   // holds the job, not the caller's frame
  job->work();
  for (int spins = 0; job->done.load(std::memory_order_acquire) < chunks; ++spins) {
    if (spins < 4096) _mm_pause(); else std::this_thread::yield();
  }
}

// range(j0, j1) over n rows of `row_elems` values each, in chunks of whole rows of at least
// TASK_ELEMS values (an element-wise op on a decode step's rows stays on the caller's thread).
template <typename Range>
void run_rows(const Range& range, int64_t n, int64_t row_elems) {
  if (n > 0) run_chunks(range, n, n * row_elems, std::max<int64_t>(1, TASK_ELEMS / std::max<int64_t>(1, row_elems)));
}

}  // namespace moebench_kernels
