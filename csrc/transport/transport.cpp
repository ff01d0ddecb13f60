// What transport.h declares beside the interface: op names, topology.
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
    case OpKind::kAbort: return "abort";
    case OpKind::kSparseAllreduce: return "sparse allreduce";
    case OpKind::kLeave: return "leave";
  }
  return "unknown-op";
}


Topology Topology::singleHost(int size) {
  Topology t;
  t.hosts.assign(1, {});
  for (int r = 0; r < size; ++r) {
    t.hosts[0].push_back(r);
    t.hostOf.push_back(0);
    t.localIndex.push_back(r);
  }
  return t;
}

bool Topology::uniform() const {
  for (const auto& h : hosts) {
    if (h.size() != hosts[0].size()) return false;
  }
  return true;
}

}  // namespace ringreduce
