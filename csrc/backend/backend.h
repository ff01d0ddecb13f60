// Backend: the c10d::Backend behind backend="ringreduce", an adapter.
//
// Each collective method validates its arguments on the calling thread (bad
// input raises at once, naming rank, op and tensor), numbers the op, builds a
// Work and hands a closure to the group's OpExecutor (op_executor.h),
// which runs the algorithms over the transport in issue order. Every rank
// issues collectives in the same order, so the per-op sequence number names
// an op across ranks. Point-to-point ops go straight to the transport's p2p
// engine, apart from that order; the executor settles their Works.
#pragma once

#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include <atomic>
#include <condition_variable>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>

#include "algorithms/comm.h"
#include "backend/op_executor.h"
#include "backend/work.h"
#include "transport/traffic.h"
#include "transport/transport.h"

// Ends a collective's function-try-block: a check that threw before the op
// took its sequence number is a rejection at the call (rejectedAtCall).
#define RR_REJECTED_AT_CALL      \
  catch (const c10::Error& e) {  \
    rejectedAtCall(e);           \
    throw;                       \
  }

namespace ringreduce {

class WaitPolicy;

// This backend's options (getBackendOptions): torch's, with a type of its own
// so Python can copy it (split_group deep-copies the parent's).
struct BackendOptions : c10d::Backend::Options {
  explicit BackendOptions(std::chrono::milliseconds timeout = ::kBackendDefaultTimeout)
      : Options("ringreduce", timeout) {}
};

class Backend : public c10d::Backend {
 public:
  // Use create() (public only for make_intrusive): it hands the executor the
  // weak reference its threads hold the backend through, and starts it.
  Backend(const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
              std::chrono::milliseconds timeout);
  static c10::intrusive_ptr<Backend> create(const c10::intrusive_ptr<c10d::Store>& store,
                                                int rank, int size,
                                                std::chrono::milliseconds timeout);
  ~Backend() override;
  // The last strong reference is gone: shut down now. The object itself goes
  // with the last weak one (an executor thread or a helping wait() that was
  // running a callback which dropped that reference).
  void release_resources() override;

  const std::string getBackendName() const override { return "ringreduce"; }

  c10::intrusive_ptr<c10d::Work> broadcast(std::vector<at::Tensor>& tensors,
                                           const c10d::BroadcastOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allreduce(std::vector<at::Tensor>& tensors,
                                           const c10d::AllreduceOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allreduce_coalesced(
      std::vector<at::Tensor>& tensors, const c10d::AllreduceCoalescedOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> reduce(std::vector<at::Tensor>& tensors,
                                        const c10d::ReduceOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allgather(std::vector<std::vector<at::Tensor>>& outputs,
                                           std::vector<at::Tensor>& inputs,
                                           const c10d::AllgatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> _allgather_base(at::Tensor& output, at::Tensor& input,
                                                 const c10d::AllgatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allgather_coalesced(
      std::vector<std::vector<at::Tensor>>& outputLists, std::vector<at::Tensor>& inputs,
      const c10d::AllgatherOptions& opts) override;
  // all_gather_into_tensor / reduce_scatter_tensor under _coalescing_manager:
  // one op over the inputs laid end to end.
  c10::intrusive_ptr<c10d::Work> allgather_into_tensor_coalesced(
      std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
      const c10d::AllgatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> gather(std::vector<std::vector<at::Tensor>>& outputs,
                                        std::vector<at::Tensor>& inputs,
                                        const c10d::GatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> scatter(std::vector<at::Tensor>& outputs,
                                         std::vector<std::vector<at::Tensor>>& inputs,
                                         const c10d::ScatterOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> reduce_scatter(
      std::vector<at::Tensor>& outputs, std::vector<std::vector<at::Tensor>>& inputs,
      const c10d::ReduceScatterOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> _reduce_scatter_base(
      at::Tensor& output, at::Tensor& input, const c10d::ReduceScatterOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> reduce_scatter_tensor_coalesced(
      std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
      const c10d::ReduceScatterOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> alltoall_base(at::Tensor& output, at::Tensor& input,
                                               std::vector<int64_t>& outputSplits,
                                               std::vector<int64_t>& inputSplits,
                                               const c10d::AllToAllOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> alltoall(std::vector<at::Tensor>& outputs,
                                          std::vector<at::Tensor>& inputs,
                                          const c10d::AllToAllOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> send(std::vector<at::Tensor>& tensors, int dstRank,
                                      int tag) override;
  c10::intrusive_ptr<c10d::Work> recv(std::vector<at::Tensor>& tensors, int srcRank,
                                      int tag) override;
  c10::intrusive_ptr<c10d::Work> recvAnysource(std::vector<at::Tensor>& tensors,
                                               int tag) override;
  c10::intrusive_ptr<c10d::Work> barrier(const c10d::BarrierOptions& opts) override;
  // gloo's debugging barrier: rank 0 waits (up to opts.timeout, else the group
  // timeout) for every rank to arrive and raises naming the rank(s) that did
  // not (all of them with waitAllRanks, else the first); the others raise the
  // same message, or name rank 0 when it never came. Through the group's
  // store, independent of the collective queue.
  void monitoredBarrier(const c10d::BarrierOptions& opts, bool waitAllRanks = false) override;

  void setSequenceNumberForGroup() override {}
  uint64_t getSequenceNumberForGroup() override;
  void setTimeout(std::chrono::milliseconds timeout) override { timeout_ = timeout; }
  // Every Work as it is created: the completion hook, and the list
  // waitForPendingWorks reads (a mutex and a weak reference per op).
  void track(const c10::intrusive_ptr<Work>& work);

  // torch's hooks. Every Work is timed (getDuration: from the op's start to
  // its end), so enabling the timing changes nothing. The onCompletion hook
  // (one per group, registered before the ops it should see) runs on the
  // thread that completed each Work, after its Future. getError: why this
  // rank's first failed collective failed (TIMEOUT, COMM_ERROR for a failure
  // here, REMOTE_ERROR when the group's first error was another rank's), or
  // SUCCESS.
  void enableCollectivesTiming() override {}

  // dist.shrink_group: a new group of the ranks not in `ranksToExclude`,
  // renumbered in order, with its own transports (shared memory where they
  // share a host, TCP across) met through this group's store under a key of
  // its own; every remaining rank must call it with the same ranks. First the
  // ops still pending here end: SHRINK_ABORT aborts them at once; otherwise
  // they complete, or fail as they would (a lost rank is found within about a
  // second; a stopped one at the timeout). torch destroys this group after.
  bool supportsShrinking() const override { return true; }
  c10::intrusive_ptr<c10d::Backend> shrink(
      const std::vector<int64_t>& ranksToExclude, int shrinkFlags = 0,
      const c10::intrusive_ptr<Options>& optsOverride = nullptr) override;
  static constexpr int kShrinkAbort = 0x01;  // torch.distributed.SHRINK_ABORT

  // dist.split_group / DeviceMesh (torch splits only a group bound to a CUDA
  // device): a new group of `ranks` (ranks of this group; renumbered in their
  // order) met through `store`, which torch gives every member alike; nullptr
  // on a rank not in `ranks` (it touches nothing). torch may call it once per
  // device type of this group for the one backend: the same store and ranks
  // give back the same new group.
  bool supportsSplitting() const override { return true; }
  c10::intrusive_ptr<c10d::Backend> split(const c10::intrusive_ptr<c10d::Store>& store,
                                          const std::vector<int>& ranks,
                                          const c10::intrusive_ptr<Options>& opts) override;
  // This group's options (split_group copies them for the new group).
  c10::intrusive_ptr<Options> getBackendOptions() override;

  // torch's coalescing (_coalescing_manager with a device, batch_isend_irecv):
  // the ops issued on this group between the two calls run as issued (the
  // all-reduces, all_gather_single and reduce_scatter_single torch gathers
  // come as one *_coalesced op each, one op on the wire); endCoalescing
  // returns one Work for them all.
  bool supportsCoalescing() const override { return true; }
  void startCoalescing() override;
  c10::intrusive_ptr<c10d::Work> endCoalescing() override;
  void registerOnCompletionHook(
      std::function<void(std::shared_ptr<c10d::WorkInfo>)>&& hook) override;
  c10d::ErrorType getError() override;
  // Waits until every op issued on this group so far has completed or failed
  // (their errors stay with their Works). torch calls it at destroy when a
  // completion hook is registered.
  void waitForPendingWorks() override;
  // Fails pending ops, stops the worker, closes sockets. Idempotent.
  void shutdown() override;
  void abort() override;

  std::string listenAddress() const;
  // "shm" when collectives go through shared memory (every rank on this
  // host), "shm+tcp" when some peers are on this host and some elsewhere,
  // else "tcp"; for
  // device "cuda": how CUDA tensors travel ("host-staging", "none" in a CPU
  // build).
  std::string transportKind(const std::string& device = "cpu") const;
  // Empty while the group is healthy, else why this rank aborted it.
  std::string abortReason() const { return transport_->abortReason(); }
  // How this rank waits for its peers (transport/wait_policy.h).
  const WaitPolicy& waitPolicy() const;
  // How the shared-memory rings were written since creation or the last
  // reset (Transport::ringStoreUse; empty mode without rings).
  Transport::RingStoreUse ringStoreUse() const { return transport_->ringStoreUse(false); }
  std::vector<std::string> refusedConnections() const;
  // This rank's traffic on this group since creation or the last reset:
  // payload bytes sent and received, and ops issued by torch.distributed name
  // (transport/traffic.h says what counts).
  const Traffic& traffic() const { return *traffic_; }
  // Tests: helping waits for p2p Works begun (OpExecutor::helpingWaitsBegun).
  uint64_t helpingWaitsBegun() const { return executor_.helpingWaitsBegun(); }
  // Zeroes the traffic counters and the wait summary (WaitPolicy::summary).
  void resetStats();
  uint64_t refusedCount() const;

 private:
  // allreduce of one sparse COO tensor (SUM): every rank's indices and values
  // are gathered around the ring and summed in rank order, then coalesced; the
  // caller's tensor is set to the result (collectives_sparse.cpp).
  c10::intrusive_ptr<c10d::Work> allreduceSparse(std::vector<at::Tensor>& tensors,
                                                 const c10d::AllreduceOptions& opts);
  using Job = OpExecutor::Job;

  // The context of the next collective (for validation messages); notes on
  // this thread that a collective is being issued (see rejectedAtCall).
  OpContext nextContext(const char* name, TensorDesc tensor) const;
  // The checks of the collective this thread is issuing threw before makeOp
  // (a bad argument): the op takes its sequence number all the same, and the
  // error is published (Mesh::publishRejected), so peers that run the op fail
  // it at once naming this error instead of waiting for the timeout; when
  // every rank rejected it alike the group stays usable. The caller rethrows.
  void rejectedAtCall(const c10::Error& error);
  // Builds the wire identity of a collective and consumes a sequence number.
  OpInfo makeOp(OpKind kind, const char* name, const at::Tensor& t, uint8_t reduceOp,
                uint64_t total, int32_t root = kNoRoot);
  // Runs argument checks that depend on this rank's role in a rooted op (the
  // root's lists, a non-root broadcast's writable input): the same call
  // passes them on the other ranks, which are then in the op. A failure aborts
  // the group with this rank's message (the peers would otherwise wait for
  // the timeout), then raises here as usual.
  void roleChecks(const OpContext& ctx, int root, const std::function<void()>& checks);
  // Builds the op's Work and hands the op to the executor (a synchronous op
  // finding it idle runs inline on the caller's thread).
  // `stage` holds the host twins of an op on CUDA tensors (the Job uses the
  // twins; `outputs` stay the caller's tensors). `inputs`: what a profiler
  // trace shows (the outputs when empty).
  c10::intrusive_ptr<c10d::Work> enqueue(OpInfo op, std::chrono::milliseconds opTimeout,
                                         c10d::OpType type, std::vector<at::Tensor> outputs,
                                         bool asyncOp, Job run, DeviceStage stage = {},
                                         const std::vector<at::Tensor>& inputs = {});
  // The executor's RunOp: runs the op over the transport, confirms it, and on
  // a failure aborts the group (its peers fail now, not at the timeout).
  std::exception_ptr runOp(OpExecutor::Entry& e);
  c10::intrusive_ptr<c10d::Work> postRecv(std::vector<at::Tensor>& tensors, int srcRank,
                                          int tag);
  // The wire identity of a point-to-point op ("send", "recv"; `where` names
  // the peer and tag), counted and numbered in the p2p sequence.
  OpInfo makeP2POp(const char* name, const at::Tensor& t, const std::string& where);
  // What an op moves data through: collectives run over it (runOp), point-to-
  // point ops post through it; it counts every payload byte (algorithms/comm.h).
  Comm commFor(const OpInfo& op) const {
    return Comm{*transport_, op, getRank(), getSize(), segmentBytes_, traffic_, allreduce_,
                broadcastChain_};
  }
  std::chrono::milliseconds effective(std::chrono::milliseconds opTimeout) const;
  // What a CUDA op's wait for its copies to the host checks (DeviceStage::
  // beforeRun): the group aborted, the op's deadline passed.
  std::function<void()> gpuWaitCheck(const OpInfo& op) const;
  // Works not yet seen completed (track, waitForPendingWorks); completed ones
  // are dropped as new ones come.
  std::mutex trackedMu_;
  std::vector<c10::weak_intrusive_ptr<Work>> tracked_;  // guarded by trackedMu_
  size_t pruneAt_ = 64;                                      // guarded by trackedMu_
  // Between startCoalescing and endCoalescing: the Works issued (guarded by trackedMu_).
  bool coalescing_ = false;
  std::vector<c10::intrusive_ptr<Work>> coalesced_;
  // The last split (split): torch calls it once per device type for one
  // backend. Weak: the new group is its users' to destroy. Its store is kept
  // alive by it, so the address is not reused while it lives.
  std::mutex splitMu_;
  c10d::Store* lastSplitStore_ = nullptr;                 // guarded by splitMu_; compared only
  std::vector<int> lastSplitRanks_;                       // guarded by splitMu_
  c10::weak_intrusive_ptr<c10d::Backend> lastSplit_{
      c10::intrusive_ptr<c10d::Backend>()};               // guarded by splitMu_
  std::unique_ptr<Transport> transport_;  // per peer: shared memory or TCP (factory.h)
  std::chrono::milliseconds timeout_;
  c10::intrusive_ptr<c10d::Store> store_;  // the group's, for shrink()
  int shrinks_ = 0;                        // shrink() calls, each with a key of its own
  size_t segmentBytes_;
  AllreduceAlgorithm allreduce_;  // RINGREDUCE_ALLREDUCE, read once
  bool broadcastChain_;           // testHooks().broadcastChain, read once
  // Atomics: updated by the worker, transport threads and callers. Shared with
  // the point-to-point callbacks, which may run after the backend is gone (a
  // callback before them on the p2p thread destroyed the group).
  std::shared_ptr<Traffic> traffic_ = std::make_shared<Traffic>();

  // Collective numbering (any issuing thread): the last sequence number
  // issued. Point-to-point and monitored-barrier numbering likewise.
  std::atomic<uint64_t> seq_{0};
  std::atomic<uint64_t> p2pSeq_{0};
  std::atomic<uint64_t> monitoredSeq_{0};  // monitored barriers called so far
  // Runs the collectives (runOp) in issue order; its threads hold this
  // backend weakly (create()).
  OpExecutor executor_{[this](OpExecutor::Entry& e) { return runOp(e); }};
};

}  // namespace ringreduce
