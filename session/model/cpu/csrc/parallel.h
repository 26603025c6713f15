// Work shared on torch's OpenMP team item by item, for our CPU kernels (session/model/cpu/kernels.py builds them;
// a change here rebuilds every kernel, as the cache key covers the headers in this folder).
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cstdint>

namespace resident {

// Items 0 .. count-1 on torch's team, each thread taking the next item as it finishes one (a
// thread that starts late or runs slower takes fewer), in one fork and join. An item's result does
// not depend on which thread computes it.
template <typename F>
void for_each_shared(int64_t count, const F& item) {
  if (count <= 0) return;
  const int64_t threads = std::min<int64_t>(at::get_num_threads(), count);
  if (threads <= 1 || at::in_parallel_region()) {
    for (int64_t i = 0; i < count; ++i) item(i);
    return;
  }
  std::atomic<int64_t> next{0};
  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
    for (int64_t i = next.fetch_add(1, std::memory_order_relaxed); i < count;
         i = next.fetch_add(1, std::memory_order_relaxed))
      item(i);
  });
}

}  // namespace resident
