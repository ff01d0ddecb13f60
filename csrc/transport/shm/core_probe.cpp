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

#include "transport/shm/shm_segment.h"

namespace ringreduce {
namespace shm {
namespace {

using ProbeClock = std::chrono::steady_clock;

void pinTo(int cpu) {
  cpu_set_t set;
  CPU_ZERO(&set);
  CPU_SET(cpu, &set);
  const int rc = pthread_setaffinity_np(pthread_self(), sizeof(set), &set);
  if (rc != 0) {
    throw std::runtime_error("probe_cores: cannot run a thread on CPU " + std::to_string(cpu) +
                             " (" + std::strerror(rc) + ")");
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

}  // namespace

CoreProbe probeCores(int cpuA, int cpuB, size_t pieceBytes, int pieces, double limitS) {
  if (cpuA == cpuB || pieceBytes == 0 || pieces <= 0) {
    throw std::invalid_argument("probe_cores: two different CPUs and some pieces to hand over");
  }
  constexpr int kTrips = 2000, kTripRuns = 3;
  auto s = std::make_unique<Shared>();
  s->deadline = ProbeClock::now() + std::chrono::duration_cast<ProbeClock::duration>(
                                        std::chrono::duration<double>(limitS));
  // Two slots the writer fills in turn, the source it writes from, the
  // reader's destination.
  std::vector<char> slots(2 * pieceBytes), source(pieceBytes * pieces, 1), sink(pieceBytes);
  std::fill(slots.begin(), slots.end(), 0);
  std::fill(sink.begin(), sink.end(), 0);
  const int handoffRuns = 4;  // plain, streaming, plain, streaming

  std::string readerError;
  std::thread reader([&] {
    try {
      pinTo(cpuB);
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
      pinTo(cpuA);
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
  writer.join();
  reader.join();
  if (!readerError.empty()) throw std::runtime_error(readerError);
  if (!error.empty()) throw std::runtime_error(error);
  if (s->stop.load()) {
    throw std::runtime_error("probe_cores: CPUs " + std::to_string(cpuA) + " and " +
                             std::to_string(cpuB) + " did not finish within " +
                             std::to_string(limitS) + " s");
  }
  return out;
}

}  // namespace shm
}  // namespace ringreduce
