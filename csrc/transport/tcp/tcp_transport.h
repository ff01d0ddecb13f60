// TCP transport: a full mesh of connections, two per pair of ranks (one for
// collectives, driven synchronously by exchange() on the backend's worker
// thread; one for point-to-point, driven by P2PEngine's thread), set up through
// the c10d::Store and authenticated with a per-group secret.
#pragma once

#include <torch/csrc/distributed/c10d/Store.hpp>

#include <poll.h>

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

// The TCP data path and the group's Mesh (transport/mesh.h) in one: the
// collective connections carry data on TCP and carry failures for every path.
class TcpTransport : public Transport, public Mesh {
 public:
  // Blocks until connected to every peer or the timeout passes (then throws,
  // naming the ranks that never connected).
  TcpTransport(c10::intrusive_ptr<c10d::Store> store, int rank, int size,
               std::chrono::milliseconds timeout);
  ~TcpTransport() override;

  void exchange(const OpInfo& op, std::vector<SendSpec>& sends,
                std::vector<RecvSpec>& recvs) override;
  void postSend(const OpInfo& op, int peer, uint64_t tag, const void* data, size_t bytes,
                P2PCallback done) override;
  void postRecv(const OpInfo& op, int peer, uint64_t tag, void* data, size_t bytes,
                P2PCallback done) override;
  void confirm(const OpInfo& op) override;
  void abort(const std::string& reason) override;
  std::string abortReason() const override;
  std::string name() const override { return "tcp"; }
  void close() override;

  Mesh& mesh() override { return *this; }
  // One host until the factory, which learns the layout, says otherwise.
  const Topology& topology() const override { return topology_; }
  void setTopology(Topology topology) { topology_ = std::move(topology); }

  // Mesh (transport/mesh.h). Fails as a TCP transfer would (aborts,
  // publishes, throws); a timeout also works out, through the store, which
  // rank the waits lead to.
  int rank() const override { return rank_; }
  int size() const override { return size_; }
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
  std::string storeKey(const std::string& name) const override { return storeBase_ + name; }
  StoreCalls& store() override { return store_; }
  WaitPolicy& waitPolicy() override { return wait_; }
  bool aborted() const override { return aborted_; }
  std::string listenAddress() const override;
  // Why the most recent refused connections were refused (at most
  // kKeptRefusals; logged to stderr at a limited rate), and how many in all.
  std::vector<std::string> refusedConnections() const override;
  uint64_t refusedCount() const override;
  static constexpr size_t kKeptRefusals = 64;

 private:
  // rendezvous.cpp: the mesh and the accept thread.
  void connectMesh(std::chrono::milliseconds timeout);
  void connectToLower(int peer, Clock::time_point deadline);
  void acceptLoop();
  void readHello(PendingHello& pending);
  void refuse(PendingHello& pending, const std::string& why);
  std::string checkHello(const Hello& hello) const;
  void logRefusal(const std::string& from, const std::string& why);

  int pollWithSpin(std::vector<pollfd>& pfds, int timeoutMs);

  // tcp_transport.cpp: failure paths.
  [[noreturn]] void fail(const OpInfo& op, int peer, const std::string& what, bool timedOut,
                         const std::vector<int>& midMessage = {});
  // " first error in the group: ..." or why it is unknown; "" when this rank's
  // error is the first.
  std::string groupCause(const std::string& mine);
  // After a timeout waiting for `peer`: follows the ranks' published waits to
  // the rank that made no progress ("; rank 2 waits for rank 0; rank 0 made no
  // progress ..."), or "" when the store cannot tell.
  std::string waitChain(const OpInfo& op, int peer);
  // Writes an abort frame to every peer whose collective stream is at a
  // message boundary (not in `midMessage`), so a late peer that completes
  // this op's transfers still fails it in confirm().
  void abandon(const OpInfo& op, const std::vector<int>& midMessage);

  StoreCalls store_;
  const int rank_;
  const int size_;
  std::string storeBase_;
  Topology topology_;
  std::string secret_;  // hex, 64 chars
  int listenFd_ = -1;
  int wakePipe_[2] = {-1, -1};  // written by close() to stop the accept thread
  sockaddr_in bound_{};

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
  std::unique_ptr<P2PEngine> p2p_;

  // Sends on the collective connections and abandon()'s abort frames, which
  // may come from another thread (a routed transport's mixed exchange): under
  // sendMu_, partial_[peer] says a message to peer is half written, so no
  // frame may go in between. Taken after mu_ where both are held.
  std::mutex sendMu_;
  std::vector<uint8_t> partial_;  // per peer, guarded by sendMu_

  WaitPolicy wait_;  // spin, yield, sleep: adapts to the machine (thread-safe)
  std::atomic<bool> aborted_{false};
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
