// Two pinned threads, a shared cache line and two buffers (core_probe.h).
#include "transport/shm/core_probe.h"

#include <pthread.h>
#include <sched.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <memory>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "kernels/reduce_ops.h"
#include "transport/shm/shm_segment.h"

namespace ringreduce {
namespace shm {
namespace {

using ProbeClock = std::chrono::steady_clock;

void pinTo(const char* probe, int cpu) {
  cpu_set_t set;
  CPU_ZERO(&set);
  CPU_SET(cpu, &set);
  const int rc = pthread_setaffinity_np(pthread_self(), sizeof(set), &set);
  if (rc != 0) {
    throw std::runtime_error(std::string(probe) + ": cannot run a thread on CPU " +
                             std::to_string(cpu) + " (" + std::strerror(rc) + ")");
  }
}

// The state the two threads share; each counter on its own line.
struct Shared {
  alignas(64) std::atomic<uint64_t> ball{0};  // the round trip's line
  alignas(64) std::atomic<uint64_t> written{0};  // pieces the writer has handed over
  alignas(64) std::atomic<uint64_t> copied{0};   // pieces the reader has copied out
  alignas(64) std::atomic<bool> stop{false};     // the time limit passed
  ProbeClock::time_point deadline;
};

// Spins until pred() or the deadline (then sets stop and returns false).
template <typename Pred>
bool spinUntil(Shared& s, Pred pred) {
  for (uint32_t i = 0; !pred(); ++i) {
    if (s.stop.load(std::memory_order_relaxed)) return false;
    if ((i & 1023) == 1023 && ProbeClock::now() > s.deadline) {
      s.stop.store(true);
      return false;
    }
  }
  return true;
}

// Joins both threads, then throws what either met, or the time limit.
void finish(const char* probe, std::thread& a, std::thread& b, const std::string& errorA,
            const std::string& errorB, const Shared& s, int cpuA, int cpuB, double limitS) {
  a.join();
  b.join();
  if (!errorB.empty()) throw std::runtime_error(errorB);
  if (!errorA.empty()) throw std::runtime_error(errorA);
  if (s.stop.load()) {
    throw std::runtime_error(std::string(probe) + ": CPUs " + std::to_string(cpuA) + " and " +
                             std::to_string(cpuB) + " did not finish within " +
                             std::to_string(limitS) + " s");
  }
}

ProbeClock::time_point deadlineIn(double limitS) {
  return ProbeClock::now() + std::chrono::duration_cast<ProbeClock::duration>(
                                 std::chrono::duration<double>(limitS));
}

}  // namespace

CoreProbe probeCores(int cpuA, int cpuB, size_t pieceBytes, int pieces, double limitS) {
  if (cpuA == cpuB || pieceBytes == 0 || pieces <= 0) {
    throw std::invalid_argument("probe_cores: two different CPUs and some pieces to hand over");
  }
  constexpr int kTrips = 2000, kTripRuns = 3;
  auto s = std::make_unique<Shared>();
  s->deadline = deadlineIn(limitS);
  // Two slots the writer fills in turn, the source it writes from, the
  // reader's destination.
  std::vector<char> slots(2 * pieceBytes), source(pieceBytes * pieces, 1), sink(pieceBytes);
  std::fill(slots.begin(), slots.end(), 0);
  std::fill(sink.begin(), sink.end(), 0);
  const int handoffRuns = 4;  // plain, streaming, plain, streaming

  std::string readerError;
  std::thread reader([&] {
    try {
      pinTo("probe_cores", cpuB);
    } catch (const std::exception& e) {
      readerError = e.what();
      s->stop.store(true);
      return;
    }
    for (int run = 0; run < kTripRuns; ++run) {
      for (uint64_t i = 0; i < kTrips; ++i) {
        const uint64_t base = (static_cast<uint64_t>(run) * kTrips + i) * 2;
        if (!spinUntil(*s, [&] { return s->ball.load(std::memory_order_acquire) == base + 1; })) {
          return;
        }
        s->ball.store(base + 2, std::memory_order_release);
      }
    }
    uint64_t total = 0;
    for (int run = 0; run < handoffRuns; ++run) {
      for (int k = 0; k < pieces; ++k, ++total) {
        if (!spinUntil(*s, [&] { return s->written.load(std::memory_order_acquire) > total; })) {
          return;
        }
        std::memcpy(sink.data(), slots.data() + (total % 2) * pieceBytes, pieceBytes);
        s->copied.store(total + 1, std::memory_order_release);
      }
    }
  });

  // The writer on a thread of its own too: the caller's affinity stays as it is.
  CoreProbe out;
  std::string error;
  std::thread writer([&] {
    try {
      pinTo("probe_cores", cpuA);
      out.roundTripNs = 1e300;
      for (int run = 0; run < kTripRuns && !s->stop.load(); ++run) {
        const auto start = ProbeClock::now();
        for (uint64_t i = 0; i < kTrips; ++i) {
          const uint64_t base = (static_cast<uint64_t>(run) * kTrips + i) * 2;
          s->ball.store(base + 1, std::memory_order_release);
          if (!spinUntil(*s, [&] { return s->ball.load(std::memory_order_acquire) == base + 2; })) {
            break;
          }
        }
        const double ns =
            std::chrono::duration<double, std::nano>(ProbeClock::now() - start).count();
        out.roundTripNs = std::min(out.roundTripNs, ns / kTrips);
      }
      uint64_t total = 0;
      for (int run = 0; run < handoffRuns && !s->stop.load(); ++run) {
        const bool streaming = run % 2 == 1;
        const auto start = ProbeClock::now();
        for (int k = 0; k < pieces; ++k, ++total) {
          // The slot written now was read by the reader two pieces ago.
          const auto slotFree = [&] {
            return s->copied.load(std::memory_order_acquire) + 2 > total;
          };
          if (!spinUntil(*s, slotFree)) {
            break;
          }
          copyIntoRing(slots.data() + (total % 2) * pieceBytes,
                       source.data() + static_cast<size_t>(k) * pieceBytes, pieceBytes, streaming);
          s->written.store(total + 1, std::memory_order_release);
        }
        spinUntil(*s, [&] { return s->copied.load(std::memory_order_acquire) == total; });
        const double sec = std::chrono::duration<double>(ProbeClock::now() - start).count();
        double& best = streaming ? out.streamingGBps : out.plainGBps;
        best = std::max(best, static_cast<double>(pieceBytes) * pieces / sec / 1e9);
      }
    } catch (const std::exception& e) {
      error = e.what();
      s->stop.store(true);
    }
  });
  finish("probe_cores", writer, reader, error, readerError, *s, cpuA, cpuB, limitS);
  return out;
}

std::vector<double> probeExchange(int cpuA, int cpuB, size_t bytes, int rounds, int runs,
                                  double limitS) {
  if (cpuA == cpuB || bytes < sizeof(float) || rounds <= 0 || runs <= 0) {
    throw std::invalid_argument(
        "probe_exchange: two different CPUs, at least one float32 and some rounds");
  }
  const size_t count = bytes / sizeof(float);
  std::string why;
  const ReduceFn sum = reduceFunction(c10::ScalarType::Float, c10d::ReduceOp::SUM, &why);
  // Per side: the area it writes and the other reads, and its two counters
  // (rounds sent, rounds folded), each on its own line.
  struct alignas(64) Side {
    alignas(64) std::atomic<uint64_t> sent{0};
    alignas(64) std::atomic<uint64_t> folded{0};
  };
  auto s = std::make_unique<Shared>();
  s->deadline = deadlineIn(limitS);
  auto sides = std::make_unique<Side[]>(2);
  std::vector<float> areas(2 * count, 0.0f);
  std::vector<double> perRun;
  std::string errors[2];
  const int cpus[2] = {cpuA, cpuB};
  const auto side = [&](int me) {
    try {
      pinTo("probe_exchange", cpus[me]);
      const int peer = 1 - me;
      std::vector<float> own(count, 0.0f);  // zeros: the sums stay finite
      float* mine = areas.data() + me * count;
      const float* theirs = areas.data() + peer * count;
      uint64_t k = 0;
      for (int run = 0; run < runs; ++run) {
        const auto start = ProbeClock::now();
        for (int i = 0; i < rounds; ++i) {
          ++k;
          // The other side has folded this side's area of the last round.
          const auto areaFree = [&] {
            return sides[peer].folded.load(std::memory_order_acquire) + 1 >= k;
          };
          const auto peerSent = [&] {
            return sides[peer].sent.load(std::memory_order_acquire) >= k;
          };
          if (!spinUntil(*s, areaFree)) {
            return;
          }
          std::memcpy(mine, own.data(), count * sizeof(float));
          sides[me].sent.store(k, std::memory_order_release);
          if (!spinUntil(*s, peerSent)) {
            return;
          }
          sum(own.data(), theirs, count);
          sides[me].folded.store(k, std::memory_order_release);
        }
        if (me == 0) {
          perRun.push_back(
              std::chrono::duration<double, std::micro>(ProbeClock::now() - start).count() /
              rounds);
        }
      }
    } catch (const std::exception& e) {
      errors[me] = e.what();
      s->stop.store(true);
    }
  };
  std::thread a(side, 0), b(side, 1);
  finish("probe_exchange", a, b, errors[0], errors[1], *s, cpuA, cpuB, limitS);
  return perRun;
}

}  // namespace shm
}  // namespace ringreduce
