#include "transport/traffic.h"

#include <cstring>

namespace ringreduce {
namespace {

// The backend's op names (its c10d methods) and what torch.distributed calls
// them. sparse allreduce and allreduce share a name, as in dist.
struct OpName {
  const char* backend;
  const char* dist;
};
constexpr OpName kOpNames[] = {
    {"allreduce", "all_reduce"},
    {"allreduce_coalesced", "all_reduce_coalesced"},
    {"broadcast", "broadcast"},
    {"reduce", "reduce"},
    {"allgather", "all_gather"},
    {"allgather_into_tensor", "all_gather_into_tensor"},
    {"allgather_coalesced", "all_gather_coalesced"},
    {"gather", "gather"},
    {"scatter", "scatter"},
    {"reduce_scatter", "reduce_scatter"},
    {"reduce_scatter_tensor", "reduce_scatter_tensor"},
    {"alltoall_base", "all_to_all_single"},
    {"alltoall", "all_to_all"},
    {"barrier", "barrier"},
    {"send", "send"},
    {"recv", "recv"},
    {"monitored_barrier", "monitored_barrier"},
};
static_assert(sizeof(kOpNames) / sizeof(kOpNames[0]) == Traffic::kOps,
              "one counter per op name");

}  // namespace

int Traffic::opIndex(const char* backendName) {
  for (int i = 0; i < kOps; ++i) {
    if (std::strcmp(kOpNames[i].backend, backendName) == 0) return i;
  }
  return -1;
}

const char* Traffic::distName(int index) {
  return kOpNames[index].dist;
}

std::vector<std::pair<std::string, uint64_t>> Traffic::ops() const {
  std::vector<std::pair<std::string, uint64_t>> out;
  for (int i = 0; i < kOps; ++i) {
    uint64_t n = ops_[i].load(std::memory_order_relaxed);
    if (n) out.emplace_back(kOpNames[i].dist, n);
  }
  return out;
}

void Traffic::reset() {
  sent_.store(0, std::memory_order_relaxed);
  received_.store(0, std::memory_order_relaxed);
  for (auto& n : ops_) n.store(0, std::memory_order_relaxed);
}

}  // namespace ringreduce
