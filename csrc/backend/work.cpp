#include "backend/work.h"

#include "common/test_hooks.h"

#include <ATen/core/jit_type.h>
#include <c10/util/Logging.h>
#include <c10/util/ScopeExit.h>

namespace ringreduce {

namespace {

// The Work whose Future this thread is completing (its callbacks run here).
thread_local const Work* tSettling = nullptr;

std::vector<c10::Device> devicesOf(const DeviceStage& stage) {
  auto device = stage.device();
  return device ? std::vector<c10::Device>{*device} : std::vector<c10::Device>{};
}

}  // namespace

const char* Work::profilingTitle(c10d::OpType type) {
  using T = c10d::OpType;
  switch (type) {
    case T::BROADCAST: return "ringreduce:broadcast";
    case T::ALLREDUCE: return "ringreduce:all_reduce";
    case T::ALLREDUCE_COALESCED: return "ringreduce:all_reduce_coalesced";
    case T::REDUCE: return "ringreduce:reduce";
    case T::ALLGATHER:
    case T::_ALLGATHER_BASE: return "ringreduce:all_gather";
    case T::ALLGATHER_COALESCED: return "ringreduce:all_gather_coalesced";
    case T::GATHER: return "ringreduce:gather";
    case T::SCATTER: return "ringreduce:scatter";
    case T::REDUCE_SCATTER:
    case T::_REDUCE_SCATTER_BASE:
#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 13)
    case T::REDUCE_SCATTER_TENSOR_COALESCED:
#endif
      return "ringreduce:reduce_scatter";
    case T::ALLTOALL:
    case T::ALLTOALL_BASE: return "ringreduce:all_to_all";
    case T::SEND: return "ringreduce:send";
    case T::RECV: return "ringreduce:recv";
    // torch's other backends name a receive from any source so ("gloo:recvAnySource").
    case T::RECVANYSOURCE: return "ringreduce:recvAnySource";
    case T::BARRIER: return "ringreduce:barrier";
    default: return "ringreduce:unknown";
  }
}

Work::Work(OpContext ctx, c10d::OpType type, std::vector<at::Tensor> outputs,
                   DeviceStage stage, const std::vector<at::Tensor>& profiled)
    // c10d::Work starts a RecordFunction with the title and the inputs' shapes
    // when a profiler is active (a thread-local check otherwise).
    : c10d::Work(ctx.rank, type, profilingTitle(type),
                 std::optional<std::vector<at::Tensor>>(profiled.empty() ? outputs : profiled)),
      ctx_(std::move(ctx)),
      outputs_(std::move(outputs)),
      stage_(std::move(stage)),
      future_(c10::make_intrusive<c10::ivalue::Future>(
          c10::ListType::ofTensors(), devicesOf(stage_))),
      started_(std::chrono::steady_clock::now()),
      finished_(started_) {
  std::atomic<int64_t>& throwing = testHooks().throwingCallbacks;
  if (throwing.load(std::memory_order_relaxed) > 0 && throwing.fetch_sub(1) > 0) {
    future_->addCallback(
        [](c10::ivalue::Future&) { throw std::runtime_error("test: a throwing callback"); });
  }
}


bool Work::isCompleted() {
  std::lock_guard<std::mutex> lock(doneMu_);
  // A CUDA op is complete once its copies back have run on the GPU too.
  return done_ && (error_ || stage_.query());
}

bool Work::isSuccess() const {
  std::lock_guard<std::mutex> lock(doneMu_);
  return done_ && !error_;
}

std::exception_ptr Work::exception() const {
  std::lock_guard<std::mutex> lock(doneMu_);
  return error_;
}

int Work::sourceRank() const {
  std::lock_guard<std::mutex> lock(doneMu_);
  return sourceRank_;
}

std::vector<at::Tensor> Work::result() {
  return outputs_;
}

bool Work::wait(std::chrono::milliseconds timeout) {
  std::unique_lock<std::mutex> lock(doneMu_);
  if (tSettling == this) {
    // A callback of this Work's own Future: the op's outcome is settled (the
    // Future is complete), done_ comes once the callbacks return.
    if (error_) std::rethrow_exception(error_);
    return true;
  }
  if (timeout == kNoTimeout && !done_ && helper_) {
    lock.unlock();
    helper_(this);
    lock.lock();
  }
  if (timeout == kNoTimeout) {
    doneCv_.wait(lock, [this] { return done_; });
  } else if (!doneCv_.wait_for(lock, timeout, [this] { return done_; })) {
    throwTransportError(ctx_.message("Timed out after " + std::to_string(timeout.count()) +
                                     " ms in wait(); the op is still running"));
  }
  if (error_) {
    std::rethrow_exception(error_);
  }
  lock.unlock();
  stage_.blockCurrentStream();  // CUDA: the caller's stream waits, the host does not
  return true;
}

void Work::synchronize() {
  stage_.blockCurrentStream();
}

void Work::blockCurrentStream() {
  if (!stage_.device()) {
    c10d::Work::blockCurrentStream();
    return;
  }
  wait();
}

c10::intrusive_ptr<c10::ivalue::Future> Work::getFuture() {
  futureTaken_.store(true);
  // Taken while settle() completes the Future: its callbacks may still be
  // attached and run there (see setLateTaken).
  if (looked_.load() == 1 && lateTaken_) lateTaken_(this);
  return future_;
}

uint64_t Work::getSequencenumber() const {
  return ctx_.seq;
}

void Work::endProfiling() {
  if (recordFunctionEndCallback_) {
    recordFunctionEndCallback_();
    recordFunctionEndCallback_ = nullptr;
  }
}

// The Future completes before wait() can return (as gloo's works do), so
// `work.wait(); work.get_future().value()` never finds it pending.
void Work::markStarted() {
  std::lock_guard<std::mutex> lock(doneMu_);
  started_ = std::chrono::steady_clock::now();
}

void Work::markFinished() {
  std::lock_guard<std::mutex> lock(doneMu_);
  finished_ = std::chrono::steady_clock::now();
}

float Work::getDuration() const {
  std::lock_guard<std::mutex> lock(doneMu_);
  TORCH_CHECK(done_, ctx_.message("getDuration(): the op has not completed yet"));
  return std::chrono::duration<float, std::milli>(finished_ - started_).count();
}

// Runs last, once the Work is done: a hook that throws is logged, as a
// Future's callback that throws is, and changes nothing.
void Work::runCompletionHook() {
  if (!completionHook_) return;
  std::shared_ptr<c10d::WorkInfo> info;
  {
    std::lock_guard<std::mutex> lock(doneMu_);
    info = std::make_shared<c10d::WorkInfo>(opType_, ctx_.seq, started_, finished_,
                                            finished_ - started_);
  }
  try {
    completionHook_(std::move(info));
  } catch (const std::exception& err) {
    TORCH_WARN(ctx_.message(std::string("the onCompletion hook raised: ") + err.what()));
  }
}

void Work::complete(int sourceRank) {
  markFinished();
  endProfiling();
  {
    std::lock_guard<std::mutex> lock(doneMu_);
    sourceRank_ = sourceRank;
  }
  // CUDA: the Future's events are recorded on the stream of the copies back.
  stage_.onInternalStream(
      [this] { settleFuture([this] { future_->markCompleted(c10::IValue(outputs_)); }); });
  {
    std::lock_guard<std::mutex> lock(doneMu_);
    done_ = true;
  }
  doneCv_.notify_all();
  runCompletionHook();
}

void Work::fail(std::exception_ptr error) {
  markFinished();
  endProfiling();
  {
    std::lock_guard<std::mutex> lock(doneMu_);
    error_ = error;  // for a wait() in the Future's callbacks
  }
  settleFuture([this, &error] {
    if (!future_->completed()) future_->setError(error);
  });
  {
    std::lock_guard<std::mutex> lock(doneMu_);
    done_ = true;
  }
  doneCv_.notify_all();
  runCompletionHook();
}

// Completing the Future runs its callbacks inline on this thread (the
// worker, a transport's thread or the caller). The op's outcome is settled by
// then, so a callback that throws (a raw C++ addCallback; torch's `then` and
// Python's add_done_callback catch their own) must neither fail a finished op
// nor escape: on the worker that would be std::terminate, and done_ would
// never be set, leaving wait() blocked. Log it as Python's add_done_callback
// does; the callbacks after it in the Future's list do not run.
void Work::settleFuture(const std::function<void()>& settle) {
  const Work* outer = tSettling;
  tSettling = this;
  auto restore = c10::make_scope_exit([outer] { tSettling = outer; });
  try {
    settle();
  } catch (const std::exception& err) {
    LOG(ERROR) << ctx_.message(std::string("a callback of this op's Future threw, ignored: ") +
                               err.what());
  } catch (...) {
    LOG(ERROR) << ctx_.message("a callback of this op's Future threw a non-std exception, ignored");
  }
}

}  // namespace ringreduce
