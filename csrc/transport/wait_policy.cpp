#include "transport/wait_policy.h"

#include <sched.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <thread>

#include "common/env.h"

namespace ringreduce {
namespace {

int64_t nowNs() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

// Threads runnable on the whole machine now (the 4th field of /proc/loadavg,
// "running/total"); -1 when it cannot be read.
int runnableThreads() {
  FILE* f = std::fopen("/proc/loadavg", "r");
  if (!f) return -1;
  double l1, l5, l15;
  int running = -1, total = 0;
  if (std::fscanf(f, "%lf %lf %lf %d/%d", &l1, &l5, &l15, &running, &total) != 5) running = -1;
  std::fclose(f);
  return running;
}

}  // namespace

WaitPolicy::WaitPolicy(int worldSize) {
  cores_ = std::max(1u, std::thread::hardware_concurrency());
  const bool fits = static_cast<unsigned>(worldSize) <= cores_;
  const int64_t spinDefault = fits ? kDefaultSpinUs : 0;
  const int64_t yieldDefault = fits ? 0 : kDefaultYieldUs;
  spinUs_ = envInt(kEnvSpinUs, spinDefault);
  yieldUs_ = envInt(kEnvYieldUs, yieldDefault);
  adaptiveSpin_ = !envIsSet(kEnvSpinUs);
  adaptiveYield_ = !envIsSet(kEnvYieldUs);
}

bool WaitPolicy::machineBusy() {
  const int64_t now = nowNs();
  int64_t sampled = sampledAtNs_.load(std::memory_order_relaxed);
  if (now - sampled >= kSampleMs * 1000000 &&
      sampledAtNs_.compare_exchange_strong(sampled, now, std::memory_order_relaxed)) {
    // This rank is one of the runnable threads: busy means others want every core.
    const int running = runnableThreads();
    busy_.store(running > static_cast<int>(cores_), std::memory_order_relaxed);
  }
  return busy_.load(std::memory_order_relaxed);
}

int64_t WaitPolicy::spinUs() {
  if (spinUs_ == 0) return 0;
  return adaptiveSpin_ && machineBusy() ? 0 : spinUs_;
}

int64_t WaitPolicy::yieldUs() {
  if (yieldUs_ == 0) return 0;
  if (adaptiveYield_ && nowNs() < noYieldUntilNs_.load(std::memory_order_relaxed)) return 0;
  return yieldUs_;
}

void WaitPolicy::yield() {
  const int64_t begin = nowNs();
  sched_yield();
  const int64_t end = nowNs();
  if (adaptiveYield_ && end - begin > kLateYieldUs * 1000) {
    noYieldUntilNs_.store(end + kYieldBackoffMs * 1000000, std::memory_order_relaxed);
  }
}

}  // namespace ringreduce
