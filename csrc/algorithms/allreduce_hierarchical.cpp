// The hierarchical all-reduce (algorithms.h): the two-step's rounds on every
// host, with an all-reduce of each reduced slice across the hosts between
// their two steps.
#include "algorithms/algorithms.h"
#include "algorithms/two_step_rounds.h"

namespace ringreduce {

void allreduceHierarchical(const Comm& c, SharedBuffers& shared, const Topology& topology,
                           char* data, size_t count, size_t elemSize, ReduceFn fn) {
  // The ranks with this rank's local index on every host, in host order.
  const int local = topology.localIndex[c.rank];
  std::vector<int> peers;
  for (const auto& host : topology.hosts) peers.push_back(host[local]);
  const Comm across = c.subgroup(peers, topology.hostOf[c.rank]);
  twoStepRounds(c, shared, data, count, elemSize, fn, [&](char* slice, size_t n) {
    // --8<-- [start:across-hosts]
    // Across hosts it is TCP: the TCP choice for the slice.
    if (chooseAllreduce(n * elemSize, across.size, false, AllreduceAlgorithm::kAuto) ==
        AllreduceAlgorithm::kDirect) {
      allreduceDirect(across, slice, n, elemSize, fn);
    } else {
      allreduceRing(across, slice, n, elemSize, fn);
    }
    // --8<-- [end:across-hosts]
  });
}

}  // namespace ringreduce
