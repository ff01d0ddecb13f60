// The group's Mesh (transport/mesh.h) over TCP: a full mesh of connections,
// two per pair of ranks (one for collectives, driven by the TCP data path,
// tcp_transport.h; one for point-to-point, driven by P2PEngine's thread), set
// up through the c10d::Store and authenticated with a per-group secret. The
// collective connections also carry failures for every data path: an abort
// shuts them down, so every peer sees EOF at once, whatever path its data
// takes.
#pragma once

#include <torch/csrc/distributed/c10d/Store.hpp>

#include <atomic>
#include <condition_variable>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "transport/mesh.h"
#include "transport/store_calls.h"
#include "transport/tcp/socket.h"
#include "transport/transport.h"
#include "transport/wait_policy.h"

namespace ringreduce {
namespace tcp {

class P2PEngine;
struct Hello;
struct PendingHello;

enum Channel : int32_t { kCollective = 0, kP2P = 1, kNumChannels = 2 };

class TcpMesh : public Mesh {
 public:
  // Blocks until connected to every peer or the timeout passes (then throws,
  // naming the ranks that never connected).
  TcpMesh(c10::intrusive_ptr<c10d::Store> store, int rank, int size,
          std::chrono::milliseconds timeout);
  ~TcpMesh() override;

  // Mesh (and its ControlPlane). Fails as a TCP transfer would (aborts, publishes, throws); a
  // timeout also works out, through the store, which rank the waits lead to.
  int rank() const override { return rank_; }
  int size() const override { return size_; }
  StoreCalls& store() override { return store_; }
  std::string storeKey(const std::string& name) const override { return storeBase_ + name; }
  [[noreturn]] void failOp(const OpInfo& op, int peer, const std::string& what) override {
    fail(op, peer, what, false);
  }
  [[noreturn]] void failTimeout(const OpInfo& op, int peer, const std::string& what) override {
    fail(op, peer, what, true);
  }
  void awaitPeerError() override;
  // The first of `peers` whose idle collective connection became readable
  // (it closed: the peer exited or aborted), or -1. Never blocks.
  int closedPeer(const std::vector<int>& peers) override;
  // The peer's collective connection is at its end (not merely readable).
  bool hungUp(int peer) override;
  void abort(const std::string& reason) override;
  void setAbandonHook(std::function<void(const OpInfo&)> hook) override;
  void setAbortHook(std::function<void()> hook) override;
  bool aborted() const override { return aborted_; }
  Failure failure() const override { return static_cast<Failure>(failure_.load()); }
  std::string abortReason() const override;
  void publishRejected(uint64_t seq, const std::string& message) override;
  void lookWhileIdle(const OpInfo& op, std::chrono::steady_clock::duration idle, bool acrossHosts,
                     const std::vector<int>& waitingOn,
                     const std::vector<int>& midMessage) override;
  WaitPolicy& waitPolicy() override { return wait_; }
  std::string listenAddress() const override;
  // Why the most recent refused connections were refused (at most
  // kKeptRefusals; logged to stderr at a limited rate), and how many in all.
  std::vector<std::string> refusedConnections() const override;
  uint64_t refusedCount() const override;
  static constexpr size_t kKeptRefusals = 64;

  // For the TCP data path (tcp_transport.cpp).
  //
  // The collective connection to `peer` (-1 for this rank). Fixed between
  // construction and close().
  int collectiveFd(int peer) const { return fds_[kCollective][peer]; }
  // Writes to the collective connections go under this lock, with
  // setPartial(peer, true) while a message to peer is half written, so that
  // abandon()'s abort frames (possibly from another thread: a routed
  // transport's mixed exchange) never land inside a message.
  std::mutex& sendMutex() { return sendMu_; }
  void setPartial(int peer, bool partial) { partial_[peer] = partial ? 1 : 0; }
  // failOp/failTimeout, not writing abort frames to the peers in
  // `midMessage` (this thread stopped writing to them mid-message).
  // `noteRejection`: add a peer's rejection of the op at the call, if any
  // (rejectionNote).
  [[noreturn]] void fail(const OpInfo& op, int peer, const std::string& what, bool timedOut,
                         const std::vector<int>& midMessage = {}, bool noteRejection = true);
  P2PEngine& p2p() { return *p2p_; }
  // Abort frames for collective op #seq to every peer at a message boundary
  // (the transport's abort() outside fail(): shutdown with an op running,
  // abort(), an error inside an op), so a peer that finished its transfers
  // fails that op in confirm() as this rank does.
  void abandonSeq(uint64_t seq, const std::vector<int>& midMessage = {});
  // The op this rank last wrote abort frames for (0: none): it and every
  // later op fail here too (confirm), as they do at the peers.
  uint64_t abandonedSeq() const { return abandonedSeq_.load(); }
  // The point-to-point engine's fatal error: the abort hook, then abort().
  void abortFromEngine(const std::string& reason);
  // Stops the threads and closes every connection (idempotent).
  void close();

 private:
  // lookWhileIdle's two looks, each on its own cadence (lookDue).
  void lookForRejection(const OpInfo& op, std::chrono::steady_clock::duration idle);
  void lookForOtherOp(const OpInfo& op, std::chrono::steady_clock::duration idle,
                      const std::vector<int>& waitingOn, const std::vector<int>& midMessage);
  // rendezvous.cpp: the mesh and the accept thread.
  void connectMesh(std::chrono::milliseconds timeout);
  void connectToLower(int peer, Clock::time_point deadline);
  void acceptLoop();
  void readHello(PendingHello& pending);
  void refuse(PendingHello& pending, const std::string& why);
  std::string checkHello(const Hello& hello) const;
  void logRefusal(const std::string& from, const std::string& why);

  // tcp_mesh.cpp: failure paths.
  // " first error in the group: ..." or why it is unknown; "" when this rank's
  // error is the first.
  // *storeAnswered (if given): whether the store answered the lookup.
  // `remote`: the group's first error is another rank's.
  std::string groupCause(const std::string& mine, bool* storeAnswered = nullptr,
                         bool* remote = nullptr);
  // After a timeout waiting for `peer`: follows the ranks' published waits to
  // the rank that made no progress ("; rank 2 waits for rank 0; rank 0 made no
  // progress ..."), or "" when the store cannot tell.
  std::string waitChain(const OpInfo& op, int peer);
  // The store key of a rejection of collective #seq, and what a failure of
  // `op` adds when a rank rejected it ("; rank 1 rejected this op at the
  // call: ..."; "" when none did or the store does not tell in time).
  std::string rejectedKey(uint64_t seq) const;
  std::string rejectionNote(const OpInfo& op);
  static constexpr uint64_t kRejectedKeys = 64;
  std::atomic<int64_t> rejectionLookedAt_{0};  // steady clock ticks
  std::atomic<int64_t> otherOpLookedAt_{0};    // steady clock ticks
  std::atomic<uint64_t> announcedSeq_{0};      // the last op this rank announced
  std::atomic<size_t> otherOpTurn_{0};         // which of the waited-for peers to read next
  // Writes an abort frame to every peer whose collective stream is at a
  // message boundary (not in `midMessage`), so a late peer that completes
  // this op's transfers still fails it in confirm().
  void abandon(const OpInfo& op, const std::vector<int>& midMessage);
  std::atomic<uint64_t> abandonedSeq_{0};  // the last op frames were written for

  StoreCalls store_;
  const int rank_;
  const int size_;
  std::string storeBase_;
  std::string secret_;  // hex, 64 chars
  int listenFd_ = -1;
  int wakePipe_[2] = {-1, -1};  // written by close() to stop the accept thread
  SockAddr bound_{};

  // Locking: mu_ guards fds_ and peerAddr_ while they change: set up by
  // connect() and the accept thread (connected_ waits on mu_), shut down by
  // abort(), closed and reset by close() after the threads are joined. Between
  // connect() returning and close(), the descriptors do not change, so the op
  // thread and the p2p engine read them without the lock.
  mutable std::mutex mu_;
  std::condition_variable connected_;
  std::vector<int> fds_[kNumChannels];  // per channel, per peer; -1 for self
  std::vector<std::string> peerAddr_;   // "ip:port" of each peer's listener
  std::thread acceptThread_;
  // Made by connect(); close() stops its thread and fails what is pending or
  // posted later, but the engine lives as long as the mesh (p2p() stays valid).
  std::shared_ptr<P2PEngine> p2p_;  // its threads own it too

  // See sendMutex(). Taken after mu_ where both are held.
  std::mutex sendMu_;
  std::vector<uint8_t> partial_;  // per peer, guarded by sendMu_

  WaitPolicy wait_;  // spin, yield, sleep: adapts to the machine (thread-safe)
  std::atomic<bool> aborted_{false};
  std::atomic<int> failure_{0};  // a Failure, set once by fail()
  std::mutex hookMu_;
  std::function<void(const OpInfo&)> abandonHook_;  // guarded by hookMu_
  // Its own lock: the hook takes the transport's confirm lock, under which
  // confirm() may fail an op and so take hookMu_.
  std::mutex abortHookMu_;
  std::function<void()> abortHook_;  // guarded by abortHookMu_
  std::atomic<bool> closed_{false};
  std::string abortReason_;  // guarded by mu_
  // Refusals: the last kKeptRefusals lines, the count, and the log's rate
  // limit. All guarded by mu_.
  std::deque<std::string> refused_;
  uint64_t refusedCount_ = 0;
  uint64_t refusedLogged_ = 0;  // count when the last line was printed
  std::chrono::steady_clock::time_point refusedLogAt_{};
};

}  // namespace tcp
}  // namespace ringreduce
