// CallbackThreads: the threads on which one owner runs user callbacks (the op
// executor's workers), and the watcher that starts another when callbacks
// hold them all.
//
// A Work's Future callbacks run on the thread that completes it, and one may
// wait for work that only another of these threads does. So an owner starts
// with one thread and gets another (ensureRunnerLocked) when every one is
// inside callbacks: where a wait is sure to block (the owner's own hook), and,
// for a wait no hook reaches (torch's Future::wait()), when the watcher finds
// the work held by callbacks for the owner's stall (common/rescue.h).
//
// The owner supplies what differs (Client): its threads' body, whether there
// is work to watch and whether it is stalled, and what a rescue does. This
// class keeps the threads (started, live, in callbacks), the watcher's thread
// (started the first time it is armed, armed or idle, one look per period,
// never woken early by progress) and the choice between a free thread and a
// new one.
//
// Locking: the owner's mutex (`mu`, given to the constructor) guards every
// field here. Every method named ...Locked must be called with it held, and
// the watcher calls the Client's hooks with it held; endAll() and
// wakeWatcher() take no lock from their caller.
//
// Lifetimes: each thread holds what its body captured (Client::threadBodyLocked)
// and the watcher what Client::watcherKeepLocked gave (the owner, strongly or
// weakly, so this object too) until it returns: a stop may let them go instead
// of joining them (from a callback on one of them, a join could wait for the
// calling thread). After letGoLocked() every thread started is detached at
// once, since nobody will join it.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

namespace ringreduce {

class CallbackThreads {
 public:
  // What the watcher does after a look (Client::lookLocked).
  enum class Look {
    kAgain,   // look again after the next period
    kIdle,    // nothing to watch: sleep until armWatcherLocked()
    kRescue,  // callbacks held the work for the stall: Client::rescueLocked()
  };
  // What ensureRunnerLocked() found.
  enum class Runner {
    kFree,     // a thread is not in callbacks: the owner lets it run the work
    kStarted,  // every one was: another was started
    kNone,     // every one was, and no thread could be started
  };

  // The owner's part. Every hook is called with the owner's mutex held, and
  // must not take it again.
  class Client {
   public:
    // A new thread's body, run with no lock held once the thread is named;
    // it holds what it captures (the owner) until it returns. Called on the
    // thread that starts it (spawnLocked).
    virtual std::function<void()> threadBodyLocked() = 0;
    // What the watcher's thread holds until it returns (the owner, which
    // holds this object). Called on the thread that arms it first.
    virtual std::shared_ptr<void> watcherKeepLocked() = 0;
    // The watcher's thread could not start (`err`), on the thread arming it:
    // whether the next arming tries again.
    virtual bool retryWatcherLocked(const std::exception& err) = 0;
    // The hooks below run on the watcher's thread.
    // It returns once this holds (looked at after every wake-up and sleep);
    // armWatcherLocked() does nothing then.
    virtual bool watcherDoneLocked() const = 0;
    // Before each sleep: how long to sleep before the next look, or nullopt
    // when there is nothing to watch (the watcher idles until armed again).
    virtual std::optional<std::chrono::milliseconds> watchPeriodLocked() = 0;
    // After a sleep of `slept` (that period): whether callbacks held the work
    // for the owner's stall (common/rescue.h).
    virtual Look lookLocked(std::chrono::milliseconds slept) = 0;
    // Look::kRescue: gets the work going, through ensureRunnerLocked(). May
    // unlock `lock` meanwhile; holds it again when it returns.
    virtual void rescueLocked(std::unique_lock<std::mutex>& lock) = 0;

   protected:
    ~Client() = default;
  };

  // `threadName`, `watcherName`: string literals (common/thread_name.h).
  CallbackThreads(std::mutex& mu, Client& client, const char* threadName,
                  const char* watcherName)
      : mu_(mu), client_(client), threadName_(threadName), watcherName_(watcherName) {}
  CallbackThreads(const CallbackThreads&) = delete;
  CallbackThreads& operator=(const CallbackThreads&) = delete;

  // Starts a thread running Client::threadBodyLocked() and counts it live.
  // Throws what std::thread throws when no thread can be had. mu held.
  void spawnLocked();
  // A thread free to take work: kFree when one is not inside callbacks, else
  // one more is started (kStarted), or none could be (kNone; `error`, when
  // given, says why). mu held.
  Runner ensureRunnerLocked(std::string* error = nullptr);

  // A thread starts (or ends) running callbacks; enter returns whether every
  // live thread is in callbacks now. mu held.
  bool enterCallbacksLocked() {
    ++inCallbacks_;
    return allInCallbacksLocked();
  }
  void leaveCallbacksLocked() { --inCallbacks_; }
  // A thread is leaving its body for good (its owner counts it out in the
  // same hold of mu as its last look at the work). mu held.
  void threadLeftLocked() { --live_; }
  // Threads started and not yet left; those of them in callbacks. mu held.
  size_t liveLocked() const { return live_; }
  bool allInCallbacksLocked() const { return inCallbacks_ >= live_; }

  // The watcher looks (starting its thread the first time) unless it is
  // armed already, done, or could not start and is not to try again. mu held.
  void armWatcherLocked();
  // Wakes the watcher to look at Client::watcherDoneLocked(). Any lock state.
  void wakeWatcher() { watchCv_.notify_all(); }

  // Stopping. Threads (and the watcher) started from now on are detached at
  // once: the caller lets the others go and nobody will join them. mu held.
  void letGoLocked() { detachNew_ = true; }
  // Hands over the threads and then the watcher, to be joined or let go by
  // the caller (who makes sure none starts after). mu held.
  std::vector<std::thread> takeAllLocked();
  // Joins the threads, or lets them go (`detach`), again until none is left
  // (one blocked in a callback may start another), then the watcher, which
  // must end by then (Client::watcherDoneLocked). Takes mu for each look.
  void endAll(bool detach);

 private:
  void watch();  // the watcher's loop, on its thread

  std::mutex& mu_;  // the owner's: guards every field below
  Client& client_;
  const char* const threadName_;
  const char* const watcherName_;
  std::vector<std::thread> threads_;  // not yet taken (takeAllLocked, endAll)
  size_t live_ = 0;                   // started and not yet left
  size_t inCallbacks_ = 0;            // of those, the ones running callbacks
  bool detachNew_ = false;            // letGoLocked()
  // The watcher: its thread (started at the first arming), whether it looks
  // (armed) or idles until armed, whether it started, and whether it could
  // not and is not to try again. watchCv_ waits on mu_.
  std::thread watcher_;
  std::condition_variable watchCv_;
  bool armed_ = false;
  bool watcherStarted_ = false;
  bool watcherFailed_ = false;
};

}  // namespace ringreduce
