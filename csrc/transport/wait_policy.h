// How a waiting rank spends the time until a peer's data arrives: busy-poll
// (the cheapest wake-up, but it burns the core), poll and yield (a rank that
// shares this core runs first), or sleep in the kernel (frees the core and
// pays the scheduler's wake-up latency, tens of microseconds).
//
// Defaults: spin up to kDefaultSpinUs when this host's ranks of the group fit
// in its cores, then yield up to kDefaultYieldUs, then sleep. Both adapt to the machine
// unless RINGREDUCE_SPIN_US / RINGREDUCE_YIELD_US are set (then they are
// fixed), from the machine's runnable threads (/proc/loadavg, sampled at most
// every kSampleMs; the median of the last kSamples samples, so a thread that
// is runnable for a moment, such as a launcher's monitor or a library's event
// loop, does not stop the spinning for a whole sample period):
//   - no spinning while the runnable threads outnumber the cores: the spin
//     would take a core from computation (DDP's backward, torch's intra-op
//     threads, other jobs) and delay the very peer we wait for;
//   - no yielding while they outnumber max(cores, local ranks) + 1: ranks that
//     yield stay runnable, so up to one per local rank is the group taking
//     turns (4 ranks on 2 cores, nothing else running: yielding hands the
//     core to the peer that has work; one more for a stray thread), and
//     beyond that threads outside the group hold the cores, where a yield
//     gives one of them a whole time slice per message and a sleeping rank
//     is woken at once by its peer
//     (4 ranks on 2 cores with one busy process per core: a 64 MiB
//     all-reduce took 1.55 s yielding, 0.21 s sleeping).
//
// A rank that sleeps asks the kernel for a short time slice while it sleeps
// (kDefaultWakeSliceUs, RINGREDUCE_WAKE_SLICE_US; Linux 6.12+): a woken task
// whose slice is shorter than the running one's preempts it, so the peer's
// doorbell gets this rank the core at once where it would otherwise wait for
// a CPU-bound thread's slice (1-3 ms) to end. It changes when the thread runs,
// not how much: its weight stays, and the slice it had is back once it wakes.
// Thread-safe: every thread of a transport shares one policy.
#pragma once

#include <atomic>
#include <cstdint>

namespace ringreduce {

class WaitPolicy {
 public:
  explicit WaitPolicy(int worldSize);
  // How many of the group's ranks run on this host (the world size until the
  // layout is known) and how many CPUs they may use between them (the union
  // of their affinity masks, capped by the cgroup quota: cpu_budget.h; 0 or
  // more than the machine's: the machine's cores). The defaults and the
  // yield rule depend on them. Call before the first wait.
  void setLocalRanks(int ranks, int cpus = 0);

  // Whether this host's ranks of the group are no more than the CPUs they
  // may use (each can have a core to itself), as set by setLocalRanks.
  bool ranksFitCores() const { return static_cast<unsigned>(localRanks_) <= usableCpus_; }
  int localRanks() const { return localRanks_; }
  unsigned usableCpus() const { return usableCpus_; }
  unsigned machineCores() const { return cores_; }

  // The budgets for the wait that is starting now, in microseconds of idle time.
  int64_t spinUs();
  int64_t yieldUs();
  // The budgets as configured, before the machine's load adapts them.
  int64_t configuredSpinUs() const { return spinUs_; }
  int64_t configuredYieldUs() const { return yieldUs_; }
  void yield();

  // Brackets a sleep in the kernel on the calling thread: asks for the wake
  // slice, and gives the thread the slice it had when it goes out of scope.
  // Nothing when the slice is 0, the thread is not SCHED_OTHER, or the kernel
  // has no per-task slice (then no thread of the process tries again).
  class Sleep {
   public:
    explicit Sleep(const WaitPolicy& policy);
    ~Sleep();
    Sleep(const Sleep&) = delete;
    Sleep& operator=(const Sleep&) = delete;

   private:
    bool changed_ = false;
    uint64_t slice_ = 0;  // ns, as the thread had it
    int32_t nice_ = 0;
    uint64_t flags_ = 0;
  };
  int64_t wakeSliceUs() const { return wakeSliceUs_; }

  // What this group's waits did, for explaining a run (a relaxed atomic add
  // per wait that had to wait, and one sched_getcpu): how many ended while
  // spinning, while yielding, or slept in the kernel (each counted once, at
  // the furthest it got); how often the waiting thread was found on another
  // CPU than at its previous wait; the CPUs it was found on (bit i: CPU i,
  // CPUs past 63 as bit 63).
  enum class Phase { kNone = 0, kSpun, kYielded, kSlept };
  void noteWait(Phase furthest);
  // With the process's own counts since the group was created or the last
  // reset (getrusage, process-wide: every thread and group of this process):
  // context switches it asked for (a sleep) and ones the kernel forced (its
  // thread was preempted), and page faults (minor: a page mapped on first
  // touch; major: one read from disk).
  struct Summary {
    uint64_t spun = 0, yielded = 0, slept = 0, migrations = 0, cpuMask = 0;
    int64_t voluntarySwitches = 0, involuntarySwitches = 0, minorFaults = 0, majorFaults = 0;
  };
  Summary summary() const;
  void resetSummary();
  // The machine's runnable threads as last sampled (-1: not yet).
  int lastRunnable() const { return runnable_.load(std::memory_order_relaxed); }

  // --8<-- [start:budgets]
  static constexpr int64_t kDefaultSpinUs = 50;
  static constexpr int64_t kDefaultYieldUs = 200;
  static constexpr int64_t kDefaultWakeSliceUs = 100;
  static constexpr int64_t kSampleMs = 20;
  static constexpr int kSamples = 5;
  // --8<-- [end:budgets]

 private:
  // The machine's runnable threads: the median of the last kSamples samples
  // (-1: unknown).
  int runnable();

  int64_t spinUs_ = 0;
  int64_t yieldUs_ = 0;
  int64_t wakeSliceUs_ = kDefaultWakeSliceUs;
  bool adaptiveSpin_;
  bool adaptiveYield_;
  unsigned cores_;        // the machine's (runnable threads are counted machine-wide)
  unsigned usableCpus_;   // the group's ranks on this host may run on
  int localRanks_ = 1;
  std::atomic<int64_t> sampledAtNs_{0};
  std::atomic<int> samples_[kSamples];  // -1: not sampled yet
  std::atomic<unsigned> nextSample_{0};
  std::atomic<int> runnable_{-1};  // the median of samples_
  std::atomic<uint64_t> spun_{0}, yielded_{0}, slept_{0}, migrations_{0}, cpuMask_{0};
  // The process's getrusage counts at creation or the last reset.
  std::atomic<int64_t> usageAt_[4] = {0, 0, 0, 0};
};

}  // namespace ringreduce
