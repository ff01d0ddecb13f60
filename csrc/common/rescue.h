// How long a watcher lets Future callbacks hold every thread that could make
// progress (the executor's workers), with work waiting, before it starts one
// more thread. torch's Future::wait() in a
// callback never reaches the backend, so a blocked callback looks like a slow
// one: the first kFastRescues threads come after kRescueAfter each, and each
// later one after a stall twice as long as the one before, up to
// kMaxRescueWait. Slow callbacks end such a stall and stop adding threads;
// blocked ones never do, and get a thread each (any depth, no cap).
#pragma once

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdint>

namespace ringreduce {

constexpr std::chrono::milliseconds kRescueAfter{10};
constexpr size_t kFastRescues = 8;
constexpr std::chrono::milliseconds kMaxRescueWait{1000};

// The stall before the next thread, given the threads started so far.
inline std::chrono::milliseconds rescueStall(size_t started) {
  if (started < kFastRescues) return kRescueAfter;
  const size_t doublings = std::min<size_t>(started - kFastRescues + 1, 16);
  return std::min<std::chrono::milliseconds>(kMaxRescueWait,
                                             kRescueAfter * (int64_t{1} << doublings));
}

}  // namespace ringreduce
