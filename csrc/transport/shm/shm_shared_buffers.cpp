// The segment's staging areas as SharedBuffers (transport/shared_buffers.h),
// for algorithms that read their peers' data in place.
//
// Round g uses buffer g % 2 of every rank's two slots. Rank r may write its
// slot of buffer g % 2 once every rank's staged flag reached g - 1: a rank
// stages g - 1 only after it finished round g - 2, the last one that read
// that buffer. So no trailing barrier is needed, and a peer is at most one
// round ahead (it cannot stage g + 1 before this rank staged g), which is
// why a stamp read under staged >= g is round g's: the stamp sits in the slot
// it describes, and that slot is rewritten in round g + 2 at the earliest.
//
// Memory order: a rank writes its slot, then stores its flag (release); a
// reader loads the flag (acquire), then reads the slot. Flags only grow.
//
// Mismatch: a peer that runs another collective on the rings sends this rank
// a message it never consumes; its header, seen in a wait, names the peer's op.
// The rings are looked at before the flags, so a peer that finished this op
// and already sent its next one's message is never mistaken for it: it could
// only have finished once every flag this rank waits for was up.
#include <algorithm>
#include <chrono>
#include <cstring>
#include <thread>

#include "transport/shm/ring_stores.h"
#include "transport/shm/shm_segment.h"
#include "transport/shm/shm_transport.h"

namespace ringreduce {
namespace shm {
namespace {

enum class Flag { kStaged, kReduced };

class ShmSharedBuffers : public SharedBuffers {
 public:
  ShmSharedBuffers(ControlPlane& plane, Segment& seg, const Members& members, RingStores stores,
                   StoreUse& use)
      : plane_(plane), seg_(seg), members_(members), rank_(members.me), size_(members.size()),
        stores_(stores), use_(use) {}

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  int groupRank(int local) const override { return members_.ranks[local]; }
  size_t stagingBytes() const override { return seg_.layout().stagingBytes; }

  uint64_t beginRound(const OpInfo& op) override {
    announceOp(seg_, rank_, op);
    const uint64_t round = ++round_;
    awaitFlags(op, Flag::kStaged, round - 1, "finish its previous round");
    return round;
  }

  // As the rings choose theirs (shm_transport.cpp).
  void chooseStores(const OpInfo& op, size_t bytes) override {
    storesKind_ = static_cast<uint8_t>(op.kind);
    storesBytes_ = bytes;
    const bool large = bytes >= kStreamingMinBytes;
    timed_ = large && stores_ == RingStores::kMeasured;
    streams_ = large && (stores_ == RingStores::kStreaming ||
                         (timed_ && chooser_.streaming(storesKind_, bytes)));
    if (large) use_.count(storesKind_, bytes, streams_);
    if (timed_) storesStart_ = Clock::now();
  }

  void stage(char* dst, const char* src, size_t n) override {
    copyIntoRing(dst, src, n, streams_);
  }

  bool streaming() const override { return streams_; }

  void storesDone() override {
    if (timed_) {
      const double us =
          std::chrono::duration<double, std::micro>(Clock::now() - storesStart_).count() +
          hooks().storePenaltyUs[streams_].load(std::memory_order_relaxed);
      chooser_.record(storesKind_, storesBytes_, streams_, us);
    }
    timed_ = streams_ = false;
  }

  char* staging(int rank, uint64_t round) override {
    return seg_.slot(static_cast<int>(round % 2), rank) + kSlotStampBytes;
  }

  void publishStaged(const OpInfo& op, uint64_t round, uint64_t step, size_t bytes) override {
    SendSpec spec{-1, nullptr, bytes, step};
    const WireHeader stamp = messageHeader(op, spec);
    std::memcpy(seg_.slot(static_cast<int>(round % 2), rank_), &stamp, sizeof(stamp));
    publish(Flag::kStaged, round);
  }

  void awaitStaged(const OpInfo& op, uint64_t round, uint64_t step, size_t bytes) override {
    awaitFlags(op, Flag::kStaged, round, "stage step " + std::to_string(step));
    RecvSpec spec{-1, nullptr, bytes, step, {}};
    for (int q = 0; q < size_; ++q) {
      if (q == rank_) continue;
      WireHeader stamp;
      std::memcpy(&stamp, seg_.slot(static_cast<int>(round % 2), q), sizeof(stamp));
      spec.peer = q;
      const std::string err = headerMismatch(op, spec, stamp);
      if (!err.empty()) {
        plane_.failOp(op, members_.ranks[q], err + " (in the shared staging areas)");
      }
    }
  }

  void publishReduced(uint64_t round) override { publish(Flag::kReduced, round); }

  void awaitReduced(const OpInfo& op, uint64_t round) override {
    awaitFlags(op, Flag::kReduced, round, "reduce its slice");
  }

 private:
  std::atomic<uint64_t>& flag(int rank, Flag which) {
    StageFlags& f = seg_.flags(rank);
    return which == Flag::kStaged ? f.staged : f.reduced;
  }

  void publish(Flag which, uint64_t round) {
    flag(rank_, which).store(round, std::memory_order_release);
    for (int q = 0; q < size_; ++q) {
      if (q != rank_) seg_.ring(q);
    }
  }

  // The peers whose `which` flag is below `round`: how many, and the first.
  int behind(Flag which, uint64_t round, int* first = nullptr) {
    int count = 0;
    for (int q = 0; q < size_; ++q) {
      if (q != rank_ && flag(q, which).load(std::memory_order_acquire) < round) {
        if (count++ == 0 && first != nullptr) *first = q;
      }
    }
    return count;
  }

  // A peer with a message in its ring to this rank, or -1 (see the top).
  int firstSender() {
    for (int q = 0; q < size_; ++q) {
      if (q == rank_) continue;
      const RingControl& c = seg_.control(q, rank_);
      if (c.head.load(std::memory_order_acquire) != c.tail.load(std::memory_order_relaxed)) {
        return q;
      }
    }
    return -1;
  }

  [[noreturn]] void otherAlgorithm(const OpInfo& op, int peer) {
    // Pushed whole in its first piece (an empty ring has room for a header),
    // but a slow writer may not have published it yet: wait a moment.
    const RingControl& c = seg_.control(peer, rank_);
    const uint64_t tail = c.tail.load(std::memory_order_relaxed);
    const auto until = Clock::now() + std::chrono::milliseconds(100);
    while (c.head.load(std::memory_order_acquire) - tail < sizeof(WireHeader) &&
           Clock::now() < until) {
      std::this_thread::yield();
    }
    std::string what = "the peer sent a message while this rank waits in the shared staging "
                       "areas";
    if (c.head.load(std::memory_order_acquire) - tail >= sizeof(WireHeader) &&
        tail % seg_.layout().ringBytes + sizeof(WireHeader) <= seg_.layout().ringBytes) {
      WireHeader h;
      std::memcpy(&h, seg_.ringData(peer, rank_) + tail % seg_.layout().ringBytes, sizeof(h));
      RecvSpec spec{peer, nullptr, 0, 0, {}};
      std::string mismatch = headerMismatch(op, spec, h);
      if (h.kind == static_cast<uint8_t>(op.kind) && h.seq == op.ctx.seq) {
        mismatch = "algorithm mismatch: the peer runs this op over the rings";
        if (op.kind == OpKind::kAllreduce) {
          mismatch += " (is RINGREDUCE_ALLREDUCE the same on every rank?)";
        }
      }
      what = mismatch + "; " + what;
    }
    plane_.failOp(op, members_.ranks[peer], what);
    __builtin_unreachable();  // failOp throws (a virtual call's [[noreturn]] is not seen)
  }

  // Waits until every peer's `which` flag reached `round` (what the peers
  // should be doing is `doing`, for the timeout's message).
  void awaitFlags(const OpInfo& op, Flag which, uint64_t round, const std::string& doing) {
    if (behind(which, round) == 0) return;
    PeerWait wait(plane_, seg_, rank_, members_.local, op);
    int left = size_;  // peers still behind after the last pass
    const auto ready = [&] {
      return firstSender() >= 0 || behind(which, round) == 0;
    };
    const auto waitingOn = [&](std::vector<int>& peers) {
      for (int q = 0; q < size_; ++q) {
        if (q != rank_ && flag(q, which).load(std::memory_order_acquire) < round) {
          peers.push_back(members_.ranks[q]);
        }
      }
    };
    const auto timedOut = [&] {
      int peer = -1;
      behind(which, round, &peer);
      plane_.failTimeout(op, peer >= 0 ? members_.ranks[peer] : -1,
                         "Timed out after " + std::to_string(op.timeout.count()) +
                             " ms waiting for the peer to " + doing +
                             " in the shared staging areas");
    };
    while (true) {
      const int sender = firstSender();
      const int now = behind(which, round);
      if (now == 0) return;
      if (sender >= 0) otherAlgorithm(op, sender);
      if (now < left) {
        left = now;
        wait.moved();
      } else {
        wait.idle(ready, waitingOn, timedOut);
      }
    }
  }

  ControlPlane& plane_;
  Segment& seg_;
  const Members& members_;
  const int rank_;  // local indices (the segment's)
  const int size_;
  uint64_t round_ = 0;  // the last round this rank began (flags start at 0)
  const RingStores stores_;
  RingStoreChooser chooser_;
  StoreUse& use_;  // the transport's count of the choices
  // The stores chosen last (chooseStores): for which kind of op and bytes,
  // whether they stream, whether (and since when) they are timed.
  uint8_t storesKind_ = 0;
  size_t storesBytes_ = 0;
  bool streams_ = false, timed_ = false;
  Clock::time_point storesStart_;
};

}  // namespace

std::unique_ptr<SharedBuffers> makeSharedBuffers(ControlPlane& plane, Segment& seg,
                                                 const Members& members, RingStores stores,
                                                 StoreUse& use) {
  return std::make_unique<ShmSharedBuffers>(plane, seg, members, stores, use);
}

}  // namespace shm
}  // namespace ringreduce
