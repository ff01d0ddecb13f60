// The Work a collective returns. It is always completed, with the error if the
// op failed; its future's value is the output tensor list (DDP reads it).
// For CUDA tensors (a non-empty DeviceStage) it behaves as NCCL's: wait()
// waits on the host for the CPU part only, then makes the caller's current
// stream wait for the copies back; the Future records CUDA events.
#pragma once

#include <torch/csrc/distributed/c10d/Work.hpp>
#include <torch/version.h>

#include <atomic>
#include <condition_variable>
#include <functional>
#include <mutex>

#include "backend/device_stage.h"
#include "common/errors.h"

namespace ringreduce {

// The op type of reduce_scatter_tensor_coalesced: torch 2.13 names it
// (REDUCE_SCATTER_TENSOR_COALESCED); 2.11 has no such type, and the op is
// then reported as the reduce-scatter of one flat tensor it is.
#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 13)
constexpr c10d::OpType kReduceScatterCoalescedType = c10d::OpType::REDUCE_SCATTER_TENSOR_COALESCED;
#else
constexpr c10d::OpType kReduceScatterCoalescedType = c10d::OpType::_REDUCE_SCATTER_BASE;
#endif

class Work : public c10d::Work {
 public:
  // `profiled`: the tensors a profiler trace shows as the op's inputs (the
  // outputs when empty); the op appears as "ringreduce:<op>" in torch.profiler
  // and torch.autograd.profiler traces, as gloo's do as "gloo:<op>".
  Work(OpContext ctx, c10d::OpType type, std::vector<at::Tensor> outputs,
           DeviceStage stage = {}, const std::vector<at::Tensor>& profiled = {});

  bool isCompleted() override;
  bool isSuccess() const override;
  std::exception_ptr exception() const override;
  int sourceRank() const override;
  std::vector<at::Tensor> result() override;
  // Blocks until done (or the timeout passes: then throws, the op keeps
  // running) and rethrows the op's error.
  bool wait(std::chrono::milliseconds timeout = kNoTimeout) override;
  // CUDA: the caller's current stream waits for the copies back (torch's
  // default puts nothing on it).
  void synchronize() override;
  // CPU tensors: torch's (a spin kernel on the current stream, released when
  // the Future completes). CUDA tensors: the copies back are queued on our
  // stream only once the op's CPU part is done, after the Future's release
  // would let the caller's stream run, so the host waits for that part (as
  // wait() does) and the caller's stream then waits for the copies.
  void blockCurrentStream() override;
  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override;
  uint64_t getSequencenumber() const override;
  // Milliseconds from the op's start (its run on a worker or the calling
  // thread; a point-to-point op's post) to its completion or failure; raises
  // while it is still running.
  float getDuration() const override;

  // The op starts running now (it was created when issued).
  void markStarted();
  // Called with the op's WorkInfo once it completed or failed, after its
  // Future (torch's onCompletion hook; set before the Work is returned).
  using CompletionHook = std::function<void(std::shared_ptr<c10d::WorkInfo>)>;
  void setCompletionHook(CompletionHook hook) { completionHook_ = std::move(hook); }

  DeviceStage& stage() { return stage_; }
  // The backend's count of Works being settled whose Future was taken
  // (Backend::settle): settle() calls lookedForFuture(), which marks the
  // look and then reads whether the Future was taken; a getFuture() after
  // that look and before the Work is settled calls the hook (set once,
  // before the Work is returned), which counts it late. Both orders are
  // sequentially consistent (Dekker): the look or the hook sees the Future
  // taken, and counted (guarded by the backend's lock) says whether one of
  // them already counted it.
  void setLateTaken(std::function<void(Work*)> hook) { lateTaken_ = std::move(hook); }
  bool lookedForFuture() {
    looked_.store(1);
    return futureTaken_.load();
  }
  bool lookOpen() const { return looked_.load() == 1; }
  // getFuture() was called: its callbacks may block (shutdown() fails such a
  // dropped op on a thread of its own).
  bool futureTaken() const { return futureTaken_.load(); }
  void lookClosed() { looked_.store(2); }
  bool counted = false;  // guarded by the executor's mu_
  // A point-to-point op's, guarded by the executor's mu_: the threads in a
  // helping wait for its completion, and whether that was taken to be
  // settled (OpExecutor::p2pCompletion).
  size_t p2pWaiters = 0;
  bool p2pTaken = false;

  // What wait() (without a timeout) calls before it blocks (a helping wait,
  // op_executor.h): a collective's runs this op, and those queued before it,
  // on the waiting thread when no other thread runs one; a point-to-point
  // op's settles its Work here once the transport completes it. Either saves
  // thread hand-offs of an op waited for at once. Set once, before the work
  // is returned.
  void setHelper(std::function<void(Work*)> helper) { helper_ = std::move(helper); }

  // Called once, by the thread that settles the Work; ends the profiler's
  // event.
  void complete(int sourceRank = -1);
  void fail(std::exception_ptr error);

  // "ringreduce:all_reduce" and so on: the profiler's name of an op type.
  static const char* profilingTitle(c10d::OpType type);

 private:
  void endProfiling();
  void settleFuture(const std::function<void()>& settle);
  void markFinished();
  void runCompletionHook();

  std::function<void(Work*)> helper_;
  CompletionHook completionHook_;
  const OpContext ctx_;
  std::vector<at::Tensor> outputs_;
  DeviceStage stage_;
  c10::intrusive_ptr<c10::ivalue::Future> future_;
  // getFuture() was called: the Future may have callbacks, and one may block
  // in torch's Future::wait(), which does not pass through wait() here.
  std::atomic<bool> futureTaken_{false};
  std::function<void(Work*)> lateTaken_;
  std::atomic<int> looked_{0};  // 0: settle() has not looked; 1: looked; 2: settled
  // Locking: doneMu_ guards done_, sourceRank_ and error_ (doneCv_ waits on
  // it). It is never held while the Future completes: its callbacks run
  // outside it (they may call back into this Work).
  mutable std::mutex doneMu_;
  std::condition_variable doneCv_;
  bool done_ = false;        // guarded by doneMu_
  int sourceRank_ = -1;      // guarded by doneMu_
  std::exception_ptr error_;  // guarded by doneMu_
  // The op's start and end, for getDuration and the completion hook: started_
  // is written before the op runs and read after done_ (doneMu_ orders both).
  std::chrono::steady_clock::time_point started_;   // guarded by doneMu_
  std::chrono::steady_clock::time_point finished_;  // guarded by doneMu_
};

}  // namespace ringreduce
