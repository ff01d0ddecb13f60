// The wire format (wire.h): header stamps and checks, progress, timeout reports.
#include "transport/wire.h"

#include "kernels/reduce_ops.h"

namespace ringreduce {

// Human text for the first header field that differs from what this op expects.
std::string headerMismatch(const OpInfo& op, const RecvSpec& spec, const WireHeader& h) {
  if (h.magic != kWireMagic) {
    return "protocol error: bad message magic (not a ringreduce message, or the stream "
           "lost its framing)";
  }
  if (h.kind == static_cast<uint8_t>(OpKind::kAbort)) {
    return "the peer abandoned its op #" + std::to_string(h.seq) +
           " (it timed out or failed there)";
  }
  if (h.kind != static_cast<uint8_t>(op.kind) || h.seq != op.ctx.seq) {
    return "collective mismatch: the peer is running " +
           std::string(opKindName(static_cast<OpKind>(h.kind))) + "#" + std::to_string(h.seq) +
           ", this rank " + op.ctx.op + "#" + std::to_string(op.ctx.seq) +
           " (every rank must issue the same collectives in the same order)";
  }
  if (h.root != op.root) {
    auto name = [](int32_t r) {
      return r == kNoRoot ? std::string("none") : "rank " + std::to_string(r);
    };
    return "root mismatch: the peer's " + std::string(op.ctx.op) + "#" +
           std::to_string(op.ctx.seq) + " has root " + name(h.root) + ", this rank's has root " +
           name(op.root) + " (every rank must pass the same src/dst)";
  }
  if (h.dtype != op.dtype) {
    return "dtype mismatch: got " + dtypeName(static_cast<c10::ScalarType>(h.dtype)) +
           ", expected " + dtypeName(static_cast<c10::ScalarType>(op.dtype));
  }
  if (h.reduceOp != op.reduceOp) {
    auto name = [](uint8_t r) {
      return r == kNoReduceOp ? "none"
                              : reduceOpName(static_cast<c10d::ReduceOp::RedOpType>(r));
    };
    return std::string("reduce op mismatch: got ") + name(h.reduceOp) + ", expected " +
           name(op.reduceOp);
  }
  if (h.total != op.total) {
    return "element count mismatch: got " + std::to_string(h.total) + ", expected " +
           std::to_string(op.total);
  }
  if (h.step != spec.step || h.bytes != spec.bytes) {
    auto what = [](uint64_t bytes, uint64_t step) {
      return step == kAckStep ? std::string("an acknowledgement")
                              : std::to_string(bytes) + " (step " + std::to_string(step) + ")";
    };
    return "byte count mismatch: got " + what(h.bytes, h.step) + ", expected " +
           what(spec.bytes, spec.step);
  }
  return "";
}

WireHeader messageHeader(const OpInfo& op, const SendSpec& send) {
  return WireHeader{kWireMagic, static_cast<uint8_t>(op.kind), op.dtype, op.reduceOp, 0,
                    op.root,    0,        op.ctx.seq,  op.total,   send.step, send.bytes};
}

void startProgress(const OpInfo& op, std::vector<SendSpec>& sends, std::vector<RecvSpec>& recvs,
                   std::vector<SendProgress>* sendProgress,
                   std::vector<RecvProgress>* recvProgress) {
  for (auto& s : sends) sendProgress->push_back({&s, messageHeader(op, s)});
  for (auto& r : recvs) recvProgress->push_back({&r});
}

std::pair<int, std::string> timeoutReport(const OpInfo& op, const std::vector<SendProgress>& sends,
                                          const std::vector<RecvProgress>& recvs) {
  // "Timed out" capitalised: torch's own tests know a timeout by " Timed out ".
  const std::string after = "Timed out after " + std::to_string(op.timeout.count()) + " ms ";
  for (auto& r : recvs) {
    if (!r.finished() && r.spec->step == kAckStep) {
      return {r.spec->peer, after + "waiting for its acknowledgement (it has not finished its "
                                    "part of this op)"};
    }
    if (!r.finished()) {
      std::string got = "got " + std::to_string(r.dataDone) + " of " +
                        std::to_string(r.spec->bytes) + " bytes";
      if (r.headerDone < sizeof(WireHeader)) {
        got += " (its message for step " + std::to_string(r.spec->step) + " has not started)";
      }
      return {r.spec->peer, after + "waiting to receive: " + got};
    }
  }
  for (auto& s : sends) {
    if (s.done < s.total()) {
      return {s.spec->peer, after + "sending: sent " + std::to_string(s.done) + " of " +
                                std::to_string(s.total()) + " bytes (with header)"};
    }
  }
  return {-1, after + "with nothing left to transfer"};
}

}  // namespace ringreduce
