#include "transport/wait_policy.h"

#include <sched.h>
#include <sys/resource.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <array>
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

// The process's voluntary and involuntary context switches, minor and major
// page faults so far.
std::array<int64_t, 4> processUsage() {
  rusage u{};
  if (getrusage(RUSAGE_SELF, &u) != 0) return {0, 0, 0, 0};
  return {u.ru_nvcsw, u.ru_nivcsw, u.ru_minflt, u.ru_majflt};
}

// Linux's struct sched_attr (sched_setattr(2); glibc wraps it only from 2.41).
// For SCHED_OTHER, sched_runtime is the task's time slice in ns (6.12+; older
// kernels report 0 and ignore it).
struct SchedAttr {
  uint32_t size;
  uint32_t policy;
  uint64_t flags;
  int32_t nice;
  uint32_t priority;
  uint64_t runtime;
  uint64_t deadline;
  uint64_t period;
  uint32_t utilMin;
  uint32_t utilMax;
};
static_assert(sizeof(SchedAttr) == 56, "SCHED_ATTR_SIZE_VER1");
constexpr uint64_t kSchedResetOnFork = 0x01;  // SCHED_FLAG_RESET_ON_FORK

bool getSchedAttr(SchedAttr* a) {
  return syscall(SYS_sched_getattr, 0, a, sizeof(*a), 0) == 0;
}

bool setSlice(uint64_t sliceNs, int32_t nice, uint64_t flags) {
  SchedAttr a{};
  a.size = sizeof(a);
  a.policy = SCHED_OTHER;
  a.flags = flags;
  a.nice = nice;
  a.runtime = sliceNs;
  return syscall(SYS_sched_setattr, 0, &a, 0) == 0;
}

// Cleared the first time the kernel shows it has no per-task slice or refuses
// to set one (a seccomp filter): every later sleep then skips the system calls.
std::atomic<bool> sliceWorks{true};

}  // namespace

WaitPolicy::Sleep::Sleep(const WaitPolicy& policy) {
  if (policy.wakeSliceUs_ <= 0 || !sliceWorks.load(std::memory_order_relaxed)) return;
  SchedAttr a{};
  if (!getSchedAttr(&a) || a.runtime == 0) {
    sliceWorks.store(false, std::memory_order_relaxed);
    return;
  }
  // SCHED_BATCH and SCHED_IDLE never preempt on waking; real-time classes
  // need no slice.
  if (a.policy != SCHED_OTHER) return;
  const uint64_t want = static_cast<uint64_t>(policy.wakeSliceUs_) * 1000;
  if (want >= a.runtime) return;
  slice_ = a.runtime;
  nice_ = a.nice;
  flags_ = a.flags & kSchedResetOnFork;
  if (!setSlice(want, nice_, flags_)) {
    sliceWorks.store(false, std::memory_order_relaxed);
    return;
  }
  changed_ = true;
}

WaitPolicy::Sleep::~Sleep() {
  if (changed_) setSlice(slice_, nice_, flags_);
}

WaitPolicy::WaitPolicy(int worldSize) {
  resetSummary();
  for (auto& sample : samples_) sample.store(-1, std::memory_order_relaxed);
  cores_ = std::max(1u, std::thread::hardware_concurrency());
  usableCpus_ = cores_;
  adaptiveSpin_ = !envIsSet(kEnvSpinUs);
  adaptiveYield_ = !envIsSet(kEnvYieldUs);
  wakeSliceUs_ = envInt(kEnvWakeSliceUs, kDefaultWakeSliceUs);
  setLocalRanks(worldSize);
}

// --8<-- [start:defaults]
void WaitPolicy::setLocalRanks(int ranks, int cpus) {
  localRanks_ = std::max(1, ranks);
  usableCpus_ = cpus > 0 ? std::min(cores_, static_cast<unsigned>(cpus)) : cores_;
  spinUs_ = envInt(kEnvSpinUs, ranksFitCores() ? kDefaultSpinUs : 0);
  // Yielding also when the ranks fit: once the spin is over (or not allowed,
  // the machine being busy), a yield that finds nothing else to run costs
  // about what a spin pass costs, where a sleep costs a futex wake-up on
  // both sides (measured on the 2-rank 4 KiB all-reduce).
  yieldUs_ = envInt(kEnvYieldUs, kDefaultYieldUs);
}
// --8<-- [end:defaults]

int WaitPolicy::runnable() {
  const int64_t now = nowNs();
  int64_t sampled = sampledAtNs_.load(std::memory_order_relaxed);
  if (now - sampled >= kSampleMs * 1000000 &&
      sampledAtNs_.compare_exchange_strong(sampled, now, std::memory_order_relaxed)) {
    // One thread samples at a time (the exchange above); the others read the
    // last median meanwhile.
    const unsigned at = nextSample_.fetch_add(1, std::memory_order_relaxed) % kSamples;
    samples_[at].store(runnableThreads(), std::memory_order_relaxed);
    int known[kSamples];
    int n = 0;
    for (const auto& sample : samples_) {
      const int v = sample.load(std::memory_order_relaxed);
      if (v >= 0) known[n++] = v;
    }
    int median = -1;
    if (n > 0) {
      std::nth_element(known, known + n / 2, known + n);
      median = known[n / 2];
    }
    runnable_.store(median, std::memory_order_relaxed);
  }
  return runnable_.load(std::memory_order_relaxed);
}

// --8<-- [start:adapt]
int64_t WaitPolicy::spinUs() {
  if (spinUs_ == 0) return 0;
  // This rank is one of the runnable threads: more than the cores means
  // others want every core.
  return adaptiveSpin_ && runnable() > static_cast<int>(cores_) ? 0 : spinUs_;
}

int64_t WaitPolicy::yieldUs() {
  if (yieldUs_ == 0) return 0;
  // Waiting ranks that yield stay runnable: up to one per local rank is the
  // group itself taking turns (one more: a stray thread, the sampler's own
  // process); beyond that, threads outside the group hold the cores and a
  // yield hands them a whole time slice.
  const int ours = std::max(static_cast<int>(cores_), localRanks_) + 1;
  return adaptiveYield_ && runnable() > ours ? 0 : yieldUs_;
}
// --8<-- [end:adapt]

void WaitPolicy::yield() {
  sched_yield();
}

void WaitPolicy::noteWait(Phase furthest) {
  constexpr auto relaxed = std::memory_order_relaxed;
  switch (furthest) {
    case Phase::kSpun: spun_.fetch_add(1, relaxed); break;
    case Phase::kYielded: yielded_.fetch_add(1, relaxed); break;
    case Phase::kSlept: slept_.fetch_add(1, relaxed); break;
    case Phase::kNone: return;
  }
  thread_local int lastCpu = -1;
  const int cpu = sched_getcpu();
  if (cpu < 0) return;
  if (lastCpu >= 0 && cpu != lastCpu) migrations_.fetch_add(1, relaxed);
  lastCpu = cpu;
  cpuMask_.fetch_or(uint64_t{1} << std::min(cpu, 63), relaxed);
}

WaitPolicy::Summary WaitPolicy::summary() const {
  constexpr auto relaxed = std::memory_order_relaxed;
  Summary s;
  s.spun = spun_.load(relaxed);
  s.yielded = yielded_.load(relaxed);
  s.slept = slept_.load(relaxed);
  s.migrations = migrations_.load(relaxed);
  s.cpuMask = cpuMask_.load(relaxed);
  const std::array<int64_t, 4> now = processUsage();
  s.voluntarySwitches = now[0] - usageAt_[0].load(relaxed);
  s.involuntarySwitches = now[1] - usageAt_[1].load(relaxed);
  s.minorFaults = now[2] - usageAt_[2].load(relaxed);
  s.majorFaults = now[3] - usageAt_[3].load(relaxed);
  return s;
}

void WaitPolicy::resetSummary() {
  for (auto* counter : {&spun_, &yielded_, &slept_, &migrations_, &cpuMask_}) {
    counter->store(0, std::memory_order_relaxed);
  }
  const std::array<int64_t, 4> now = processUsage();
  for (size_t i = 0; i < now.size(); ++i) usageAt_[i].store(now[i], std::memory_order_relaxed);
}

}  // namespace ringreduce
