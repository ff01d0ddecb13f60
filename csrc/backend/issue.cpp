// Issuing a collective on Backend: its number and context, a rejection
// at the call published to the peers, the Work, and how the executor runs it
// (runOp: the op over the transport, its final check, a failure aborting the
// group). The executor itself (queue, workers, settling) is op_executor.cpp.
#include "backend/backend.h"

#include <ATen/core/LegacyTypeDispatch.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include "common/test_hooks.h"
#include "transport/mesh.h"

namespace ringreduce {
namespace {

// The collective this thread is issuing: set by nextContext, taken by makeOp
// (which numbers it), queued or run by enqueue.
struct Issuing {
  const Backend* backend = nullptr;
  bool taken = true;
  uint64_t seq = 0;     // makeOp's number
  bool queued = false;  // enqueue has it
};
thread_local Issuing issuing;

}  // namespace

OpContext Backend::nextContext(const char* name, TensorDesc tensor) const {
  issuing = Issuing{this, false};
  return OpContext{getRank(), getSize(), name, seq_.load() + 1, std::move(tensor)};
}

void Backend::rejectedAtCall(const c10::Error& error) {
  if (issuing.backend != this || issuing.queued) return;
  uint64_t seq = issuing.seq;
  if (!issuing.taken) {
    issuing.taken = true;
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

OpInfo Backend::makeOp(OpKind kind, const char* name, const at::Tensor& t, uint8_t reduceOp,
                           uint64_t total, int32_t root) {
  traffic_->countOp(name);
  OpInfo op;
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

void Backend::roleChecks(const OpContext& ctx, int root,
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

c10::intrusive_ptr<c10d::Work> Backend::enqueue(OpInfo op, std::chrono::milliseconds opTimeout,
                                                    c10d::OpType type,
                                                    std::vector<at::Tensor> outputs, bool asyncOp,
                                                    Job run, DeviceStage stage,
                                                    const std::vector<at::Tensor>& inputs) {
  if (issuing.backend == this && issuing.seq == op.ctx.seq) issuing.queued = true;
  auto work = c10::make_intrusive<Work>(op.ctx, type, std::move(outputs), std::move(stage),
                                            inputs);
  track(work);
  executor_.submit(OpExecutor::Entry{std::move(op), effective(opTimeout), work, std::move(run)},
                   asyncOp);
  // A blocking call (c10d passes asyncOp false for dist.all_reduce(...,
  // async_op=False) and the like) is finished here, its error raised here,
  // and returns no Work: torch's Python skips wait() when a backend has
  // synced in C++, so no Work object is made for Python and no wait() call
  // comes back into the backend. Where torch registers the Works of
  // collectives in flight (allow_inflight_collective_as_graph_input) it needs
  // the Work, and gets it, completed.
  if (!asyncOp) {
    work->wait();
    if (!c10d::allow_inflight_collective_as_graph_input()) return {};
  }
  return work;
}

std::exception_ptr Backend::runOp(OpExecutor::Entry& e) {
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
  const Comm comm = commFor(e.op);
  DeviceStage& stage = e.work->stage();
  try {
    stage.beforeRun(gpuWaitCheck(e.op));  // CUDA: the copies to the host are done
    e.run(comm);
    transport_->confirm(e.op);
    executor_.markConfirmed();
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

}  // namespace ringreduce
