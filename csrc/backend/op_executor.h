// OpExecutor: runs one group's collectives in issue order and settles their
// Works, on whatever thread can run them soonest.
//
// Every rank issues collectives in the same order, and an op's Future must
// complete before the next op's (DDP reads its buckets in that order), so ops
// run one at a time, front of the queue first, and the next op starts only
// once the previous Work has been settled (its Future completed, its
// callbacks run). Who runs an op:
// - the caller's thread, for a synchronous op that finds nothing queued or
//   running (inline: saves the two thread hand-offs of a small collective);
// - a thread in Work::wait() (a helping wait: the ops queued up to the one it
//   waits for, when no other thread runs one);
// - a worker thread otherwise (one at first; another when work is queued
//   while every worker is inside a Future's callbacks, which may wait for it);
// - a callback that waits for an op queued behind its own Work: as a helping
//   wait once every finished op's Future is complete; and, for a wait that
//   never reaches Work::wait() (torch's Future::wait()), a worker the watcher
//   lets run the front op when the queue has been stalled by such settling
//   for kRescueAfter (common/rescue.h).
// Point-to-point ops run on the transport's thread, apart from that order,
// and their Works are settled here (postP2P below): on the posting thread
// when the op finished within its post, else by the thread waiting for it,
// else by a worker.
// The workers ("rr-worker") and the watcher ("rr-watch") are a
// CallbackThreads (common/callback_threads.h); the executor is its Client:
// the workers' loop, when the queue and the completions are watched and
// stalled, and what a rescue does.
//
// The executor knows nothing of transports: its owner runs each op (RunOp)
// and decides what a failure means for the group. It keeps the owner alive
// (weakly held, locked for each op and its callbacks: a callback may drop
// the owner's last other reference, and the owner then shuts down on the
// thread that drops the one taken here).
#pragma once

#include <c10/util/intrusive_ptr.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <thread>
#include <vector>

#include "backend/work.h"
#include "common/callback_threads.h"
#include "transport/transport.h"

namespace ringreduce {

class Comm;

class OpExecutor : private CallbackThreads::Client {
 public:
  using Job = std::function<void(const Comm&)>;
  struct Entry {
    OpInfo op;
    std::chrono::milliseconds timeout;
    c10::intrusive_ptr<Work> work;
    Job run;
    // Issued from a Future's callbacks (while a Work was being settled): may
    // run while earlier Works are still being settled.
    bool nested = false;
  };
  // Runs the op on the calling thread with no lock of the executor's held;
  // returns its error (null: it succeeded). Must not throw.
  using RunOp = std::function<std::exception_ptr(Entry&)>;
  using Owner = c10::weak_intrusive_ptr<c10::intrusive_ptr_target>;

  explicit OpExecutor(RunOp run);
  ~OpExecutor();
  OpExecutor(const OpExecutor&) = delete;
  OpExecutor& operator=(const OpExecutor&) = delete;

  // Holds the owner weakly from here on and starts the first worker.
  void start(Owner owner);
  // The owner's last strong reference is gone: no thread may take it again.
  void releaseOwner();

  // Queues the op, or runs it inline (a synchronous op finding nothing queued
  // or running; `e.nested` is set here). Its Work is failed at once when the
  // executor is stopping.
  void submit(Entry e, bool asyncOp);

  // ---- point-to-point ops ----
  // They run on the transport's thread, in any order (matched by peer and
  // tag); their Works are settled here: a p2p op's transport callback calls
  // its completion with how to settle its Work (the write-back, then
  // complete or fail: its Future's callbacks run). The settling runs on the
  // thread waiting for that Work in Work::wait() (a helping wait: set on the
  // Work here, it takes its completion as it arrives), else on a worker, apart
  // from the collectives' order and any number at once. The workers for them
  // grow as for the collectives' callbacks: at once when every worker is busy
  // and one of them surely blocks (running an op, or waiting for a p2p Work),
  // else when the watcher finds completions held by callbacks. Once the
  // executor stops, or its owner is gone, a completion is settled on the
  // calling thread, or on a thread of its own when its Future was taken (a
  // callback may wait for a later one); the stop collects those threads.
  // postP2P sets the Work's helping wait, then calls `post` (which makes the
  // Work visible to other threads, then posts the op) with that completion;
  // one that comes within the post (the transport finished the op on the
  // posting thread: an inline run) settles the Work there, before it is
  // returned, so no callback of the caller's can be on its Future yet.
  using Settle = std::function<void()>;
  using Completion = std::function<void(Settle)>;
  void postP2P(const c10::intrusive_ptr<Work>& work,
               const std::function<void(Completion)>& post);

  // The op being run has passed its final check: a stop need not abort the
  // group for it (called by RunOp on the op's thread, no lock).
  void markConfirmed() { runningConfirmed_.store(true, std::memory_order_release); }

  // Shutting down, in the owner's order (Backend::shutdown):
  struct Stopping {
    bool already = false;            // stopped before: nothing to do
    std::deque<Entry> dropped;       // queued ops, in issue order, their Works open
    bool busy = false;               // an op is running and not confirmed
    std::vector<std::thread> threads;  // workers and the watcher, to be ended
    // p2p completions no worker took: settled by settleDropped().
    std::deque<std::pair<c10::intrusive_ptr<Work>, Settle>> completed;
  };
  // 1. No op starts any more; the queue is handed back.
  Stopping beginStop();
  // 2. Fails the dropped Works in issue order with error(entry). A taken
  //    Future's callbacks may wait in torch's Future::wait() for a later
  //    dropped op: such a Work is failed on a thread of its own, waited for a
  //    little, and that thread is returned, to be ended with the others.
  std::vector<std::thread> failDropped(std::deque<Entry>& dropped,
                                       const std::function<std::exception_ptr(const Entry&)>& error);
  //    And settles the p2p completions no worker took (as above, a thread
  //    for one whose Future was taken), returning those threads.
  std::vector<std::thread> settleDropped(Stopping& s);
  // 3. Waits until no op runs (the owner aborted the one in flight), unless
  //    the calling thread is running it.
  void waitIdle();
  // After the transport closed (its last p2p completions came): the threads
  // settling completions that came after the stop.
  std::vector<std::thread> takeLateThreads();
  // 4. Joins the threads; lets them go instead when called from a Future's
  //    callback on one of our threads (joining could wait for this thread),
  //    or for the calling thread itself.
  static void endThreads(std::vector<std::thread> threads);

  // Whether the calling thread is inside an op's run (a stop there must not
  // wait for its own op), and whether it is settling a Work (a Future
  // callback: a stop there must not join the workers).
  static bool runningOpsHere();
  static bool settlingHere();

  // Settles a Work (fails or completes it) whose Future may have callbacks
  // that wait for a later Work: on a thread of its own when its Future was
  // taken (waited for a little) or `always`, else here; returns that thread,
  // or none when it ran here (also when no thread could be had).
  static std::optional<std::thread> settleAside(Work& work, Settle settle, bool always = false);

  // How many helping waits for p2p Works have begun (a thread in Work::wait()
  // registered for its completion): tests wait for it to grow before the
  // peer sends.
  uint64_t helpingWaitsBegun() const {
    return helpingWaitsBegun_.load(std::memory_order_relaxed);
  }

 private:
  // Whether a thread may start the queue's front op now (with mu_): only once
  // every earlier Work has been settled, so Futures complete in issue order,
  // unless an op a callback issued is queued (the callback may be waiting for
  // it, and everything queued before it must run first).
  bool mayRunLocked() const { return settling_ == 0 || nestedQueued_ > 0; }
  // run_, finishRunning, settle: one op, on any thread.
  void runAndSettle(Entry& e, bool onWorker);
  // Ends an op's run on any thread: clears running_ and counts the op as being
  // settled (its thread calls settle() next); wakes the worker when work is
  // queued behind it, and a stop.
  void finishRunning(bool onWorker);
  // Completes or fails the Work (its Future's callbacks run here). onWorker:
  // a worker's, counted in workersInCallbacks_ from finishRunning() on.
  void settle(Entry& e, std::exception_ptr error, bool onWorker);
  // Takes the queue's front entry to run it (with mu_): sets running_.
  Entry popFrontLocked();
  // Counts a Work being settled whose Future was taken in settlingTaken_
  // (once; not after it settled) and arms the watcher (with mu_).
  void countTakenLocked(Work& work);
  // Runs queued ops on the calling thread, in queue order, up to and
  // including `work`'s, while no other thread runs one; returns at once when
  // `work` is not queued, another thread is running an op, or the executor is
  // stopping (Work::wait then blocks as before).
  void runQueuedUntil(const Work* work);
  // The workers' loop: the queue's front op whenever it may run.
  void workerLoop(const Owner& owner);
  // Another worker when work is queued from a worker's callback while every
  // worker is inside callbacks (which may wait for that work). With mu_.
  void ensureWorkerLocked();
  // The watcher's view: a Future callback may block in torch's
  // Future::wait() (which never reaches Work::wait) for an op queued behind
  // its own Work, which no thread starts until that Work is settled. The
  // queue is watched (with mu_) while a Work whose Future was taken is
  // settled with ops queued (armed then), and stalled when no op runs, none
  // may start, and every finished op's Future is complete; one stalled for
  // a whole look, with no Work settled meanwhile, is rescued: a worker may
  // run the queue's front op (rescue_; a new worker when every one is in
  // callbacks).
  // And the queue's front op may start, but every worker is in callbacks
  // (p2p callbacks hold no settling_; one may wait for that op): unserved.
  bool queueUnservedLocked() const {
    return !queue_.empty() && !running_ && mayRunLocked() && idle_ == 0 && starting_ == 0 &&
           threads_.allInCallbacksLocked();
  }
  bool watchingLocked() const {
    return (settlingTaken_ > 0 && !queue_.empty()) || completionsHeldLocked() ||
           queueUnservedLocked();
  }
  bool queueWatchedLocked() const { return settlingTaken_ > 0 && !queue_.empty(); }
  bool stalledLocked() const {
    return queueWatchedLocked() && !running_ && !mayRunLocked() && unmarked_.load() == 0;
  }
  bool rescuingLocked() const { return rescue_ && settled_ == rescueMark_ && stalledLocked(); }

  Completion p2pCompletion(const c10::intrusive_ptr<Work>& work);
  // p2p completions (with mu_): queues one, or, stopping, returns false.
  bool completeLocked(c10::intrusive_ptr<Work> work, Settle& settle);
  // A free worker for the completions no helping wait takes: an idle one, a
  // new one when every worker is busy and one of them surely blocks, else the
  // watcher's (with mu_).
  void ensureCompleterLocked();
  // Whether a completion no helping wait is for is queued; the first such,
  // taken to be settled.
  bool hasFreeCompletionLocked() const;
  std::pair<c10::intrusive_ptr<Work>, Settle> takeFreeCompletionLocked();
  // Takes the completion at `it` out of the queue, marked taken (with mu_).
  std::pair<c10::intrusive_ptr<Work>, Settle> takeCompletionLocked(
      std::deque<std::pair<c10::intrusive_ptr<Work>, Settle>>::iterator it);
  // Settles one on this thread (onWorker: counted in callbacks since taken).
  void runCompletion(std::pair<c10::intrusive_ptr<Work>, Settle>& c, bool onWorker);
  // Work::wait()'s helping wait for a p2p Work: takes its completion when it
  // comes and settles it here; returns at once when it was taken, or when
  // stopping (wait() then blocks as before).
  void settleWhenComplete(Work* work);
  // The watcher's view of them: completions no thread takes (no worker idle
  // or starting), and none taken since its last look.
  bool completionsHeldLocked() const {
    return idle_ == 0 && starting_ == 0 && hasFreeCompletionLocked();
  }
  bool completionsStalledLocked() const {
    return completionsHeldLocked() && completionsTaken_ == completionsMark_;
  }

  // CallbackThreads::Client, all with mu_ held (callback_threads.h):
  // a worker running workerLoop(), holding the owner weakly;
  std::function<void()> threadBodyLocked() override;
  // the watcher holds the owner weakly too;
  std::shared_ptr<void> watcherKeepLocked() override;
  // no thread for the watcher: the ops go on without the rescue, and the next
  // arming tries again;
  bool retryWatcherLocked(const std::exception&) override { return true; }
  // the watcher ends with the stop;
  bool watcherDoneLocked() const override { return stopping_; }
  // while watching: kRescueAfter, or, when the rescue needs a new worker
  // past the first few, rescueStall(workers) (common/rescue.h: slow
  // callbacks settle a Work within it); the look's marks are settled_ and
  // completionsTaken_ now;
  std::optional<std::chrono::milliseconds> watchPeriodLocked() override;
  // a rescue when the queue is stalled (no Work settled since the mark) or
  // unserved, or completions are held (none taken since the mark), and, if
  // a new worker is needed, the look was the longer one;
  CallbackThreads::Look lookLocked(std::chrono::milliseconds slept) override;
  // for the queue, rescue_ for a free worker or a new one; for completions,
  // a new worker; with no thread to be had, the watcher runs the op or
  // settles the completion itself (unlocking `lock` meanwhile).
  void rescueLocked(std::unique_lock<std::mutex>& lock) override;

  const RunOp run_;

  // What the Works' hooks (helping wait, late-taken Future) reach the
  // executor through: the owner, locked for the call (dropping it may shut
  // the owner down on that thread; nothing after touches the executor).
  struct Gate {
    std::mutex mu;  // guards owner
    Owner owner{c10::intrusive_ptr<c10::intrusive_ptr_target>()};
    OpExecutor* executor;
    explicit Gate(OpExecutor* e) : executor(e) {}
    c10::intrusive_ptr<c10::intrusive_ptr_target> strong() {
      std::lock_guard<std::mutex> lock(mu);
      return owner.lock();
    }
  };
  Owner owner() const;
  std::shared_ptr<Gate> gate_ = std::make_shared<Gate>(this);

  // Locking: mu_ guards every field below that says so, and threads_ (cv_,
  // idleCv_ and the watcher wait on it). It is never held while an op runs
  // or a Work is settled, so a caller's submit never waits for an op.
  std::mutex mu_;
  std::condition_variable cv_;  // the workers wait on it for a runnable front op
  std::deque<Entry> queue_;     // guarded by mu_
  bool stopping_ = false;       // guarded by mu_
  bool running_ = false;        // guarded by mu_: an op is running (any thread)
  // The running op has passed its final check (markConfirmed). Cleared with
  // running_ set (under mu_), set by the op's thread without the lock (no
  // lock per op); beginStop() reads it under mu_.
  std::atomic<bool> runningConfirmed_{false};
  size_t settling_ = 0;               // guarded by mu_: Works being settled, any thread
  // Of those, the ones whose Future is not yet complete (their callbacks have
  // not started): a wait() in a callback may run the queue once this is 0
  // (runQueuedUntil, counted in callbackWaiters_ while it waits on idleCv_).
  // Atomic: settle() takes mu_ for it only when such a wait is on.
  std::atomic<size_t> unmarked_{0};
  std::atomic<size_t> callbackWaiters_{0};
  size_t nestedQueued_ = 0;           // guarded by mu_: queued entries with `nested`
  // The watcher's, guarded by mu_: Works being settled whose Future was
  // taken, Works settled so far, and settled_ at its last sleep.
  size_t settlingTaken_ = 0;
  uint64_t settled_ = 0;
  uint64_t watchMark_ = 0;
  // The watcher found the queue stalled: one worker may start its front op
  // although mayRunLocked() says no, while it is still stalled and no Work
  // settled since (settled_ still rescueMark_); the next popFrontLocked()
  // clears it.
  bool rescue_ = false;
  uint64_t rescueMark_ = 0;
  // waitIdle() waits on it for !running_; a wait() in a callback for the
  // queue to be its to run.
  std::condition_variable idleCv_;
  // p2p completions, guarded by mu_: those not yet taken, in arrival order;
  // the workers idle in cv_, those started and not yet in their loop, the one
  // running an op, and those in a helping wait for a p2p Work from a callback; completions taken so far and at the
  // watcher's last look (the rescue was for them); the threads settling them
  // after the stop. Helping waits wait on completedCv_.
  std::deque<std::pair<c10::intrusive_ptr<Work>, Settle>> completed_;
  size_t idle_ = 0;
  size_t starting_ = 0;
  bool workerRunsOp_ = false;
  size_t helpingWorkers_ = 0;
  uint64_t completionsTaken_ = 0;
  std::atomic<uint64_t> helpingWaitsBegun_{0};
  uint64_t completionsMark_ = 0;
  bool rescueCompletion_ = false;
  std::vector<std::thread> late_;
  std::condition_variable completedCv_;
  // The workers and the watcher (guarded by mu_): taken by beginStop(); the
  // workers in callbacks are those settling a Work (finishRunning to settle).
  CallbackThreads threads_{mu_, *this, "rr-worker", "rr-watch"};
};

}  // namespace ringreduce
