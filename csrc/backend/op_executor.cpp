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
// How many p2p completions this thread is settling.
thread_local int tCompletingDepth = 0;
// The p2p op this thread is posting (postP2P).
thread_local const Work* tPosting = nullptr;

}  // namespace

OpExecutor::OpExecutor(RunOp run) : run_(std::move(run)) {}

OpExecutor::~OpExecutor() {
  // Completions settled aside after the stop took its threads (the transport
  // let its thread go, from one of its callbacks): nobody joins them.
  for (auto& t : late_) t.detach();
}

bool OpExecutor::runningOpsHere() {
  return tRunningOps;
}

bool OpExecutor::settlingHere() {
  return tSettlingDepth > 0 || tCompletingDepth > 0;
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
  ++starting_;  // counted out in its loop's first hold of mu_
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
  completionsMark_ = completionsTaken_;
  return threads_.allInCallbacksLocked() ? rescueStall(threads_.liveLocked()) : kRescueAfter;
}

CallbackThreads::Look OpExecutor::lookLocked(std::chrono::milliseconds slept) {
  const bool progress = settled_ != watchMark_ || completionsTaken_ != completionsMark_;
  const bool queue =
      (settled_ == watchMark_ && stalledLocked()) || (!progress && queueUnservedLocked());
  const bool completions = completionsStalledLocked();
  if (!queue && !completions) return CallbackThreads::Look::kAgain;
  // The workers filled up while it slept: wait the longer stall.
  if (threads_.allInCallbacksLocked() && slept < rescueStall(threads_.liveLocked())) {
    return CallbackThreads::Look::kAgain;
  }
  rescueCompletion_ = !queue;
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
  if (rescueCompletion_) {
    // Completions held by callbacks (no worker idle): a new worker takes the
    // next; with none to be had, the watcher settles it itself.
    try {
      threads_.spawnLocked();
      return;
    } catch (const std::exception&) {
    }
    {
      auto c = takeFreeCompletionLocked();
      lock.unlock();
      c10::intrusive_ptr<c10::intrusive_ptr_target> self = owner().lock();
      runCompletion(c, false);
    }
    lock.lock();
    return;
  }
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
      if (settlingTaken_ > 0 || queueUnservedLocked()) threads_.armWatcherLocked();
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
    if (onWorker) {
      workerRunsOp_ = false;
      threads_.enterCallbacksLocked();
    }
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
  bool started = true;
  while (true) {
    Entry e;
    std::pair<c10::intrusive_ptr<Work>, Settle> completion;
    {
      std::unique_lock<std::mutex> lock(mu_);
      if (started) {
        --starting_;
        started = false;
      }
      ++idle_;
      cv_.wait(lock, [this] {
        return stopping_ || hasFreeCompletionLocked() ||
               (!queue_.empty() && !running_ && (mayRunLocked() || rescuingLocked()));
      });
      --idle_;
      if (!stopping_ && hasFreeCompletionLocked()) {
        completion = takeFreeCompletionLocked();
        threads_.enterCallbacksLocked();
        // More came meanwhile (this worker was woken for one), or an op is
        // queued: a callback of this one may wait for them.
        ensureCompleterLocked();
        if (queueUnservedLocked()) threads_.armWatcherLocked();
      } else if (queue_.empty()) {
        threads_.threadLeftLocked();
        return;
      } else {
        e = popFrontLocked();
        workerRunsOp_ = true;
      }
    }
    // A strong reference for the op and its callbacks: one may drop the last
    // other one. Dropping this one may then shut the owner down here; `weak`
    // keeps the object, and the loop ends on stopping_.
    c10::intrusive_ptr<c10::intrusive_ptr_target> self = weak.lock();
    if (completion.first) {
      runCompletion(completion, true);
    } else {
      runAndSettle(e, true);
    }
  }
}

// ---- point-to-point completions --------------------------------------------

void OpExecutor::postP2P(const c10::intrusive_ptr<Work>& work,
                         const std::function<void(Completion)>& post) {
  // Before any other thread can see the Work (`post` makes it visible).
  work->setHelper([gate = gate_](Work* w) {
    if (tRunningOps) return;  // inside an op's run: no waiting for another here
    if (c10::intrusive_ptr<c10::intrusive_ptr_target> self = gate->strong()) {
      gate->executor->settleWhenComplete(w);
    }
  });
  const Work* outer = tPosting;
  tPosting = work.get();
  auto restore = c10::make_scope_exit([outer] { tPosting = outer; });
  post(p2pCompletion(work));
}

OpExecutor::Completion OpExecutor::p2pCompletion(const c10::intrusive_ptr<Work>& work) {
  return [gate = gate_, work](Settle settle) {
    // Counted as settling: should this thread (the transport's) drop the
    // owner's last reference below, the shutdown there lets the threads go
    // instead of joining one that waits for a completion queued behind this.
    ++tCompletingDepth;
    auto restore = c10::make_scope_exit([] { --tCompletingDepth; });
    if (tPosting == work.get()) {
      // Done within its post, on the posting thread: settled here, before the
      // Work is returned. A helping wait already on it (another thread that
      // found it tracked) returns and waits for it to be done.
      if (c10::intrusive_ptr<c10::intrusive_ptr_target> self = gate->strong()) {
        std::lock_guard<std::mutex> lock(gate->executor->mu_);
        work->p2pTaken = true;
        if (work->p2pWaiters > 0) gate->executor->completedCv_.notify_all();
      }
      settle();
      return;
    }
    {
      // Holding the owner keeps the executor; dropping it may shut the owner
      // down here (nothing after touches the executor).
      c10::intrusive_ptr<c10::intrusive_ptr_target> self = gate->strong();
      if (self) {
        OpExecutor& ex = *gate->executor;
        std::lock_guard<std::mutex> lock(ex.mu_);
        if (ex.completeLocked(work, settle)) return;
      }
    }
    // Stopped, or the owner is gone: settled on a thread of its own (a
    // callback taken meanwhile must not run on the transport's thread), which
    // the stop joins while the owner is there.
    std::optional<std::thread> t = settleAside(*work, std::move(settle), /*always=*/true);
    if (!t) return;
    if (c10::intrusive_ptr<c10::intrusive_ptr_target> self = gate->strong()) {
      std::lock_guard<std::mutex> lock(gate->executor->mu_);
      gate->executor->late_.push_back(std::move(*t));
      return;
    }
    t->detach();
  };
}

bool OpExecutor::completeLocked(c10::intrusive_ptr<Work> work, Settle& settle) {
  if (stopping_) return false;
  const bool waited = work->p2pWaiters > 0;
  completed_.emplace_back(std::move(work), std::move(settle));
  if (waited) {
    completedCv_.notify_all();  // its helping wait takes it
    return true;
  }
  ensureCompleterLocked();
  return true;
}

void OpExecutor::ensureCompleterLocked() {
  if (stopping_ || !hasFreeCompletionLocked()) return;
  if (idle_ > 0 || starting_ > 0) {  // a starting worker looks before it waits
    cv_.notify_one();
    return;
  }
  // Every worker is busy. One running an op waits for the peers, which may
  // wait for this completion's callbacks (a send they post); one in a helping
  // wait waits for another p2p op. When every worker is one of those, another
  // worker now (one per such worker at most). Callbacks that are only slow
  // return: the watcher's stall tells them from blocked ones.
  if (threads_.liveLocked() <= (workerRunsOp_ ? 1u : 0u) + helpingWorkers_) {
    try {
      threads_.spawnLocked();
      return;
    } catch (const std::exception&) {
      // no thread: the watcher tries again
    }
  }
  threads_.armWatcherLocked();
}

bool OpExecutor::hasFreeCompletionLocked() const {
  return std::any_of(completed_.begin(), completed_.end(),
                     [](const auto& c) { return c.first->p2pWaiters == 0; });
}

std::pair<c10::intrusive_ptr<Work>, OpExecutor::Settle> OpExecutor::takeFreeCompletionLocked() {
  auto it = std::find_if(completed_.begin(), completed_.end(),
                         [](const auto& c) { return c.first->p2pWaiters == 0; });
  rescueCompletion_ = false;
  return takeCompletionLocked(it);
}

std::pair<c10::intrusive_ptr<Work>, OpExecutor::Settle> OpExecutor::takeCompletionLocked(
    std::deque<std::pair<c10::intrusive_ptr<Work>, Settle>>::iterator it) {
  auto c = std::move(*it);
  completed_.erase(it);
  c.first->p2pTaken = true;
  ++completionsTaken_;
  return c;
}

void OpExecutor::runCompletion(std::pair<c10::intrusive_ptr<Work>, Settle>& c, bool onWorker) {
  {
    ++tCompletingDepth;
    const bool outerOnWorker = tWorkerInCallbacks;
    tWorkerInCallbacks = outerOnWorker || onWorker;
    auto restore = c10::make_scope_exit([outerOnWorker] {
      --tCompletingDepth;
      tWorkerInCallbacks = outerOnWorker;
    });
    c.second();  // must not throw (the backend's settle catches)
    c.second = nullptr;  // its tensors go here, before mu_ (they may need the GIL)
  }
  if (onWorker) {
    std::lock_guard<std::mutex> lock(mu_);
    threads_.leaveCallbacksLocked();
  }
}

void OpExecutor::settleWhenComplete(Work* work) {
  std::pair<c10::intrusive_ptr<Work>, Settle> mine;
  {
    std::unique_lock<std::mutex> lock(mu_);
    if (work->p2pTaken) return;
    ++work->p2pWaiters;
    helpingWaitsBegun_.fetch_add(1, std::memory_order_relaxed);
    // A worker blocks here from a callback: the completions meanwhile need
    // another.
    const bool worker = tWorkerInCallbacks;
    if (worker) {
      ++helpingWorkers_;
      ensureCompleterLocked();
    }
    while (!stopping_ && !work->p2pTaken) {
      auto it = std::find_if(completed_.begin(), completed_.end(),
                             [work](const auto& c) { return c.first.get() == work; });
      if (it != completed_.end()) {
        mine = takeCompletionLocked(it);
        break;
      }
      completedCv_.wait(lock);
    }
    --work->p2pWaiters;
    if (worker) --helpingWorkers_;
    // Stopping with its completion queued: settleDropped() settles it.
  }
  if (mine.first) runCompletion(mine, false);
}

std::optional<std::thread> OpExecutor::settleAside(Work& work, Settle settle, bool always) {
  const bool taken = work.futureTaken();
  if (!taken && !always) {
    settle();
    return std::nullopt;
  }
  auto fn = std::make_shared<Settle>(std::move(settle));  // kept here should the thread fail
  auto done = std::make_shared<std::promise<void>>();
  std::future<void> settled = done->get_future();
  try {
    std::thread t([fn, done] {
      nameThisThread("rr-worker");
      ++tCompletingDepth;
      (*fn)();
      *fn = nullptr;  // its tensors go on this thread
      done->set_value();
    });
    if (taken) settled.wait_for(kRescueAfter);
    return t;
  } catch (const std::system_error&) {
    (*fn)();  // no thread to be had: here, as before
    return std::nullopt;
  }
}

std::vector<std::thread> OpExecutor::settleDropped(Stopping& s) {
  std::vector<std::thread> threads;
  for (auto& [work, settle] : s.completed) {
    if (std::optional<std::thread> t = settleAside(*work, std::move(settle))) {
      threads.push_back(std::move(*t));
    }
  }
  s.completed.clear();
  return threads;
}

std::vector<std::thread> OpExecutor::takeLateThreads() {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<std::thread> late;
  late.swap(late_);
  return late;
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
    s.completed.swap(completed_);
    nestedQueued_ = 0;
    // An op whose Work completed may still hold running_ for a moment (its
    // thread is on the way out of its run): it needs no abort, and aborting
    // for it would publish a failure on a clean exit.
    s.busy = running_ && !runningConfirmed_.load(std::memory_order_acquire);
  }
  cv_.notify_all();
  threads_.wakeWatcher();
  idleCv_.notify_all();       // a wait() in a callback for the queue
  completedCv_.notify_all();  // a helping wait for a p2p completion
  return s;
}

std::vector<std::thread> OpExecutor::failDropped(
    std::deque<Entry>& dropped, const std::function<std::exception_ptr(const Entry&)>& error) {
  // Not simply in a row: a callback of one may wait for a later one (op_executor.h).
  std::vector<std::thread> failing;
  for (auto& e : dropped) {
    std::exception_ptr why = error(e);
    if (std::optional<std::thread> t =
            settleAside(*e.work, [work = e.work, why] { work->fail(why); })) {
      failing.push_back(std::move(*t));
    }
  }
  return failing;
}

void OpExecutor::waitIdle() {
  std::unique_lock<std::mutex> lock(mu_);
  idleCv_.wait(lock, [this] { return !running_ || tRunningOps; });
}

void OpExecutor::endThreads(std::vector<std::thread> threads) {
  // From a Future's callback on one of our threads (a worker, a helping
  // wait()), another worker may be in a callback waiting for the Work this
  // thread is completing: joining it would wait forever. The workers hold
  // the object until they leave their loops (stopping_ is set), so they are
  // let go; this thread cannot join itself either.
  const bool fromCallback = settlingHere();
  for (auto& t : threads) {
    if (fromCallback || t.get_id() == std::this_thread::get_id()) {
      t.detach();
    } else {
      t.join();
    }
  }
}

}  // namespace ringreduce
