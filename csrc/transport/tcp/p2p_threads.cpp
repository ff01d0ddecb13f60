// P2PEngine's threads: one polls at a time while the others run completions;
// another is started when a callback blocks (beforeBlocking) or when every
// thread has sat in callbacks with ops pending (the watcher). The threads and
// the watcher's loop are common/callback_threads.h's; this file is the
// engine's side of them (CallbackThreads::Client).
#include "transport/tcp/p2p_engine.h"

#include <c10/util/Logging.h>

#include <algorithm>

#include "common/rescue.h"
#include "common/wait_hook.h"
#include "transport/tcp/socket.h"  // Clock

namespace ringreduce {
namespace tcp {

std::function<void()> P2PEngine::threadBodyLocked() {
  return [self = shared_from_this()] {
    blockingHook() = {[](void* engine, bool certain) {
                        static_cast<P2PEngine*>(engine)->beforeBlocking(certain);
                      },
                      self.get()};
    self->loop();
  };
}

std::shared_ptr<void> P2PEngine::watcherKeepLocked() {
  return shared_from_this();
}

void P2PEngine::enterCallbacksLocked() {
  if (threads_.enterCallbacksLocked()) busySince_ = Clock::now();
  // A thread that found completions before it polled (a receive matched to a
  // message read aside) runs them without having taken the turn: a thread
  // waiting for it polls meanwhile. Without this wake-up it slept on, and a
  // callback waiting for another receive waited for good (nobody polled, and
  // the deadlines are checked by the poller).
  if (!polling_ && waiting_ > 0) turnCv_.notify_one();
  if (threads_.allInCallbacksLocked() && pendingLocked()) threads_.armWatcherLocked();
}

bool P2PEngine::pendingLocked() const {
  if (!ready_.empty() || !recvs_.empty()) return true;
  return std::any_of(sends_.begin(), sends_.end(), [](const auto& q) { return !q.empty(); });
}

bool P2PEngine::retryWatcherLocked(const std::exception& err) {
  LOG(WARNING) << rankPrefix(rank_, size_) << " could not start the p2p watcher ("
               << err.what() << "); a callback blocked in Future.wait() may stall p2p ops";
  return false;
}

std::optional<std::chrono::milliseconds> P2PEngine::watchPeriodLocked() {
  return kRescueAfter;
}

CallbackThreads::Look P2PEngine::lookLocked(std::chrono::milliseconds) {
  // A thread is free, or nothing waits: armed again when not.
  if (!threads_.allInCallbacksLocked() || !pendingLocked()) return CallbackThreads::Look::kIdle;
  // Past the first few, a rescue waits for a longer stall (common/rescue.h):
  // callbacks that are only slow return within it and end the stall.
  if (Clock::now() - busySince_ < rescueStall(rescues_)) return CallbackThreads::Look::kAgain;
  return CallbackThreads::Look::kRescue;
}

void P2PEngine::rescueLocked(std::unique_lock<std::mutex>&) {
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

void P2PEngine::beforeBlocking(bool certain) {
  std::lock_guard<std::mutex> lock(mu_);
  // Callbacks that only may block (a taken Future's: torch's Future::wait()
  // has no hook) get one spare thread at most: no thread per completion
  // (Python callbacks waiting for the GIL all count as in callbacks). Deeper
  // levels of such waits are the watcher's (watch()).
  if (!certain && threads_.liveLocked() >= 2) return;
  // Also while stopping: the failures of the pending ops wait in ready_ for
  // a thread that is not blocked.
  ensureRunnerLocked(certain ? "a callback that waits" : "callbacks that may wait");
}

bool P2PEngine::ensureRunnerLocked(const char* why) {
  std::string error;
  switch (threads_.ensureRunnerLocked(&error)) {
    case CallbackThreads::Runner::kFree:
      // A thread waiting for its turn, or the one polling, runs what is ready.
      if (!ready_.empty()) {
        turnCv_.notify_all();
        wake();
      }
      return true;
    case CallbackThreads::Runner::kStarted:
      return true;
    case CallbackThreads::Runner::kNone:
      break;
  }
  LOG(WARNING) << rankPrefix(rank_, size_) << " could not start another p2p thread for "
               << why << " (" << error << "); the wait may time out";
  return false;
}
}  // namespace tcp
}  // namespace ringreduce
