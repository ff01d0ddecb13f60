// Shared-memory transport: the ring buffers and exchange() over them (see
// shm_transport.h for the design, shm_setup.cpp for the set-up).
#include "transport/shm/shm_transport.h"

#include <sys/mman.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <mutex>
#include <thread>

#include "transport/shm/ring_stores.h"
#include "transport/shm/shm_segment.h"

namespace ringreduce {
namespace shm {
namespace {

using SendState = SendProgress;
using RecvState = RecvProgress;

class ShmTransport : public Transport {
 public:
  ShmTransport(Mesh& mesh, Transport& p2p, const Topology& topology, Members members,
               void* base, const Layout& layout, RingStores stores)
      : mesh_(mesh), p2p_(p2p), topology_(topology), members_(std::move(members)),
        rank_(members_.me), size_(layout.size), base_(base), seg_(base, layout),
        ringBytes_(layout.ringBytes), stores_(stores) {
    shared_ = makeSharedBuffers(mesh_, seg_, members_, stores_, stagingUse_);
    // A failing op raises the flag before the mesh looks up and publishes
    // the error (about a second at worst), so no peer confirms it meanwhile.
    mesh_.setAbandonHook([this](const OpInfo& op) {
      raiseAbortFlag(seg_, op.ctx.seq);
      for (int r = 0; r < size_; ++r) seg_.ring(r);
    });
  }

  ~ShmTransport() override {
    mesh_.setAbandonHook(nullptr);
    close();
    shared_.reset();
    ::munmap(base_, seg_.layout().total);
  }

  void exchange(const OpInfo& op, std::vector<SendSpec>& sends,
                std::vector<RecvSpec>& recvs) override;

  void postSend(const OpInfo& op, int peer, uint64_t tag, const void* data, size_t bytes,
                P2PCallback done) override {
    p2p_.postSend(op, peer, tag, data, bytes, std::move(done));
  }
  void postRecv(const OpInfo& op, int peer, uint64_t tag, void* data, size_t bytes,
                P2PCallback done) override {
    p2p_.postRecv(op, peer, tag, data, bytes, std::move(done));
  }

  // Every rank that fails an op raises the segment's flag before anything
  // else, so a flag above this op's seq, or down, means no peer abandoned it.
  void confirm(const OpInfo& op) override {
    if (hooks().confirmDelayMs > 0) {
      std::this_thread::sleep_for(std::chrono::milliseconds(hooks().confirmDelayMs));
    }
    std::lock_guard<std::mutex> lock(confirmMu_);
    throwIfAborted(mesh_, seg_, op);
    confirmed_ = op.ctx.seq;
    if (timed_ && op.ctx.seq == opSeq_) {
      const double us = std::chrono::duration<double, std::micro>(Clock::now() - opStart_).count() +
                        hooks().storePenaltyUs[opStreams_].load(std::memory_order_relaxed);
      chooser_.record(opKind_, opBytes_, opStreams_, us);
    }
    timed_ = false;
  }

  // The flag names the first op this rank did not confirm: a peer still
  // checking an earlier op (its transfers done) must not fail it. Under
  // confirmMu_, so an abort on another thread (shutdown, abort()) lands
  // either before this rank's check of an op (which then fails here too) or
  // after it (the op stands everywhere): one op, one outcome.
  void abort(const std::string& reason) override {
    abandonUnconfirmed();
    mesh_.abort(reason);
  }
  // The flag alone (a routed transport raises it with its TCP frames).
  void abandonUnconfirmed() override {
    {
      std::lock_guard<std::mutex> lock(confirmMu_);
      raiseAbortFlag(seg_, confirmed_ + 1);
    }
    for (int r = 0; r < size_; ++r) seg_.ring(r);
  }
  std::string abortReason() const override { return mesh_.abortReason(); }
  void announceOp(const OpInfo& op) override { shm::announceOp(seg_, rank_, op); }
  std::string name() const override { return "shm"; }
  Mesh& mesh() override { return mesh_; }
  const Topology& topology() const override { return topology_; }
  void close() override {}  // the segment is unmapped by the destructor
  SharedBuffers* sharedBuffers() override { return shared_.get(); }
  RingStoreUse ringStoreUse(bool reset) override {
    RingStoreUse out;
    out.mode = stores_ == RingStores::kPlain       ? "plain"
               : stores_ == RingStores::kStreaming ? "streaming"
                                                   : "measured";
    out.rows = ringUse_.rows(reset);
    out.staging = stagingUse_.rows(reset);
    return out;
  }

 private:
  int local(int peer) const { return members_.local[peer]; }

  // At an op's first exchange, announces it (OpSlot) and starts its clock; at
  // the first exchange with a message that may stream, chooses the op's
  // stores (ring_stores.h).
  void chooseStores(const OpInfo& op, const std::vector<SendSpec>& sends) {
    if (op.ctx.seq != opSeq_) {
      shm::announceOp(seg_, rank_, op);
      opSeq_ = op.ctx.seq;
      opStart_ = Clock::now();
      opChosen_ = timed_ = opStreams_ = false;
    }
    if (opChosen_) return;
    size_t largest = 0;
    for (const auto& s : sends) largest = std::max(largest, s.bytes);
    if (largest < kStreamingMinBytes) return;
    opChosen_ = true;
    opKind_ = static_cast<uint8_t>(op.kind);
    opBytes_ = largest;
    timed_ = stores_ == RingStores::kMeasured;
    opStreams_ = stores_ == RingStores::kStreaming ||
                 (timed_ && chooser_.streaming(opKind_, largest));
    ringUse_.count(opKind_, largest, opStreams_);
  }

  // Copies as much of the message as the ring to s.peer has room for.
  bool progressSend(SendState& s) {
    const int to = local(s.spec->peer);
    RingControl& c = seg_.control(rank_, to);
    const uint64_t head = c.head.load(std::memory_order_relaxed);
    // The consumer's tail as last read: it only grows, so the room it leaves
    // is there still. Read again (a miss: the consumer's core wrote it) only
    // when the message does not fit, not once per message.
    uint64_t& tail = tailSeen_[to];
    uint64_t room = ringBytes_ - (head - tail);
    if (room < s.total() - s.done) {
      tail = c.tail.load(std::memory_order_acquire);
      room = ringBytes_ - (head - tail);
    }
    const size_t n = std::min<size_t>(room, s.total() - s.done);
    if (n == 0) return false;
    char* ringBase = seg_.ringData(rank_, to);
    const bool streaming = opStreams_ && s.spec->bytes >= kStreamingMinBytes;
    for (size_t written = 0; written < n;) {
      const size_t at = (head + written) % ringBytes_;
      size_t piece = std::min(n - written, ringBytes_ - at);
      const size_t off = s.done + written;
      const char* src;
      if (off < sizeof(WireHeader)) {
        piece = std::min(piece, sizeof(WireHeader) - off);
        src = reinterpret_cast<const char*>(&s.header) + off;
      } else {
        src = static_cast<const char*>(s.spec->data) + (off - sizeof(WireHeader));
      }
      copyIntoRing(ringBase + at, src, piece, streaming);
      written += piece;
    }
    c.head.store(head + n, std::memory_order_release);
    s.done += n;
    seg_.ring(to);
    return true;
  }

  // Takes what the ring from r.peer holds, up to the end of this message:
  // into the receive's buffer, or, once every send of the exchange is
  // complete (`sent`), straight from the ring to its consumer.
  bool progressRecv(const OpInfo& op, RecvState& r, bool sent) {
    const int from = local(r.spec->peer);
    RingControl& c = seg_.control(from, rank_);
    const uint64_t tail = c.tail.load(std::memory_order_relaxed);
    const uint64_t avail = c.head.load(std::memory_order_acquire) - tail;
    const size_t want = (sizeof(WireHeader) - r.headerDone) + (r.spec->bytes - r.dataDone);
    const size_t n = std::min<size_t>(avail, want);
    if (n == 0) return false;
    const char* ringBase = seg_.ringData(from, rank_);
    size_t taken = 0;
    while (taken < n) {
      const size_t at = (tail + taken) % ringBytes_;
      size_t piece = std::min(n - taken, ringBytes_ - at);
      if (r.headerDone < sizeof(WireHeader)) {
        piece = std::min(piece, sizeof(WireHeader) - r.headerDone);
        std::memcpy(reinterpret_cast<char*>(&r.header) + r.headerDone, ringBase + at, piece);
        r.headerDone += piece;
        taken += piece;
        if (r.headerDone == sizeof(WireHeader)) {
          c.tail.store(tail + taken, std::memory_order_release);
          std::string err = headerMismatch(op, *r.spec, r.header);
          if (!err.empty()) {
            mesh_.failOp(op, r.spec->peer, err + " (received 0 of " +
                                               std::to_string(r.spec->bytes) + " bytes)");
          }
        }
      } else if (sent && r.spec->consume) {
        if (r.handed < r.dataDone) {  // what arrived while sends were open, first
          r.spec->consume(static_cast<const char*>(r.spec->data) + r.handed, r.handed,
                          r.dataDone - r.handed);
        }
        r.spec->consume(ringBase + at, r.dataDone, piece);
        r.dataDone += piece;
        r.handed = r.dataDone;
        taken += piece;
      } else {
        std::memcpy(static_cast<char*>(r.spec->data) + r.dataDone, ringBase + at, piece);
        r.dataDone += piece;
        taken += piece;
      }
    }
    c.tail.store(tail + n, std::memory_order_release);
    seg_.ring(from);  // the producer may be waiting for room
    if (r.spec->onProgress && r.headerDone == sizeof(WireHeader) && r.dataDone > 0) {
      r.spec->onProgress(r.dataDone);
    }
    return true;
  }

  // Whether some open transfer could move now (after arming the doorbell).
  bool ready(const std::vector<SendState>& ss, const std::vector<RecvState>& rs) {
    for (auto& s : ss) {
      if (s.done < s.total()) {
        const RingControl& c = seg_.control(rank_, local(s.spec->peer));
        if (c.head.load() - c.tail.load() < ringBytes_) return true;
      }
    }
    for (auto& r : rs) {
      if (!r.finished()) {
        const RingControl& c = seg_.control(local(r.spec->peer), rank_);
        if (c.head.load() != c.tail.load()) return true;
      }
    }
    return false;
  }

  Mesh& mesh_;
  Transport& p2p_;
  const Topology topology_;
  const Members members_;
  const int rank_;  // local indices: the segment's (peers arrive as ranks of the group)
  const int size_;
  void* base_;
  Segment seg_;
  const size_t ringBytes_;
  const RingStores stores_;
  RingStoreChooser chooser_;
  // The op in flight (its seq), when its first exchange began, and its stores.
  uint64_t opSeq_ = 0;
  Clock::time_point opStart_;
  bool opChosen_ = false, opStreams_ = false, timed_ = false;  // timed_: its time goes to chooser_
  uint8_t opKind_ = 0;
  size_t opBytes_ = 0;
  // What the ops chose for their rings (by their largest message) and the
  // staging areas' choices (shared_ counts them): ringStoreUse.
  StoreUse ringUse_, stagingUse_;
  std::unique_ptr<SharedBuffers> shared_;
  // exchange()'s progress records, reused (no allocation per exchange): one
  // exchange at a time runs on a transport (its op's thread).
  std::vector<SendState> sendProgress_;
  std::vector<RecvState> recvProgress_;
  // Per local peer: the tail of the ring to it, as this rank last read it
  // (progressSend).
  std::vector<uint64_t> tailSeen_ = std::vector<uint64_t>(size_, 0);
  std::mutex confirmMu_;     // confirm() and abort() may run on different threads
  uint64_t confirmed_ = 0;  // guarded by confirmMu_: the seq of the last op confirmed here
};

void ShmTransport::exchange(const OpInfo& op, std::vector<SendSpec>& sends,
                            std::vector<RecvSpec>& recvs) {
  throwIfAborted(mesh_, seg_, op);
  chooseStores(op, sends);
  // The progress records of the previous exchange, their capacity kept.
  std::vector<SendState>& ss = sendProgress_;
  std::vector<RecvState>& rs = recvProgress_;
  ss.clear();
  rs.clear();
  startProgress(op, sends, recvs, &ss, &rs);
  PeerWait wait(mesh_, seg_, rank_, members_.local, op);
  const auto readyNow = [&] { return ready(ss, rs); };
  const auto open = [&](std::vector<int>& peers) {
    for (auto& x : ss) if (x.done < x.total()) peers.push_back(x.spec->peer);
    for (auto& x : rs) if (!x.finished()) peers.push_back(x.spec->peer);
  };
  const auto timedOut = [&] {
    auto [peer, what] = timeoutReport(op, ss, rs);
    mesh_.failTimeout(op, peer, what);
  };
  while (true) {
    bool progress = false, pending = false;
    for (auto& s : ss) {
      if (s.done < s.total()) {
        progress |= progressSend(s);
        pending |= s.done < s.total();
      }
    }
    const bool sent = !pending;
    for (auto& r : rs) {
      if (!r.finished()) {
        progress |= progressRecv(op, r, sent);
        pending |= !r.finished();
      }
    }
    if (!pending) return;
    if (progress) {
      wait.moved();
    } else {
      wait.idle(readyNow, open, timedOut);
    }
  }
}

}  // namespace

std::unique_ptr<Transport> makeShmTransport(Mesh& mesh, Transport& p2p, const Topology& topology,
                                            Members members, void* base, const Layout& layout,
                                            RingStores stores) {
  return std::make_unique<ShmTransport>(mesh, p2p, topology, std::move(members), base, layout,
                                        stores);
}

}  // namespace shm
}  // namespace ringreduce
