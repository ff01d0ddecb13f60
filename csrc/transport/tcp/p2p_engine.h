// Point-to-point progress engine: one thread ("rr-p2p") drives
// send/recv/recvAnysource on the p2p connections, independent of the
// collective order (as gloo does), so isend/irecv pairs never deadlock on
// socket buffers.
//
// The thread runs each op's completion callback once it is done, outside the
// engine's lock. Those callbacks must not block: the backend's hand the Work
// to its op executor (backend/op_executor.h), which settles it and runs its
// Future's callbacks on another thread (also once it stops), so a callback
// that waits for another p2p op never holds up the thread that completes it.
// A send the socket takes at once completes on the posting thread instead. The thread owns the
// engine (a shared_ptr): the last owner may go while it runs.
#pragma once

#include <poll.h>
#include <sys/types.h>

#include <atomic>
#include <chrono>
#include <deque>
#include <functional>
#include <list>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "transport/transport.h"
#include "transport/wire.h"

namespace ringreduce {
namespace tcp {

class P2PEngine : public std::enable_shared_from_this<P2PEngine> {
  struct Private {};

 public:
  // fds: one connected socket per peer (-1 for self); addrs: for messages.
  // onFatal runs (on the engine thread, no lock held) when a connection breaks,
  // so the owner can abort the whole transport. explain(reason) returns what
  // to append to a broken connection's error (the group's first error, looked
  // up with a short deadline), so a rank far from the failure names it. Both
  // run only until stop(): the owner may be gone after it.
  static std::shared_ptr<P2PEngine> start(int rank, int size, std::vector<int> fds,
                                          std::vector<std::string> addrs,
                                          std::function<void(const std::string&)> onFatal,
                                          std::function<std::string(const std::string&)> explain);
  P2PEngine(Private, int rank, int size, std::vector<int> fds, std::vector<std::string> addrs,
            std::function<void(const std::string&)> onFatal,
            std::function<std::string(const std::string&)> explain);
  ~P2PEngine();

  void postSend(const OpInfo& op, int peer, uint64_t tag, const void* data, size_t bytes,
                P2PCallback done);
  void postRecv(const OpInfo& op, int peer, uint64_t tag, void* data, size_t bytes,
                P2PCallback done);
  // Fails everything pending and later with `reason`.
  void abort(const std::string& reason);
  // Fails the pending ops and ends the thread: joins it, or, called on it
  // (a completion callback, or onFatal, that drops the owner's last
  // reference), lets it go; it ends once it has run the failures.
  void stop();

 private:
  struct Send {
    OpInfo op;
    WireHeader header;
    const char* data;
    size_t done;  // over header + payload
    P2PCallback cb;
  };
  struct Recv {
    OpInfo op;
    int peer;  // -1: any source
    uint64_t tag;
    char* data;
    size_t bytes;
    P2PCallback cb;
    bool claimed = false;  // an incoming message is being read into it
  };
  // The message being read from one peer.
  struct Incoming {
    WireHeader header{};
    size_t headerDone = 0;
    size_t dataDone = 0;
    std::list<Recv>::iterator match;
    bool matched = false;
    bool draining = false;  // the matched recv failed: discard the payload
    // No receive takes this message, but one for another tag from its sender
    // waits behind it: read it aside (messages of different tags overtake,
    // as in MPI and gloo) instead of holding the connection up.
    bool buffering = false;
    std::vector<char> aside;
  };
  struct Buffered {
    WireHeader header;
    std::vector<char> payload;
  };
  using Completion = std::pair<P2PCallback, std::pair<int, std::exception_ptr>>;

  void loop();
  // loop(): matches what is read aside and headers read whole, fails ops for
  // peers that left, and fills the poll set (the peers with something to
  // send or a receive that could take their next message); returns poll()'s
  // timeout in ms, up to the earliest op deadline (-1: none). mu_ held.
  int pollSetLocked(std::vector<pollfd>& pfds, std::vector<int>& peers,
                    std::vector<Completion>& done);
  // stop(), before it fails the pending ops: a leave message to each peer
  // with no message half sent. mu_ held.
  void sayFarewellLocked();
  // Runs onFatal_ with `fatalReason` (unless stop() came meanwhile) and then
  // `held` (that error's failures), then the ready completions, oldest
  // first; no lock held.
  void drain(std::string& fatalReason, std::vector<Completion>& held);
  bool wantsRead(int peer) const;
  // Fails what can no longer complete because peers left the group cleanly:
  // receives naming one, receives from any source once every peer left,
  // sends to one. Called after matchBuffered (a message read aside before the
  // peer left still goes to its receive). mu_ held.
  void failForLeftLocked(std::vector<Completion>& done);
  void matchHeader(int peer, std::vector<Completion>& done);
  // Hands messages read aside to the receives posted for them, oldest first.
  void matchBuffered(std::vector<Completion>& done);
  // The error for a message of `h` taken by receive `r`, or "" when they agree.
  static std::string disagreement(const Recv& r, const WireHeader& h);
  void readFrom(int peer, std::vector<Completion>& done);
  void writeTo(int peer, std::vector<Completion>& done);
  // One sendmsg of the rest of `s` (header, then payload), non-blocking.
  ssize_t sendMore(int peer, const Send& s);
  // postSend()'s inline run: the message just posted is the only one to
  // `peer`; writes what the socket takes now, on the posting thread. True
  // when all of it went (the caller completes it); errors are left to the
  // thread, which meets them again. mu_ held.
  bool sendNowLocked(int peer);
  void failAll(const std::string& reason, std::vector<Completion>& done);
  void fatal(const std::string& reason, std::vector<Completion>& done);
  void expire(std::vector<Completion>& done);
  void wake();

  const int rank_;
  const int size_;
  const std::vector<int> fds_;
  const std::vector<std::string> addrs_;
  int wakePipe_[2] = {-1, -1};

  // Locking: mu_ guards everything from sends_ to thread_. The engine's
  // thread holds it while it reads and writes sockets (the helpers above that
  // take `done` run with it held) and drops it to poll and to run completions;
  // the callers' post/abort/stop take it briefly (postSend's inline run
  // makes one non-blocking sendmsg under it). Completions and onFatal_ run
  // outside it. The wake pipe is closed by the destructor, after the thread.
  std::mutex mu_;
  std::vector<std::deque<Send>> sends_;  // per peer, in post order
  std::list<Recv> recvs_;                // in post order
  std::vector<Incoming> incoming_;       // per peer
  std::vector<std::deque<Buffered>> buffered_;  // per peer, read aside, in arrival order
  std::vector<uint64_t> sendSeq_;        // per peer message index
  // Per peer: its farewell (kLeave) was read; its connection is read no more,
  // so its end is not an error (a crash's end, without one, still is).
  std::vector<char> left_;
  std::string failed_;                   // set once aborted
  std::string fatal_;                    // to report through onFatal_, outside the lock
  std::function<void(const std::string&)> onFatal_;
  std::function<std::string(const std::string&)> explain_;
  bool stopping_ = false;
  std::deque<Completion> ready_;      // collected, not yet run (drain())
  // The thread running loop(); stop() joins it or lets it go.
  std::thread thread_;
};

}  // namespace tcp
}  // namespace ringreduce
