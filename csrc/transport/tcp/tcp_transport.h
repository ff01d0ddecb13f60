// TCP transport: a full mesh of connections, two per pair of ranks (one for
// collectives, driven synchronously by exchange() on the backend's worker
// thread; one for point-to-point, driven by P2PEngine's thread), set up through
// the c10d::Store and authenticated with a per-group secret.
#pragma once

#include <torch/csrc/distributed/c10d/Store.hpp>

#include <poll.h>

#include <atomic>
#include <condition_variable>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "transport/tcp/socket.h"
#include "transport/transport.h"

namespace ringreduce {
namespace tcp {

class P2PEngine;
struct Hello;
struct PendingHello;

enum Channel : int32_t { kCollective = 0, kP2P = 1, kNumChannels = 2 };

class TcpTransport : public Transport {
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
  void abort(const std::string& reason) override;
  std::string abortReason() const override;
  void close() override;

  // For a transport layered over this one (shared memory), which keeps the
  // collective connections idle and uses them only to learn of failures:
  // fails `op` as a TCP transfer would (aborts, publishes, throws).
  [[noreturn]] void failOp(const OpInfo& op, int peer, const std::string& what) {
    fail(op, peer, what);
  }
  // The first of `peers` whose idle collective connection became readable
  // (it closed: the peer exited or aborted), or -1. Never blocks.
  int closedPeer(const std::vector<int>& peers);
  // This group's store key for `name` (keys of a re-created group differ).
  std::string storeKey(const std::string& name) const { return storeBase_ + name; }
  int64_t spinUs() const { return spinUs_; }
  int64_t yieldUs() const { return yieldUs_; }
  bool aborted() const { return aborted_; }

  // "ip:port" this rank accepts connections on (empty for a group of one).
  std::string listenAddress() const;
  // Why each refused connection was refused (also logged to stderr).
  std::vector<std::string> refusedConnections() const;

 private:
  // rendezvous.cpp: the mesh and the accept thread.
  void connectMesh(std::chrono::milliseconds timeout);
  void connectToLower(int peer, Clock::time_point deadline);
  void acceptLoop();
  void readHello(PendingHello& pending);
  void refuse(PendingHello& pending, const std::string& why);
  std::string checkHello(const Hello& hello) const;
  void logRefusal(const std::string& from, const std::string& why) const;

  int pollWithSpin(std::vector<pollfd>& pfds, int timeoutMs);

  // tcp_transport.cpp: failure paths.
  [[noreturn]] void fail(const OpInfo& op, int peer, const std::string& what);
  std::string groupCause() const;

  c10::intrusive_ptr<c10d::Store> store_;
  const int rank_;
  const int size_;
  std::string storeBase_;
  std::string secret_;  // hex, 64 chars
  int listenFd_ = -1;
  int wakePipe_[2] = {-1, -1};  // written by close() to stop the accept thread
  sockaddr_in bound_{};

  mutable std::mutex mu_;
  std::condition_variable connected_;
  std::vector<int> fds_[kNumChannels];  // per channel, per peer; -1 for self
  std::vector<std::string> peerAddr_;   // "ip:port" of each peer's listener
  std::thread acceptThread_;
  std::unique_ptr<P2PEngine> p2p_;

  int64_t spinUs_ = 0;   // busy-poll budget before sleeping (RINGREDUCE_SPIN_US)
  int64_t yieldUs_ = 0;  // then poll-and-yield budget (RINGREDUCE_YIELD_US)
  std::atomic<bool> aborted_{false};
  std::atomic<bool> closed_{false};
  std::string abortReason_;  // guarded by mu_
  mutable std::vector<std::string> refused_;  // guarded by mu_
};

}  // namespace tcp
}  // namespace ringreduce
