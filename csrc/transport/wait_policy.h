// How a waiting rank spends the time until a peer's data arrives: busy-poll
// (the cheapest wake-up, but it burns the core), poll and yield (a rank that
// shares this core runs first), or sleep in the kernel (frees the core and
// pays the scheduler's wake-up latency, tens of microseconds).
//
// Defaults: spin up to kDefaultSpinUs when the group fits in this machine's
// cores, else yield up to kDefaultYieldUs. Both adapt to the machine unless
// RINGREDUCE_SPIN_US / RINGREDUCE_YIELD_US are set (then they are fixed):
//   - no spinning while the machine's runnable threads outnumber its cores
//     (sampled from /proc/loadavg at most every kSampleMs): the spin would
//     take a core from computation (DDP's backward, torch's intra-op threads,
//     other jobs) and delay the very peer we wait for;
//   - a sched_yield() that returns late (after kLateYieldUs: longer than a
//     peer rank's step, as long as a time slice among a few threads) means a thread
//     outside the group held this core for a time slice: yielding then hands
//     the core away for milliseconds per message, where a sleeping rank is
//     woken at once by its peer. Yielding stops for kYieldBackoffMs, then is
//     tried again. (4 ranks on 2 cores with one busy process per core: a
//     64 MiB all-reduce took 1.55 s yielding, 0.21 s sleeping.)
// Thread-safe: every thread of a transport shares one policy.
#pragma once

#include <atomic>
#include <cstdint>

namespace ringreduce {

class WaitPolicy {
 public:
  explicit WaitPolicy(int worldSize);

  // The budgets for the wait that is starting now, in microseconds of idle time.
  int64_t spinUs();
  int64_t yieldUs();
  // sched_yield(), timed: a late return turns yielding off for a while.
  void yield();

  static constexpr int64_t kDefaultSpinUs = 50;
  static constexpr int64_t kDefaultYieldUs = 200;
  static constexpr int64_t kLateYieldUs = 1500;
  static constexpr int64_t kYieldBackoffMs = 200;
  static constexpr int64_t kSampleMs = 20;

 private:
  bool machineBusy();

  int64_t spinUs_;
  int64_t yieldUs_;
  bool adaptiveSpin_;
  bool adaptiveYield_;
  unsigned cores_;
  std::atomic<int64_t> noYieldUntilNs_{0};  // steady-clock time
  std::atomic<int64_t> sampledAtNs_{0};
  std::atomic<bool> busy_{false};
};

}  // namespace ringreduce
