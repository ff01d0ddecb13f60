// OpExecutor (op_executor.h): the queue, the inline and helping runs, the
// workers' loop, settling each Work, what the watcher looks at and does
// (its thread and the workers' are common/callback_threads.h's), and stopping.
#include "backend/op_executor.h"

#include <c10/util/ScopeExit.h>

#include <algorithm>
#include <future>
#include <system_error>

#include "common/rescue.h"
#include "common/test_hooks.h"
#include "common/thread_name.h"
#include "common/wait_hook.h"

namespace ringreduce {
namespace {

// Whether this thread is inside an op's run (a worker, an inline op or a
// helping wait()): a stop from there must not wait for its own op to end, and
// a wait() there must not run ops itself. (A Work's Future callbacks run
// after the run, so a wait() in them may.)
thread_local bool tRunningOps = false;
// Whether this thread is a worker running a Future's callbacks.
thread_local bool tWorkerInCallbacks = false;
// How many Works this thread is settling (nested: a callback's own op).
thread_local int tSettlingDepth = 0;

}  // namespace

OpExecutor::OpExecutor(RunOp run) : run_(std::move(run)) {}

bool OpExecutor::runningOpsHere() {
  return tRunningOps;
}

bool OpExecutor::settlingHere() {
  return tSettlingDepth > 0;
}

OpExecutor::Owner OpExecutor::owner() const {
  std::lock_guard<std::mutex> lock(gate_->mu);
  return gate_->owner;
}

void OpExecutor::start(Owner owner) {
  {
    std::lock_guard<std::mutex> lock(gate_->mu);
    gate_->owner = std::move(owner);
  }
  std::lock_guard<std::mutex> lock(mu_);
  threads_.spawnLocked();
}

void OpExecutor::releaseOwner() {
  std::lock_guard<std::mutex> lock(gate_->mu);
  gate_->owner = Owner(c10::intrusive_ptr<c10::intrusive_ptr_target>());
}

std::function<void()> OpExecutor::threadBodyLocked() {
  // Each worker keeps the owner's object (not the owner: it still shuts down
  // with its last strong reference) until it leaves its loop, so a stop may
  // detach it (from a callback, where joining could wait for this thread).
  return [this, weak = owner()] { workerLoop(weak); };
}

std::shared_ptr<void> OpExecutor::watcherKeepLocked() {
  return std::make_shared<Owner>(owner());
}

void OpExecutor::ensureWorkerLocked() {
  // A Future callback on a worker queued this op and may block until it
  // completes (torch's PowerSGD hook waits on a new all_reduce's Future in its
  // `then` callback). When every worker is inside callbacks, another one runs
  // the queue meanwhile. Only then: a worker that settles a Work while the
  // caller queues its next op (DDP's buckets, an async op waited at once) is
  // back in its loop within microseconds, and a thread per such op cost 10 us.
  if (tWorkerInCallbacks && !stopping_ && !queue_.empty() && threads_.allInCallbacksLocked()) {
    threads_.spawnLocked();
  }
}

std::optional<std::chrono::milliseconds> OpExecutor::watchPeriodLocked() {
  if (!watchingLocked()) return std::nullopt;
  // Longer when the rescue needs a new worker past the first few
  // (common/rescue.h: slow callbacks settle a Work within it).
  watchMark_ = settled_;
  return threads_.allInCallbacksLocked() ? rescueStall(threads_.liveLocked()) : kRescueAfter;
}

CallbackThreads::Look OpExecutor::lookLocked(std::chrono::milliseconds slept) {
  if (settled_ != watchMark_ || !stalledLocked()) return CallbackThreads::Look::kAgain;
  // The workers filled up while it slept: wait the longer stall.
  if (threads_.allInCallbacksLocked() && slept < rescueStall(threads_.liveLocked())) {
    return CallbackThreads::Look::kAgain;
  }
  return CallbackThreads::Look::kRescue;
}

void OpExecutor::rescueLocked(std::unique_lock<std::mutex>& lock) {
  // Every finished op's Future is complete, so Futures still complete in
  // issue order; the callbacks of this op may run before the held ones end,
  // as with gloo's two threads. A worker runs it (a new one when every
  // worker is in callbacks), not the watcher: that op's callbacks may wait
  // in turn for the next op (a chain), which the watcher then rescues too.
  // Callbacks that are only slow get rescued too, so a new worker past the
  // first few needs a longer stall (watchPeriodLocked). With no thread to be
  // had the watcher runs the op itself, as the only way left.
  if (threads_.ensureRunnerLocked() == CallbackThreads::Runner::kNone) {
    {
      Entry e = popFrontLocked();
      lock.unlock();
      c10::intrusive_ptr<c10::intrusive_ptr_target> self = owner().lock();
      runAndSettle(e, true);
    }  // the entry goes before mu_ is taken again (its tensors may need the GIL)
    lock.lock();
    return;
  }
  rescue_ = true;
  rescueMark_ = settled_;
  cv_.notify_all();
}

void OpExecutor::submit(Entry e, bool asyncOp) {
  e.nested = tSettlingDepth > 0;
  Work& work = *e.work;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (stopping_) {
      work.fail(transportError(e.op.ctx.message("the process group was shut down")));
      return;
    }
    if (asyncOp || !queue_.empty() || running_ || !(e.nested || mayRunLocked())) {
      work.setLateTaken([gate = gate_](Work* w) {
        c10::intrusive_ptr<c10::intrusive_ptr_target> self = gate->strong();
        if (!self) return;
        std::lock_guard<std::mutex> lock(gate->executor->mu_);  // released before `self`
        gate->executor->countTakenLocked(*w);
      });
      work.setHelper([gate = gate_](Work* w) {
        if (tRunningOps) return;
        // Dropping `self` may shut the owner down here (a callback dropped
        // its last other reference); nothing after touches the executor.
        if (c10::intrusive_ptr<c10::intrusive_ptr_target> self = gate->strong()) {
          gate->executor->runQueuedUntil(w);
        }
      });
      if (e.nested) ++nestedQueued_;
      queue_.push_back(std::move(e));
      ensureWorkerLocked();
      if (settlingTaken_ > 0) threads_.armWatcherLocked();
      cv_.notify_one();
      return;
    }
    running_ = true;  // keeps the workers off while this op runs here
    runningConfirmed_.store(false, std::memory_order_relaxed);
  }
  runAndSettle(e, false);
}

void OpExecutor::runAndSettle(Entry& e, bool onWorker) {
  std::exception_ptr error;
  {
    auto finish = c10::make_scope_exit([this, onWorker] { finishRunning(onWorker); });
    const bool outer = tRunningOps;
    tRunningOps = true;
    auto restore = c10::make_scope_exit([outer] { tRunningOps = outer; });
    error = run_(e);
  }
  settle(e, error, onWorker);
}

void OpExecutor::finishRunning(bool onWorker) {
  bool wake;
  {
    std::lock_guard<std::mutex> lock(mu_);
    running_ = false;
    if (onWorker) threads_.enterCallbacksLocked();
    // Its Work is settled next, by this thread (settle() ends it): until
    // then no other thread starts the next op (mayRunLocked), so Futures
    // complete in issue order.
    ++settling_;
    ++unmarked_;
    wake = !queue_.empty() || stopping_;
  }
  // Only the workers wait on cv_, and only for queued work: waking one for
  // nothing would cost a context switch per small op (measured ~10% of a
  // 4 KiB all-reduce's time on 2 ranks).
  if (wake) {
    cv_.notify_one();
    idleCv_.notify_all();
  }
}

void OpExecutor::settle(Entry& e, std::exception_ptr error, bool onWorker) {
  ++tSettlingDepth;
  const bool outerOnWorker = tWorkerInCallbacks;  // a nested settle keeps it
  tWorkerInCallbacks = outerOnWorker || onWorker;
  // Its Future may have callbacks that block in torch's Future::wait() for an
  // op queued behind it: the watcher looks after the queue meanwhile. One
  // lock per op, only when the Future was taken (DDP's buckets).
  // A getFuture() after this look counts the Work itself (countTakenLocked
  // through the Work's late-taken hook).
  if (e.work->lookedForFuture()) {
    std::lock_guard<std::mutex> lock(mu_);
    countTakenLocked(*e.work);
  }
  Work& work = *e.work;
  auto done = c10::make_scope_exit([this, onWorker, outerOnWorker, &work] {
    --tSettlingDepth;
    tWorkerInCallbacks = outerOnWorker;
    bool wake;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (onWorker) threads_.leaveCallbacksLocked();
      if (work.counted) --settlingTaken_;
      work.lookClosed();  // under mu_: a late getFuture() no longer counts it
      ++settled_;
      wake = --settling_ == 0 && !queue_.empty();
    }
    if (wake) cv_.notify_all();  // a worker held back by mayRunLocked()
  });
  // Its Future completes next, then its callbacks run: from there on a wait()
  // in one may run the ops queued behind it (runQueuedUntil). Sequentially
  // consistent with the waiter's count and check (Dekker): it sees 0 here, or
  // this sees it waiting and wakes it under mu_.
  if (unmarked_.fetch_sub(1) == 1 && callbackWaiters_.load() > 0) {
    std::lock_guard<std::mutex> lock(mu_);
    idleCv_.notify_all();
  }
  if (error) {
    e.work->fail(error);
    return;
  }
  e.work->complete();
  if (const int64_t ms = testHooks().completeDelayMs.load(std::memory_order_relaxed)) {
    std::this_thread::sleep_for(std::chrono::milliseconds(ms));
  }
}

void OpExecutor::countTakenLocked(Work& work) {
  if (work.counted || !work.lookOpen()) return;
  work.counted = true;
  ++settlingTaken_;
  if (!queue_.empty()) threads_.armWatcherLocked();
}

OpExecutor::Entry OpExecutor::popFrontLocked() {
  Entry e = std::move(queue_.front());
  queue_.pop_front();
  if (e.nested) --nestedQueued_;
  rescue_ = false;  // whoever took the front op, the watcher's hand-off is used up
  running_ = true;
  runningConfirmed_.store(false, std::memory_order_relaxed);
  return e;
}

void OpExecutor::runQueuedUntil(const Work* work) {
  // In a Future's callback (settling a Work whose Future is complete), this
  // thread's own settling keeps every worker off the queue (mayRunLocked),
  // and the op waited for may have been queued before (not nested): this
  // thread runs the queue, once no other finished op's Future is still to
  // complete (Futures complete in issue order), instead of waiting forever.
  const bool inCallback = tSettlingDepth > 0;
  while (true) {
    Entry e;
    {
      std::unique_lock<std::mutex> lock(mu_);
      while (true) {
        if (stopping_) return;
        if (std::none_of(queue_.begin(), queue_.end(),
                         [work](const Entry& q) { return q.work.get() == work; })) {
          return;  // already taken by a worker (running or done)
        }
        if (!running_ && mayRunLocked()) break;
        if (!inCallback) return;
        // Counted before the check (Dekker with settle()'s decrement).
        ++callbackWaiters_;
        const bool marked = !running_ && unmarked_.load() == 0;
        if (!marked) idleCv_.wait(lock);
        --callbackWaiters_;
        if (marked) break;
      }
      e = popFrontLocked();  // running_ keeps the workers off, as for an inline op
    }
    runAndSettle(e, false);
    if (e.work.get() == work) return;
  }
}

void OpExecutor::workerLoop(const Owner& weak) {
  while (true) {
    Entry e;
    {
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait(lock, [this] {
        return stopping_ ||
               (!queue_.empty() && !running_ && (mayRunLocked() || rescuingLocked()));
      });
      if (queue_.empty()) {
        threads_.threadLeftLocked();
        return;
      }
      e = popFrontLocked();
    }
    // A strong reference for the op and its callbacks: one may drop the last
    // other one. Dropping this one may then shut the owner down here; `weak`
    // keeps the object, and the loop ends on stopping_.
    c10::intrusive_ptr<c10::intrusive_ptr_target> self = weak.lock();
    runAndSettle(e, true);
  }
}

OpExecutor::Stopping OpExecutor::beginStop() {
  Stopping s;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (stopping_) {  // no thread starts once it is set
      s.already = true;
      return s;
    }
    stopping_ = true;
    s.threads = threads_.takeAllLocked();
    s.dropped.swap(queue_);
    nestedQueued_ = 0;
    // An op whose Work completed may still hold running_ for a moment (its
    // thread is on the way out of its run): it needs no abort, and aborting
    // for it would publish a failure on a clean exit.
    s.busy = running_ && !runningConfirmed_.load(std::memory_order_acquire);
  }
  cv_.notify_all();
  threads_.wakeWatcher();
  idleCv_.notify_all();  // a wait() in a callback for the queue
  return s;
}

std::vector<std::thread> OpExecutor::failDropped(
    std::deque<Entry>& dropped, const std::function<std::exception_ptr(const Entry&)>& error) {
  // Not simply in a row: a callback of one may wait for a later one (op_executor.h).
  std::vector<std::thread> failing;
  for (auto& e : dropped) {
    std::exception_ptr why = error(e);
    if (!e.work->futureTaken()) {
      e.work->fail(why);
      continue;
    }
    auto done = std::make_shared<std::promise<void>>();
    std::future<void> failed = done->get_future();
    try {
      failing.emplace_back([work = e.work, why, done] {
        nameThisThread("rr-worker");
        work->fail(why);
        done->set_value();
      });
    } catch (const std::system_error&) {
      e.work->fail(why);  // no thread to be had: in a row, as before
      continue;
    }
    failed.wait_for(kRescueAfter);
  }
  return failing;
}

void OpExecutor::waitIdle() {
  std::unique_lock<std::mutex> lock(mu_);
  idleCv_.wait(lock, [this] { return !running_ || tRunningOps; });
}

void OpExecutor::endThreads(std::vector<std::thread> threads) {
  // From a Future's callback on one of our threads (a worker, a helping
  // wait(), the p2p engine), another worker may be in a callback waiting for
  // the Work this thread is completing: joining it would wait forever. The
  // workers hold the object until they leave their loops (stopping_ is set),
  // so they are let go; this thread cannot join itself either.
  const bool fromCallback = settlingHere() || blockingHook().fn != nullptr;
  for (auto& t : threads) {
    if (fromCallback || t.get_id() == std::this_thread::get_id()) {
      t.detach();
    } else {
      t.join();
    }
  }
}

}  // namespace ringreduce
