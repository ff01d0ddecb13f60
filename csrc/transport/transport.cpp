#include "transport/transport.h"

namespace ringreduce {

std::string unusable(const OpInfo& op, const std::string& cause) {
  return op.ctx.message("the group is no longer usable") + "; first error: " + cause;
}

const char* opKindName(OpKind kind) {
  switch (kind) {
    case OpKind::kAllreduce: return "allreduce";
    case OpKind::kBroadcast: return "broadcast";
    case OpKind::kReduce: return "reduce";
    case OpKind::kAllgather: return "allgather";
    case OpKind::kGather: return "gather";
    case OpKind::kScatter: return "scatter";
    case OpKind::kReduceScatter: return "reduce_scatter";
    case OpKind::kAlltoall: return "alltoall";
    case OpKind::kBarrier: return "barrier";
    case OpKind::kSend: return "send/recv";
  }
  return "unknown-op";
}

}  // namespace ringreduce
