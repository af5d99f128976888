// Work shared between the calling thread and helpers on XLA's intra-op thread pool, for the CPU
// kernels of this folder (cache_attention.cc, small_matmul.cc): a call starts no thread.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <thread>

#include "xla/ffi/api/ffi.h"

namespace treespark {

// Runs `run(item)` for every item in [0, items) on this thread and on `threads` - 1 helpers
// scheduled on `pool`, each thread with its own `run = make_runner()` (its scratch memory). Items
// are claimed from one atomic counter. A helper that starts after the last item was claimed
// returns before it makes a runner, so it never touches the caller's buffers, and the caller waits
// only for items that are being run: no deadlock when the pool is busy or has one thread.
template <typename MakeRunner>
void ShareItems(xla::ffi::ThreadPool& pool, int64_t items, int64_t threads, MakeRunner make_runner) {
  struct Shared {
    std::atomic<int64_t> next{0}, unfinished{0};
  };
  const auto shared = std::make_shared<Shared>();
  shared->unfinished = items;
  auto work = [shared, items, make_runner]() {
    int64_t item = shared->next++;
    if (item >= items) return;
    auto run = make_runner();
    for (; item < items; item = shared->next++) {
      run(item);
      shared->unfinished--;
    }
  };
  for (int64_t i = 1; i < threads; ++i) pool.Schedule(decltype(work)(work));
  work();
  while (shared->unfinished.load() > 0) std::this_thread::yield();
}

}  // namespace treespark
