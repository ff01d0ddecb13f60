// RingBackend's op queue: numbering a collective, queueing it or running it
// inline, the worker threads that run the queue in issue order, settling each
// Work (its Future's callbacks), and the watcher that rescues a queue held up
// by callbacks waiting for ops behind their own.
#include "backend/ring_backend.h"

#include <ATen/core/LegacyTypeDispatch.h>
#include <c10/util/ScopeExit.h>

#include <algorithm>
#include <system_error>

#include "common/rescue.h"
#include "common/test_hooks.h"
#include "common/thread_name.h"
#include "transport/mesh.h"

namespace ringreduce {
namespace {

// Whether this thread is inside runEntry (the worker, an inline op or a
// helping wait()): shutdown() from there must not wait for its own op to end,
// and a wait() there must not run ops itself. (A Work's Future callbacks run
// after runEntry, so a wait() in them may.)
thread_local bool tRunningOps = false;
// Whether this thread is a worker running a Future's callbacks.
thread_local bool tWorkerInCallbacks = false;
// How many Works this thread is settling (nested: a callback's own op).
thread_local int tSettlingDepth = 0;

// The collective this thread is issuing: set by nextContext, taken by makeOp
// (which numbers it), queued or run by enqueue.
struct Issuing {
  const RingBackend* backend = nullptr;
  bool taken = true;
  uint64_t seq = 0;     // makeOp's number
  bool queued = false;  // enqueue has it
};
thread_local Issuing issuing;

}  // namespace

bool RingBackend::runningOpsHere() {
  return tRunningOps;
}

bool RingBackend::settlingHere() {
  return tSettlingDepth > 0;
}

void RingBackend::spawnWorkerLocked() {
  // Each worker keeps the object (not the backend: it still shuts down with
  // its last strong reference) until it leaves its loop, so shutdown() may
  // detach it (from a callback, where joining could wait for this thread).
  workers_.emplace_back([this, weak = weakSelf()] {
    nameThisThread("rr-worker");
    workerLoop(weak);
  });
}

void RingBackend::ensureWorkerLocked() {
  // A Future callback on a worker queued this op and may block until it
  // completes (torch's PowerSGD hook waits on a new all_reduce's Future in its
  // `then` callback). When every worker is inside callbacks, another one runs
  // the queue meanwhile. Only then: a worker that settles a Work while the
  // caller queues its next op (DDP's buckets, an async op waited at once) is
  // back in its loop within microseconds, and a thread per such op cost 10 us.
  if (tWorkerInCallbacks && !stopping_ && !queue_.empty() &&
      workersInCallbacks_ >= workers_.size()) {
    spawnWorkerLocked();
  }
}

void RingBackend::armWatcherLocked() {
  if (stopping_) return;
  if (!watcher_.joinable()) {
    try {
      watcher_ = std::thread([this, weak = weakSelf()] {
        nameThisThread("rr-watch");
        watcherLoop(weak);
      });
    } catch (const std::system_error&) {
      // No thread to be had: the ops go on without the rescue (a callback
      // blocked as described waits, as before the watcher).
    }
  } else if (watcherIdle_) {
    watcherIdle_ = false;  // at most one wake-up until it is idle again
    watchCv_.notify_one();
  }
}

void RingBackend::watcherLoop(const c10::weak_intrusive_ptr<RingBackend>& weak) {
  std::unique_lock<std::mutex> lock(mu_);
  while (!stopping_) {
    if (!watchingLocked()) {
      watcherIdle_ = true;
      watchCv_.wait(lock, [this] { return stopping_ || !watcherIdle_; });
      continue;
    }
    // Sleeps the whole period (no wake-up when the Work settles: that would
    // cost a context switch per op under DDP, whose bucket Futures are taken).
    // Longer when the rescue needs a new worker past the first few
    // (common/rescue.h: slow callbacks settle a Work within it).
    const uint64_t mark = settled_;
    const auto wait =
        workersInCallbacks_ >= workers_.size() ? rescueStall(workers_.size()) : kRescueAfter;
    watchCv_.wait_until(lock, std::chrono::steady_clock::now() + wait,
                        [this] { return stopping_; });
    if (stopping_ || settled_ != mark || !stalledLocked()) continue;
    // Every finished op's Future is complete, so Futures still complete in
    // issue order; the callbacks of this op may run before the held ones end,
    // as with gloo's two threads. A worker runs it (a new one when every
    // worker is in callbacks), not the watcher: that op's callbacks may wait
    // in turn for the next op (a chain), which the watcher then rescues too.
    // Callbacks that are only slow get rescued too, so a new worker past the
    // first few needs a longer stall (above). With no thread to be had the
    // watcher runs the op itself, as the only way left.
    bool freeWorker = workersInCallbacks_ < workers_.size();
    if (!freeWorker && wait < rescueStall(workers_.size())) {
      continue;  // the workers filled up while it slept: wait the longer stall
    }
    if (!freeWorker) {
      try {
        spawnWorkerLocked();
        freeWorker = true;
      } catch (const std::system_error&) {
      }
    }
    if (!freeWorker) {
      {
        Entry e = popFrontLocked();
        lock.unlock();
        c10::intrusive_ptr<RingBackend> self = weak.lock();
        runAndSettle(e, true);
      }  // the entry goes before mu_ is taken again (its tensors may need the GIL)
      lock.lock();
      continue;
    }
    rescue_ = true;
    rescueMark_ = settled_;
    cv_.notify_all();
  }
  watcherIdle_ = false;
}

OpContext RingBackend::nextContext(const char* name, TensorDesc tensor) const {
  issuing = Issuing{this, false};
  return OpContext{getRank(), getSize(), name, seq_ + 1, std::move(tensor)};
}

void RingBackend::rejectedAtCall(const c10::Error& error) {
  if (issuing.backend != this || issuing.queued) return;
  uint64_t seq = issuing.seq;
  if (!issuing.taken) {
    issuing.taken = true;
    std::lock_guard<std::mutex> lock(mu_);
    seq = ++seq_;
  }
  // Else it threw after makeOp numbered it and before enqueue (the host
  // copies of CUDA tensors are allocated there: pinned memory ran out): the
  // number is used all the same, and published as rejected like the rest.
  issuing.queued = true;
  // A role check aborted the group already (roleChecks): nothing to add.
  if (getSize() > 1 && transport_->abortReason().empty()) {
    transport_->mesh().publishRejected(seq, error.what_without_backtrace());
  }
}

OpInfo RingBackend::makeOp(OpKind kind, const char* name, const at::Tensor& t, uint8_t reduceOp,
                           uint64_t total, int32_t root) {
  traffic_->countOp(name);
  OpInfo op;
  std::lock_guard<std::mutex> lock(mu_);
  op.ctx = OpContext{getRank(), getSize(), name, ++seq_,
                     t.defined() ? TensorDesc(t) : TensorDesc()};
  if (issuing.backend == this && !issuing.taken) {
    issuing.taken = true;
    issuing.seq = op.ctx.seq;
  }
  std::atomic<int64_t>& reject = testHooks().rejectAfterNumbering;
  TORCH_CHECK_VALUE(reject.load(std::memory_order_relaxed) <= 0 || reject.fetch_sub(1) <= 0,
                    op.ctx.message("rejected after numbering (testing)"));
  op.kind = kind;
  op.dtype = t.defined() ? static_cast<uint8_t>(t.scalar_type()) : 0;
  op.reduceOp = reduceOp;
  op.root = root;
  op.total = total;
  return op;
}

void RingBackend::roleChecks(const OpContext& ctx, int root,
                             const std::function<void()>& checks) {
  try {
    checks();
  } catch (const c10::Error& err) {
    if (getSize() > 1) {
      const std::string who = getRank() == root ? "the root" : "rank " + std::to_string(getRank());
      transport_->abort(std::string(err.what_without_backtrace()) + " (" + who +
                        " rejected its arguments; its peers cannot finish " + ctx.op + "#" +
                        std::to_string(ctx.seq) + ")");
    }
    throw;
  }
}

c10::intrusive_ptr<c10d::Work> RingBackend::enqueue(OpInfo op, std::chrono::milliseconds opTimeout,
                                                    c10d::OpType type,
                                                    std::vector<at::Tensor> outputs, bool asyncOp,
                                                    Job run, DeviceStage stage,
                                                    const std::vector<at::Tensor>& inputs) {
  if (issuing.backend == this && issuing.seq == op.ctx.seq) issuing.queued = true;
  auto work = c10::make_intrusive<RingWork>(op.ctx, type, std::move(outputs), std::move(stage),
                                            inputs);
  track(work);
  Entry e{std::move(op), effective(opTimeout), work, std::move(run), tSettlingDepth > 0};
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (stopping_) {
      work->fail(transportError(e.op.ctx.message("the process group was shut down")));
      return work;
    }
    if (asyncOp || !queue_.empty() || running_ || !(e.nested || mayRunLocked())) {
      work->setLateTaken([gate = gate_](RingWork* w) {
        c10::intrusive_ptr<RingBackend> self = gate->strong();
        if (!self) return;
        std::lock_guard<std::mutex> lock(self->mu_);  // released before `self`
        self->countTakenLocked(*w);
      });
      work->setHelper([gate = gate_](RingWork* w) {
        if (tRunningOps) return;
        // Dropping `self` may shut the backend down here (a callback dropped
        // its last other reference); nothing after touches it.
        if (c10::intrusive_ptr<RingBackend> self = gate->strong()) self->runQueuedUntil(w);
      });
      if (e.nested) ++nestedQueued_;
      queue_.push_back(std::move(e));
      ensureWorkerLocked();
      if (settlingTaken_ > 0) armWatcherLocked();
      cv_.notify_one();
      return work;
    }
    running_ = true;  // keeps the worker off while this op runs here
    runningConfirmed_.store(false, std::memory_order_relaxed);
  }
  runAndSettle(e, false);
  return work;
}

void RingBackend::runAndSettle(Entry& e, bool onWorker) {
  std::exception_ptr error;
  {
    auto finish = c10::make_scope_exit([this, onWorker] { finishRunning(onWorker); });
    error = runEntry(e);
  }
  settle(e, error, onWorker);
}

void RingBackend::finishRunning(bool onWorker) {
  bool wake;
  {
    std::lock_guard<std::mutex> lock(mu_);
    running_ = false;
    if (onWorker) ++workersInCallbacks_;
    // Its Work is settled next, by this thread (settle() ends it): until
    // then no other thread starts the next op (mayRunLocked), so Futures
    // complete in issue order.
    ++settling_;
    ++unmarked_;
    wake = !queue_.empty() || stopping_;
  }
  // Only the worker waits on cv_, and only for queued work: waking it for
  // nothing would cost a context switch per small op (measured ~10% of a
  // 4 KiB all-reduce's time on 2 ranks).
  if (wake) {
    cv_.notify_one();
    idleCv_.notify_all();
  }
}

std::exception_ptr RingBackend::runEntry(Entry& e) {
  const bool outer = tRunningOps;
  tRunningOps = true;
  auto restore = c10::make_scope_exit([outer] { tRunningOps = outer; });
  // The op writes into the caller's tensors outside autograd, as gloo's
  // kernels do: leaves that require grad, their views and AVG's in-place
  // division are fine in any grad mode of the calling thread. Below the
  // ADInplaceOrView key too: an inference tensor (made under
  // torch.inference_mode) is written from a thread that is not in that mode
  // (it used to fail the op and abort the group: outputs of all_gather, a
  // non-contiguous tensor, a CUDA tensor's copy back), and no version counter
  // moves, as when the transport writes a contiguous tensor's memory.
  at::NoGradGuard noGrad;
  at::AutoDispatchBelowADInplaceOrView raw;
  e.op.timeout = e.timeout;
  e.op.deadline = std::chrono::steady_clock::now() + e.timeout;
  e.work->markStarted();
  Comm comm{*transport_, e.op, getRank(), getSize(), segmentBytes_, traffic_.get(), allreduce_};
  DeviceStage& stage = e.work->stage();
  try {
    stage.beforeRun(gpuWaitCheck(e.op));  // CUDA: the copies to the host are done
    e.run(comm);
    transport_->confirm(e.op);
    runningConfirmed_.store(true, std::memory_order_release);
    stage.afterRun();  // CUDA: the results go back only after a successful op
    return nullptr;
  } catch (const std::exception& err) {
    // A rank that fails mid-op has left the protocol: abort, so its peers
    // fail now instead of at the timeout.
    transport_->abort(e.op.ctx.message(err.what()));
    return std::current_exception();
  } catch (...) {
    // Never past here: every run is followed by its settle().
    transport_->abort(e.op.ctx.message("the op threw a non-standard exception"));
    return std::current_exception();
  }
}

void RingBackend::settle(Entry& e, std::exception_ptr error, bool onWorker) {
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
  RingWork& work = *e.work;
  auto done = c10::make_scope_exit([this, onWorker, outerOnWorker, &work] {
    --tSettlingDepth;
    tWorkerInCallbacks = outerOnWorker;
    bool wake;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (onWorker) --workersInCallbacks_;
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

void RingBackend::countTakenLocked(RingWork& work) {
  if (work.counted || !work.lookOpen()) return;
  work.counted = true;
  ++settlingTaken_;
  if (!queue_.empty()) armWatcherLocked();
}

RingBackend::Entry RingBackend::popFrontLocked() {
  Entry e = std::move(queue_.front());
  queue_.pop_front();
  if (e.nested) --nestedQueued_;
  rescue_ = false;  // whoever took the front op, the watcher's hand-off is used up
  running_ = true;
  runningConfirmed_.store(false, std::memory_order_relaxed);
  return e;
}

void RingBackend::runQueuedUntil(const RingWork* work) {
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
          return;  // already taken by the worker (running or done)
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
      e = popFrontLocked();  // running_ keeps the worker off, as for an inline op
    }
    runAndSettle(e, false);
    if (e.work.get() == work) return;
  }
}

void RingBackend::workerLoop(const c10::weak_intrusive_ptr<RingBackend>& weak) {
  while (true) {
    Entry e;
    {
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait(lock, [this] {
        return stopping_ ||
               (!queue_.empty() && !running_ && (mayRunLocked() || rescuingLocked()));
      });
      if (queue_.empty()) return;
      e = popFrontLocked();
    }
    // A strong reference for the op and its callbacks: one may drop the last
    // other one. Dropping this one may then shut the backend down here;
    // `weak` keeps the object, and the loop ends on stopping_.
    c10::intrusive_ptr<RingBackend> self = weak.lock();
    runAndSettle(e, true);
  }
}

}  // namespace ringreduce
