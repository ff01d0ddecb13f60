// Point-to-point progress engine: one thread drives send/recv/recvAnysource on
// the p2p connections, independent of the collective order (as gloo does), so
// isend/irecv pairs never deadlock on socket buffers.
//
// The completions (and so the Works' Future callbacks) run on an engine
// thread. A Work.wait() in such a callback, with every engine thread in
// callbacks, starts one more thread (common/wait_hook.h), which polls while
// the first is blocked: a callback may wait for another p2p op. A wait that
// has no hook (torch's Future::wait()) is caught by a watcher thread: when
// every engine thread has been in callbacks for a while with ops pending, it
// starts one more (common/rescue.h: slow callbacks look the same, and the
// stall it waits for grows past the first few). The threads ("rr-p2p") and
// the watcher ("rr-p2p-watch") are a CallbackThreads
// (common/callback_threads.h), as the op executor's are; the engine is its
// Client. Each thread and the watcher owns the engine (a shared_ptr): a
// callback may destroy the process group, stopping the engine from its own
// thread, and drop the engine's last other owner.
#pragma once

#include <poll.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <functional>
#include <list>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "common/callback_threads.h"
#include "transport/transport.h"
#include "transport/wire.h"

namespace ringreduce {
namespace tcp {

class P2PEngine : public std::enable_shared_from_this<P2PEngine>,
                  private CallbackThreads::Client {
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
  // Ends the threads: joins them, or, called from a callback on one of them
  // (destroy_process_group), lets them all go; each ends once its callbacks
  // return. The pending ops fail on the threads (stop() and abort() queue
  // their failures in ready_), so a callback may wait for another's Work.
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
  // queues `held` (that error's failures), then the ready completions one at
  // a time, oldest first (while one blocks in a callback, another thread
  // takes the next); no lock held.
  void drain(std::string& fatalReason, std::vector<Completion>& held);
  // A wait on an engine thread is about to block (common/wait_hook.h): another
  // thread takes over, started if every one is running completions.
  void beforeBlocking(bool certain);
  // A thread starts running completions (or onFatal_); mu_ held. Arms the
  // watcher when that leaves no thread free while ops are pending.
  void enterCallbacksLocked();
  // Ops are posted, queued or in flight; mu_ held.
  bool pendingLocked() const;
  // CallbackThreads::Client, all with mu_ held (callback_threads.h):
  // a thread running loop() with the wait hook set, owning the engine;
  std::function<void()> threadBodyLocked() override;
  // the watcher owns the engine too;
  std::shared_ptr<void> watcherKeepLocked() override;
  // no watcher: a warning, and no second try;
  bool retryWatcherLocked(const std::exception& err) override;
  // it ends with the last thread, once stopping: the pending ops' failures
  // wait in ready_ for the threads, whose callbacks may block as before;
  bool watcherDoneLocked() const override { return stopping_ && threads_.liveLocked() == 0; }
  // one look per kRescueAfter;
  std::optional<std::chrono::milliseconds> watchPeriodLocked() override;
  // idle once a thread is free or no op is pending; a rescue once every
  // thread has been in callbacks (busySince_) for rescueStall(rescues_);
  CallbackThreads::Look lookLocked(std::chrono::milliseconds slept) override;
  // one more thread (counted in rescues_).
  void rescueLocked(std::unique_lock<std::mutex>& lock) override;
  // Wakes a thread for what is ready, or starts one if every thread is in
  // callbacks; false if none could start. mu_ held.
  bool ensureRunnerLocked(const char* why);
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
  void failAll(const std::string& reason, std::vector<Completion>& done);
  void fatal(const std::string& reason, std::vector<Completion>& done);
  void expire(std::vector<Completion>& done);
  void wake();

  const int rank_;
  const int size_;
  const std::vector<int> fds_;
  const std::vector<std::string> addrs_;
  int wakePipe_[2] = {-1, -1};

  // Locking: mu_ guards everything from sends_ to threads_. An engine
  // thread holds it while it reads and writes sockets (the helpers above that
  // take `done` run with it held) and drops it to poll and to run completions;
  // the callers' post/abort/stop take it briefly. Completions and onFatal_ run
  // outside it. The wake pipe is closed by the destructor, after every thread.
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
  // onFatal_ calls in progress: it works on the engine's owner (the mesh),
  // which stop() from a callback must not let go of meanwhile.
  size_t fatalInFlight_ = 0;
  std::condition_variable fatalCv_;
  bool polling_ = false;              // a thread polls (or reads and writes)
  size_t waiting_ = 0;                // threads waiting for their turn to poll
  std::condition_variable turnCv_;
  // The watcher's stall: since when every thread is in callbacks, and the
  // threads it started (or tried to).
  std::chrono::steady_clock::time_point busySince_;
  size_t rescues_ = 0;
  // The threads running loop() and the watcher: stop() lets them go when it
  // runs in a callback on one of them (letGoLocked), else joins them.
  CallbackThreads threads_{mu_, *this, "rr-p2p", "rr-p2p-watch"};
};

}  // namespace tcp
}  // namespace ringreduce
