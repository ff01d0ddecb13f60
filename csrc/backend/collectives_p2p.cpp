// Backend: point-to-point (send, recv) and the barriers.
#include "backend/backend.h"

#include <ATen/core/LegacyTypeDispatch.h>

#include "algorithms/algorithms.h"
#include "backend/validate.h"
#include "transport/mesh.h"

namespace ringreduce {
namespace {

// A receive's Work, once its message is in `s` (or it failed): the copy back
// into the user's tensor `h` (from a staging copy, or for CUDA), then done.
void settleReceive(Work& work, const at::Tensor& h, const at::Tensor& s, int source,
                   std::exception_ptr err) {
  if (err) {
    work.fail(err);
    return;
  }
  try {
    at::NoGradGuard noGrad;
    at::AutoDispatchBelowADInplaceOrView raw;  // as runOp()
    writeBack(h, s);
    work.stage().afterRun();
  } catch (...) {
    work.fail(std::current_exception());
    return;
  }
  work.complete(source);
}

}  // namespace

c10::intrusive_ptr<c10d::Work> Backend::barrier(const c10d::BarrierOptions& opts) {
  OpInfo op = makeOp(OpKind::kBarrier, "barrier", at::Tensor(), kNoReduceOp, 0);
  return enqueue(std::move(op), opts.timeout, c10d::OpType::BARRIER, {}, opts.asyncOp,
                 [](const Comm& c) { barrierDissemination(c); });
}

void Backend::monitoredBarrier(const c10d::BarrierOptions& opts, bool waitAllRanks) {
  using Clock = std::chrono::steady_clock;
  const auto timeout = effective(opts.timeout);
  const auto deadline = Clock::now() + timeout;
  const std::string seq = std::to_string(++monitoredSeq_);
  const std::string what = "monitored_barrier#" + seq;
  traffic_->countOp("monitored_barrier");
  const std::string prefix = rankPrefix(getRank(), getSize()) + " " + what + ": ";
  const std::string ms = std::to_string(timeout.count()) + " ms";
  Mesh& mesh = transport_->mesh();
  StoreCalls& st = mesh.store();
  auto key = [&](const std::string& name) {
    return mesh.storeKey("monitored_barrier/" + seq + "/" + name);
  };
  // Rank 0 writes the verdict after the deadline when a rank is missing: the
  // others wait that long plus a second for it.
  const auto verdictBy = deadline + std::chrono::seconds(1);
  if (getRank() != 0) {
    st.set(key(std::to_string(getRank())), "1", deadline, what);
    if (!st.waitFor(key("verdict"), verdictBy, what)) {
      throwTransportError(prefix + "rank 0 did not finish the monitored barrier in " + ms +
                          " (it did not reach it, or hung or died in it)");
    }
    const std::string verdict = st.get(key("verdict"), verdictBy, what, "");
    // gloo's words for a rank that came, which torch's tests match; then rank 0's verdict.
    if (verdict != "ok") {
      throwTransportError(prefix + "Rank " + std::to_string(getRank()) +
                          " successfully reached monitoredBarrier, but received errors while "
                          "waiting for send/recv from rank 0: " + verdict);
    }
    return;
  }
  std::vector<int> missing;
  // Without wait_all_ranks, a rank found missing once rank 0's own time had run
  // out (a timeout of 0, or the earlier ranks took it all) was never waited
  // for: rank 0 timed out, as gloo says. The words are gloo's, which torch's
  // tests match ("Rank 1 failed to pass monitoredBarrier", "Rank 0 timed out
  // in monitoredBarrier").
  bool rank0TimedOut = false;
  for (int r = 1; r < getSize(); ++r) {
    const bool late = Clock::now() >= deadline;
    // Past the deadline this still sees a rank that did arrive.
    if (!st.waitFor(key(std::to_string(r)), deadline, what)) {
      missing.push_back(r);
      if (!waitAllRanks) {
        rank0TimedOut = late;
        break;
      }
    }
  }
  if (missing.empty()) {
    st.set(key("verdict"), "ok", verdictBy, what);
    return;
  }
  std::string ranks;
  for (size_t i = 0; i < missing.size(); ++i) {
    ranks += (i ? ", " : "") + std::to_string(missing[i]);
  }
  const std::string verdict =
      rank0TimedOut
          ? "Rank 0 timed out in monitoredBarrier after " + ms + " (rank " + ranks +
                " had not arrived; wait_all_ranks=True lists every missing rank)"
          : (missing.size() == 1 ? "Rank " : "Ranks ") + ranks +
                " failed to pass monitoredBarrier in " + ms + " (seen by rank 0" +
                (waitAllRanks ? "" : "; wait_all_ranks=True lists every missing rank") + ")";
  // The ranks that came raise it too, after gloo's words.
  st.set(key("verdict"), verdict, verdictBy, what);
  throwTransportError(prefix + verdict);
}

// ---- point-to-point -------------------------------------------------------

OpInfo Backend::makeP2POp(const char* name, const at::Tensor& t, const std::string& where) {
  traffic_->countOp(name);
  OpInfo op;
  op.ctx = OpContext{getRank(), getSize(), name, ++p2pSeq_, TensorDesc(t).append(where)};
  op.kind = OpKind::kSend;
  op.dtype = static_cast<uint8_t>(t.scalar_type());
  op.timeout = timeout_;
  op.deadline = std::chrono::steady_clock::now() + timeout_;
  return op;
}

c10::intrusive_ptr<c10d::Work> Backend::send(std::vector<at::Tensor>& tensors, int dstRank,
                                                 int tag) {
  OpContext ctx{getRank(), getSize(), "send", p2pSeq_ + 1, tensors};
  const at::Tensor& t = single(ctx, tensors, "send");
  checkRoot(ctx, dstRank, getSize(), "destination rank");
  RR_CHECK_VALUE(dstRank != getRank(), ctx, "a rank cannot send to itself");
  OpInfo op = makeP2POp("send", t,
                        " to rank " + std::to_string(dstRank) + " tag " + std::to_string(tag));
  auto work = c10::make_intrusive<Work>(op.ctx, c10d::OpType::SEND, tensors);
  // CUDA: the host waits for the copy to the host; the message leaves now.
  DeviceStage stage = DeviceStage::begin(op.ctx, {t});
  at::Tensor h = stage.in(t);
  stage.beforeRun(gpuWaitCheck(op));
  at::Tensor s = staged(h);  // kept alive by the callback until sent
  // The transport's thread hands the Work to the executor to settle (or the
  // message went at once, and the Work is settled here).
  executor_.postP2P(work, [&](const OpExecutor::Completion& completion) {
    track(work);
    commFor(op).postSend(dstRank, static_cast<uint64_t>(tag), s.data_ptr(), nbytes(s),
                         [completion, work, s](int, std::exception_ptr err) {
                           completion([work, err] {
                             if (err) {
                               work->fail(err);
                               return;
                             }
                             work->complete();
                           });
                         });
  });
  return work;
}

c10::intrusive_ptr<c10d::Work> Backend::recv(std::vector<at::Tensor>& tensors, int srcRank,
                                                 int tag) {
  OpContext ctx{getRank(), getSize(), "recv", p2pSeq_ + 1, tensors};
  checkRoot(ctx, srcRank, getSize(), "source rank");
  RR_CHECK_VALUE(srcRank != getRank(), ctx, "a rank cannot receive from itself");
  return postRecv(tensors, srcRank, tag);
}

c10::intrusive_ptr<c10d::Work> Backend::recvAnysource(std::vector<at::Tensor>& tensors,
                                                          int tag) {
  return postRecv(tensors, -1, tag);
}

c10::intrusive_ptr<c10d::Work> Backend::postRecv(std::vector<at::Tensor>& tensors,
                                                     int srcRank, int tag) {
  OpContext ctx{getRank(), getSize(), "recv", p2pSeq_ + 1, tensors};
  const at::Tensor& t = single(ctx, tensors, "recv");
  checkWritable(ctx, t, "recv");
  RR_CHECK_VALUE(getSize() > 1, ctx, "no peer to receive from in a group of one");
  std::string from = srcRank < 0 ? "any rank" : "rank " + std::to_string(srcRank);
  OpInfo op = makeP2POp("recv", t, " from " + from + " tag " + std::to_string(tag));
  auto type = srcRank < 0 ? c10d::OpType::RECVANYSOURCE : c10d::OpType::RECV;
  DeviceStage stage = DeviceStage::begin(op.ctx, {t});
  at::Tensor h = stage.out(t);  // CUDA: copied back on the internal stream
  auto work = c10::make_intrusive<Work>(op.ctx, type, tensors, std::move(stage));
  at::Tensor s = staged(h);
  // The transport's thread hands the Work to the executor to settle (the
  // write-back included: CUDA copies are queued by the thread that settles).
  executor_.postP2P(work, [&](const OpExecutor::Completion& completion) {
    track(work);
    commFor(op).postRecv(srcRank, static_cast<uint64_t>(tag), s.data_ptr(), nbytes(s),
                         [completion, work, s, h](int source, std::exception_ptr err) {
                           completion([work, s, h, source, err] {
                             settleReceive(*work, h, s, source, err);
                           });
                         });
  });
  return work;
}

}  // namespace ringreduce
