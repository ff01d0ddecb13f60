// Which stores copy a message into a ring, chosen by measurement.
//
// Streaming (non-temporal) stores skip taking each ring line back from the
// consumer's cache, but the consumer then reads the bytes from memory; plain
// stores leave them in the producer's cache. Which is faster depends on the
// machine (how far apart its cores' caches are) and on the op: one VM
// measured streaming 1.6-2.2x faster for 2-rank broadcasts, a later one plain
// 1.3-3x faster for the same ones (docs/transports.md, "Writing the rings").
//
// So each producer measures. Per kind of op and size class (the exchange's
// largest message, by powers of two) it alternates the two kinds for the
// first kSamples exchanges of each, keeps the one with the lower median
// exchange time, and samples both again after kRecheckAfter exchanges in
// that class, or at once when kWatch exchanges in a row on the choice took a
// median above the other kind's sampled median: the cores of a VM can move
// apart within seconds, where plain stores get several times slower and
// streaming ones do not (docs/transports.md, "Writing the rings"), so a
// machine whose load or placement changes is followed. The choice is the
// producer's alone: the consumer reads ring bytes the same way either way
// (the streaming copy fences before it publishes), so ranks that chose
// differently still exchange exact bytes; only speed is at stake. Ranks of a
// symmetric op alternate in step (the same exchanges in the same order), so a
// sample times both ends with the same stores.
//
// Used for the rings (per op: shm_transport.cpp) and the staging areas (per
// round of the two-step all-reduce: shm_shared_buffers.cpp). Not
// thread-safe: the backend's one op at a time drives a transport.
#pragma once

#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdint>
#include <map>
#include <mutex>
#include <unordered_map>
#include <utility>
#include <vector>

#include "transport/transport.h"

namespace ringreduce {
namespace shm {

class RingStoreChooser {
 public:
  // floor(log2(bytes)) for bytes > 0 (C++17: torch 2.11 builds with it).
  static int log2Floor(size_t bytes) {
    return 63 - __builtin_clzll(static_cast<unsigned long long>(bytes));
  }
  // --8<-- [start:sampling]
  static constexpr int kSamples = 9;                // per kind of store, per round of sampling
  static constexpr uint32_t kRecheckAfter = 2048;  // exchanges on the choice before sampling again
  static constexpr int kWatch = 8;  // exchanges on the choice whose median is compared
  // --8<-- [end:sampling]

  // Whether the next exchange of kind `kind` whose largest message is `bytes`
  // streams. Its time goes to record().
  bool streaming(uint8_t kind, size_t bytes) {
    Entry& e = table_[key(kind, bytes)];
    if (e.choice >= 0) {
      if (++e.sinceChoice <= kRecheckAfter) return e.choice == 1;
      e = Entry{};
    }
    int mode = static_cast<int>(e.turns++ & 1);
    if (e.count[mode] == kSamples) mode ^= 1;
    return mode == 1;
  }

  // The time of an exchange streaming() chose for.
  void record(uint8_t kind, size_t bytes, bool streamed, double us) {
    Entry& e = table_[key(kind, bytes)];
    const int mode = streamed ? 1 : 0;
    if (e.choice >= 0) {
      if (mode != e.choice) return;
      e.recent[e.recentCount++] = static_cast<float>(us);
      if (e.recentCount < kWatch) return;
      e.recentCount = 0;
      if (median(e.recent) > e.otherUs) e = Entry{};  // slower than the other kind was
      return;
    }
    if (e.count[mode] == kSamples) return;
    e.us[mode][e.count[mode]++] = static_cast<float>(us);
    if (e.count[0] == kSamples && e.count[1] == kSamples) {
      const float plain = median(e.us[0]), streamed = median(e.us[1]);
      e.choice = streamed < plain ? 1 : 0;
      e.otherUs = e.choice == 1 ? plain : streamed;
      e.sinceChoice = 0;
      e.recentCount = 0;
    }
  }

 private:
  struct Entry {
    std::array<std::array<float, kSamples>, 2> us{};  // [plain, streaming]
    std::array<int, 2> count{};
    uint32_t turns = 0;
    uint32_t sinceChoice = 0;
    int choice = -1;  // -1 sampling, 0 plain, 1 streaming
    float otherUs = 0;  // the median of the kind not chosen
    std::array<float, kWatch> recent{};  // the choice's latest times
    int recentCount = 0;
  };

  // The kind, and the size's power of two (floor of log2; callers pass >= 16 KiB).
  static uint32_t key(uint8_t kind, size_t bytes) {
    return static_cast<uint32_t>(kind) << 8 | static_cast<uint32_t>(log2Floor(bytes));
  }

  template <size_t N>
  static float median(std::array<float, N> v) {
    std::nth_element(v.begin(), v.begin() + N / 2, v.end());
    return v[N / 2];
  }

  std::unordered_map<uint32_t, Entry> table_;
};

// What the choices were (Transport::ringStoreUse): how many took plain and
// streaming stores, per kind of op and size class (floor of log2 of the
// bytes chosen for). Counted on the op's thread, read from any.
class StoreUse {
 public:
  void count(uint8_t kind, size_t bytes, bool streamed) {
    std::lock_guard<std::mutex> lock(mu_);
    ++counts_[{kind, RingStoreChooser::log2Floor(bytes)}][streamed ? 1 : 0];
  }

  std::vector<Transport::RingStoreUse::Row> rows(bool reset) {
    std::vector<Transport::RingStoreUse::Row> out;
    std::lock_guard<std::mutex> lock(mu_);
    for (const auto& [key, n] : counts_) {
      out.push_back({static_cast<OpKind>(key.first), size_t{1} << key.second, n[0], n[1]});
    }
    if (reset) counts_.clear();
    return out;
  }

 private:
  std::mutex mu_;
  std::map<std::pair<uint8_t, int>, std::array<uint64_t, 2>> counts_;
};

}  // namespace shm
}  // namespace ringreduce
