// Backend: construction, shutdown and what the bindings ask of a group.
// Issuing an op is in issue.cpp (the executor that runs it: op_executor.cpp),
// point-to-point and the barriers in collectives_p2p.cpp, the collectives in
// collectives*.cpp.
#include "backend/backend.h"

#include <torch/csrc/distributed/c10d/PrefixStore.hpp>

#include <algorithm>
#include <iterator>

#include "algorithms/algorithms.h"
#include "backend/coalesced_work.h"
#include "common/env.h"
#include "common/gil.h"
#include "common/test_hooks.h"
#include "transport/factory.h"
#include "transport/mesh.h"

namespace ringreduce {
namespace {

AllreduceAlgorithm allreduceFromEnv() {
  const std::string name = envString(kEnvAllreduce, "auto");
  AllreduceAlgorithm a = AllreduceAlgorithm::kAuto;
  TORCH_CHECK_VALUE(allreduceFromName(name, &a), "[ringreduce] ", kEnvAllreduce.name, "='", name,
                    "' is not an all-reduce algorithm (expected auto, ring, direct, two_step or "
                    "hierarchical)");
  return a;
}

}  // namespace

Backend::Backend(const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
                         std::chrono::milliseconds timeout)
    : c10d::Backend(rank, size), timeout_(timeout), store_(store) {
  TORCH_CHECK_VALUE(size >= 1 && rank >= 0 && rank < size, "[ringreduce] invalid rank ", rank,
                    " for world size ", size);
  int64_t segment = envInt(kEnvSegmentBytes, kDefaultSegmentBytes);
  TORCH_CHECK_VALUE(segment >= 64, "[ringreduce] ", kEnvSegmentBytes.name, "=", segment,
                    " is too small (at least 64 bytes)");
  segmentBytes_ = static_cast<size_t>(segment);
  allreduce_ = allreduceFromEnv();
  broadcastChain_ = testHooks().broadcastChain.load(std::memory_order_relaxed);
  // Shared memory with the ranks on this host, TCP with the others; the TCP
  // mesh underneath carries point-to-point and spreads failures.
  transport_ = connectGroup(store, rank, size, timeout);
  // A broken point-to-point connection aborts the mesh from its engine: the
  // op in flight is abandoned to the peers first, as abort() does.
  transport_->mesh().setAbortHook([t = transport_.get()] { t->abandonUnconfirmed(); });
  // The first worker starts in create(), once it can hold a weak reference.
}

c10::intrusive_ptr<Backend> Backend::create(const c10::intrusive_ptr<c10d::Store>& store,
                                                    int rank, int size,
                                                    std::chrono::milliseconds timeout) {
  auto backend = c10::make_intrusive<Backend>(store, rank, size, timeout);
  backend->executor_.start(c10::weak_intrusive_ptr<Backend>(backend));
  return backend;
}

Backend::~Backend() {
  shutdown();
}

void Backend::release_resources() {
  shutdown();
  executor_.releaseOwner();
}

void Backend::shutdown() {
  // The threads ended below may free a caller's tensor, which needs the GIL:
  // never wait for them holding it (common/gil.h).
  ReleaseGilIfHeld noGil;
  OpExecutor::Stopping stop = executor_.beginStop();
  if (stop.already) return;
  const std::string why = "the process group was shut down (destroy_process_group) with " +
                          std::to_string(stop.dropped.size() + (stop.busy ? 1 : 0)) +
                          " op(s) pending";
  if (stop.busy || !stop.dropped.empty()) {
    // Unblocks the op in flight; peers learn at once.
    transport_->abort(rankPrefix(getRank(), getSize()) + " " + why);
  }
  std::vector<std::thread> failing = executor_.failDropped(
      stop.dropped, [&why](const OpExecutor::Entry& e) {
        return transportError(e.op.ctx.message(why));  // names rank, op, tensor
      });
  // The p2p completions no thread took yet are settled too.
  std::vector<std::thread> settling = executor_.settleDropped(stop);
  // An op running on a caller's thread (inline or a helping wait()) is
  // aborted: let it leave the transport before it is closed.
  executor_.waitIdle();
  transport_->mesh().setAbortHook(nullptr);  // waits for a call in progress
  // Closed before the executor's threads end: no op runs any more, but a
  // worker's Future callback may wait for a point-to-point op that only the
  // transport's thread completes. Closing fails such ops; their Works are
  // settled on the closing thread, or aside (takeLateThreads).
  transport_->close();
  for (auto* more : {&failing, &settling}) {
    stop.threads.insert(stop.threads.end(), std::make_move_iterator(more->begin()),
                        std::make_move_iterator(more->end()));
  }
  std::vector<std::thread> late = executor_.takeLateThreads();
  stop.threads.insert(stop.threads.end(), std::make_move_iterator(late.begin()),
                      std::make_move_iterator(late.end()));
  OpExecutor::endThreads(std::move(stop.threads));
}

std::function<void()> Backend::gpuWaitCheck(const OpInfo& op) const {
  return [this, &op] {
    const std::string reason = transport_->abortReason();
    if (!reason.empty()) throwTransportError(unusable(op, reason));
    if (std::chrono::steady_clock::now() > op.deadline) {
      throwTransportError(op.ctx.message(
          "Timed out after " + std::to_string(op.timeout.count()) +
          " ms waiting for the GPU to finish the work queued before the op (its inputs are "
          "copied to the host after it)"));
    }
  };
}

void Backend::abort() {
  transport_->abort(rankPrefix(getRank(), getSize()) + " abort() was called");
  shutdown();
}

c10::intrusive_ptr<c10d::Backend> Backend::shrink(const std::vector<int64_t>& ranksToExclude,
                                                     int shrinkFlags,
                                                     const c10::intrusive_ptr<Options>&) {
  const std::string what = rankPrefix(getRank(), getSize()) + " shrink_group";
  std::vector<char> excluded(getSize(), 0);
  for (int64_t r : ranksToExclude) {
    TORCH_CHECK_VALUE(r >= 0 && r < getSize(), what, ": rank ", r, " is not in this group of ",
                      getSize());
    TORCH_CHECK_VALUE(!excluded[r], what, ": rank ", r, " is excluded twice");
    excluded[r] = 1;
  }
  TORCH_CHECK_VALUE(!excluded[getRank()], what,
                    ": this rank is excluded; only the remaining ranks call shrink_group");
  // Counted once the arguments hold: a rejected call leaves the key of the next one alike.
  std::string key = "shrink/" + std::to_string(++shrinks_) + "/without";
  int newRank = 0, newSize = 0;
  for (int r = 0; r < getSize(); ++r) {
    if (excluded[r]) {
      key += "-" + std::to_string(r);  // ranks that disagree on the set never meet
      continue;
    }
    newRank += r < getRank();
    ++newSize;
  }
  if ((shrinkFlags & kShrinkAbort) != 0) {
    transport_->abort(what + " with SHRINK_ABORT ended the ops still running");
  }
  waitForPendingWorks();  // they have failed (SHRINK_ABORT) or complete or fail now
  auto store = c10::make_intrusive<c10d::PrefixStore>(key + "/", store_);
  return Backend::create(store, newRank, newSize, timeout_);
}

void Backend::registerOnCompletionHook(
    std::function<void(std::shared_ptr<c10d::WorkInfo>)>&& hook) {
  TORCH_CHECK_VALUE(!onCompletionHook_, rankPrefix(getRank(), getSize()),
                    " registerOnCompletionHook: a hook is registered already (one per group)");
  TORCH_CHECK_VALUE(hook != nullptr, rankPrefix(getRank(), getSize()),
                    " registerOnCompletionHook: the hook is empty");
  onCompletionHook_ = std::move(hook);
}

void Backend::track(const c10::intrusive_ptr<Work>& work) {
  if (onCompletionHook_) work->setCompletionHook(onCompletionHook_);
  std::lock_guard<std::mutex> lock(trackedMu_);
  // Pruned when it doubled since the last pruning: amortised O(1) per op even
  // with many async ops outstanding.
  if (tracked_.size() >= pruneAt_) {
    tracked_.erase(std::remove_if(tracked_.begin(), tracked_.end(),
                                  [](const c10::weak_intrusive_ptr<Work>& w) {
                                    auto strong = w.lock();
                                    return !strong || strong->isCompleted();
                                  }),
                   tracked_.end());
    pruneAt_ = std::max<size_t>(64, 2 * tracked_.size());
  }
  tracked_.emplace_back(work);
  if (coalescing_) coalesced_.push_back(work);
}

void Backend::startCoalescing() {
  std::lock_guard<std::mutex> lock(trackedMu_);
  TORCH_CHECK_VALUE(!coalescing_, rankPrefix(getRank(), getSize()),
                    " startCoalescing: this group is coalescing already (call endCoalescing "
                    "first; coalescing blocks do not nest)");
  coalescing_ = true;
  coalesced_.clear();
}

c10::intrusive_ptr<c10d::Work> Backend::endCoalescing() {
  std::vector<c10::intrusive_ptr<Work>> works;
  {
    std::lock_guard<std::mutex> lock(trackedMu_);
    TORCH_CHECK_VALUE(coalescing_, rankPrefix(getRank(), getSize()),
                      " endCoalescing: startCoalescing was not called on this group");
    coalescing_ = false;
    works.swap(coalesced_);
  }
  return c10::make_intrusive<CoalescedWork>(getRank(), std::move(works));
}

c10::intrusive_ptr<c10d::Backend::Options> Backend::getBackendOptions() {
  return c10::make_intrusive<BackendOptions>(timeout_);
}

c10::intrusive_ptr<c10d::Backend> Backend::split(const c10::intrusive_ptr<c10d::Store>& store,
                                                    const std::vector<int>& ranks,
                                                    const c10::intrusive_ptr<Options>& opts) {
  const std::string what = rankPrefix(getRank(), getSize()) + " split_group";
  std::vector<int> sorted = ranks;
  std::sort(sorted.begin(), sorted.end());
  TORCH_CHECK_VALUE(!sorted.empty(), what, ": no ranks given");
  for (size_t i = 0; i < sorted.size(); ++i) {
    TORCH_CHECK_VALUE(sorted[i] >= 0 && sorted[i] < getSize(), what, ": rank ", sorted[i],
                      " is not in this group of ", getSize());
    TORCH_CHECK_VALUE(i == 0 || sorted[i] != sorted[i - 1], what, ": rank ", sorted[i],
                      " is listed twice");
  }
  auto mine = std::lower_bound(sorted.begin(), sorted.end(), getRank());
  if (mine == sorted.end() || *mine != getRank()) return nullptr;
  std::lock_guard<std::mutex> lock(splitMu_);
  if (lastSplitStore_ == store.get() && lastSplitRanks_ == sorted) {
    if (auto child = lastSplit_.lock()) return child;
  }
  const std::chrono::milliseconds timeout =
      opts && opts->timeout.count() > 0 ? opts->timeout : timeout_;
  c10::intrusive_ptr<c10d::Backend> child = Backend::create(
      store, static_cast<int>(mine - sorted.begin()), static_cast<int>(sorted.size()), timeout);
  lastSplit_ = child;
  lastSplitStore_ = store.get();
  lastSplitRanks_ = std::move(sorted);
  return child;
}

void Backend::waitForPendingWorks() {
  std::vector<c10::weak_intrusive_ptr<Work>> works;
  {
    std::lock_guard<std::mutex> lock(trackedMu_);
    works.swap(tracked_);
  }
  for (auto& weak : works) {
    auto work = weak.lock();
    if (!work) continue;
    try {
      work->wait();
    } catch (const std::exception&) {
      // Its error is its Work's to report.
    }
  }
}

c10d::ErrorType Backend::getError() {
  switch (transport_->mesh().failure()) {
    case Mesh::Failure::kTimeout: return c10d::ErrorType::TIMEOUT;
    case Mesh::Failure::kLocal: return c10d::ErrorType::COMM_ERROR;
    case Mesh::Failure::kRemote: return c10d::ErrorType::REMOTE_ERROR;
    case Mesh::Failure::kNone: break;
  }
  return c10d::ErrorType::SUCCESS;
}

std::chrono::milliseconds Backend::effective(std::chrono::milliseconds opTimeout) const {
  return opTimeout == c10d::kUnsetTimeout ? timeout_ : opTimeout;
}

uint64_t Backend::getSequenceNumberForGroup() {
  return seq_.load();
}

std::string Backend::transportKind(const std::string& device) const {
  if (device == "cuda") return cudaPathName();
  TORCH_CHECK_VALUE(device == "cpu", "[ringreduce] transport_kind: unknown device '", device,
                    "' (expected 'cpu' or 'cuda')");
  return transport_->name();
}

const WaitPolicy& Backend::waitPolicy() const {
  return transport_->mesh().waitPolicy();
}

void Backend::resetStats() {
  traffic_->reset();
  transport_->mesh().waitPolicy().resetSummary();
  transport_->ringStoreUse(true);
}

std::string Backend::listenAddress() const {
  return transport_->mesh().listenAddress();
}

std::vector<std::string> Backend::refusedConnections() const {
  return transport_->mesh().refusedConnections();
}

uint64_t Backend::refusedCount() const {
  return transport_->mesh().refusedCount();
}

}  // namespace ringreduce
