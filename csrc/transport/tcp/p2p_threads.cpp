// P2PEngine's threads: one polls at a time while the others run completions;
// another is started when a callback blocks (beforeBlocking) or when every
// thread has sat in callbacks with ops pending (the watcher).
#include "transport/tcp/p2p_engine.h"

#include <c10/util/Logging.h>

#include <algorithm>

#include "common/rescue.h"
#include "common/thread_name.h"
#include "common/wait_hook.h"
#include "transport/tcp/socket.h"  // Clock

namespace ringreduce {
namespace tcp {

void P2PEngine::spawnLocked() {
  threads_.emplace_back([self = shared_from_this()] {
    nameThisThread("rr-p2p");
    blockingHook() = {[](void* engine, bool certain) {
                        static_cast<P2PEngine*>(engine)->beforeBlocking(certain);
                      },
                      self.get()};
    self->loop();
  });
  ++live_;
  // Started after stop() let the threads go: nobody will join it.
  if (detachNew_) {
    threads_.back().detach();
    threads_.pop_back();
  }
}

void P2PEngine::enterCallbacksLocked() {
  if (++inCallbacks_ == live_) busySince_ = Clock::now();
  // A thread that found completions before it polled (a receive matched to a
  // message read aside) runs them without having taken the turn: a thread
  // waiting for it polls meanwhile. Without this wake-up it slept on, and a
  // callback waiting for another receive waited for good (nobody polled, and
  // the deadlines are checked by the poller).
  if (!polling_ && waiting_ > 0) turnCv_.notify_one();
  if (inCallbacks_ >= live_ && pendingLocked()) armWatcherLocked();
}

bool P2PEngine::pendingLocked() const {
  if (!ready_.empty() || !recvs_.empty()) return true;
  return std::any_of(sends_.begin(), sends_.end(), [](const auto& q) { return !q.empty(); });
}

void P2PEngine::armWatcherLocked() {
  if (watchArmed_ || watcherFailed_ || (stopping_ && live_ == 0)) return;
  watchArmed_ = true;
  if (watcherStarted_) {
    watchCv_.notify_one();
    return;
  }
  try {
    watcher_ = std::thread([self = shared_from_this()] { self->watch(); });
    watcherStarted_ = true;
    // Started after stop() let the threads go: nobody will join it.
    if (detachNew_) watcher_.detach();
  } catch (const std::exception& err) {
    watcherFailed_ = true;
    watchArmed_ = false;
    LOG(WARNING) << rankPrefix(rank_, size_) << " could not start the p2p watcher ("
                 << err.what() << "); a callback blocked in Future.wait() may stall p2p ops";
  }
}

void P2PEngine::watch() {
  nameThisThread("rr-p2p-watch");
  std::unique_lock<std::mutex> lock(mu_);
  // It stays while stopping: the pending ops' failures wait in ready_ for the
  // engine's threads, whose callbacks may block as before.
  const auto gone = [this] { return stopping_ && live_ == 0; };
  while (true) {
    watchCv_.wait(lock, [&] { return watchArmed_ || gone(); });
    // Not woken early by progress: one look per kRescueAfter at most.
    watchCv_.wait_for(lock, kRescueAfter, gone);
    if (gone()) return;
    if (inCallbacks_ < live_ || !pendingLocked()) {
      watchArmed_ = false;  // a thread is free, or nothing waits: armed again when not
      continue;
    }
    // Past the first few, a rescue waits for a longer stall (common/rescue.h):
    // callbacks that are only slow return within it and end the stall.
    if (Clock::now() - busySince_ < rescueStall(rescues_)) continue;  // look again
    // Every thread has sat in one callback that long with ops pending:
    // blocked (in a wait without a hook, or a late-taken Future's callback)
    // or slow. Another thread runs what is ready and polls meanwhile.
    if (++rescues_ == kFastRescues + 1) {
      LOG(WARNING) << rankPrefix(rank_, size_) << " p2p callbacks have held every engine "
                   << "thread " << kFastRescues + 1 << " times (blocked, e.g. in "
                   << "Future.wait(), or slow); each further thread starts after a longer stall";
    }
    ensureRunnerLocked("callbacks that do not return");
  }
}

void P2PEngine::beforeBlocking(bool certain) {
  std::lock_guard<std::mutex> lock(mu_);
  // Callbacks that only may block (a taken Future's: torch's Future::wait()
  // has no hook) get one spare thread at most: no thread per completion
  // (Python callbacks waiting for the GIL all count as in callbacks). Deeper
  // levels of such waits are the watcher's (watch()).
  if (!certain && live_ >= 2) return;
  // Also while stopping: the failures of the pending ops wait in ready_ for
  // a thread that is not blocked.
  ensureRunnerLocked(certain ? "a callback that waits" : "callbacks that may wait");
}

bool P2PEngine::ensureRunnerLocked(const char* why) {
  if (inCallbacks_ < live_) {
    // A thread waiting for its turn, or the one polling, runs what is ready.
    if (!ready_.empty()) {
      turnCv_.notify_all();
      wake();
    }
    return true;
  }
  try {
    spawnLocked();
    return true;
  } catch (const std::exception& err) {
    LOG(WARNING) << rankPrefix(rank_, size_) << " could not start another p2p thread for "
                 << why << " (" << err.what() << "); the wait may time out";
    return false;
  }
}
}  // namespace tcp
}  // namespace ringreduce
