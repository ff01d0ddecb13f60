// The algorithm choice (tuning.h): names, thresholds applied, and the
// dispatch of all_reduce and broadcast by it.
#include "algorithms/tuning.h"

#include <iterator>

#include "algorithms/algorithms.h"

namespace ringreduce {

namespace {
constexpr const char* kAllreduceNames[] = {"auto", "ring", "direct", "two_step", "hierarchical"};
}  // namespace

const char* allreduceName(AllreduceAlgorithm a) {
  return kAllreduceNames[static_cast<int>(a)];
}

bool allreduceFromName(const std::string& name, AllreduceAlgorithm* out) {
  for (int i = 0; i < static_cast<int>(std::size(kAllreduceNames)); ++i) {
    if (name == kAllreduceNames[i]) {
      *out = static_cast<AllreduceAlgorithm>(i);
      return true;
    }
  }
  return false;
}

// --8<-- [start:choose]
size_t directSharedBytes(int size) {
  return size == 2 ? kDirectShared2Bytes : kDirectSharedBytes;
}

AllreduceAlgorithm chooseAllreduce(size_t bytes, int size, bool shared,
                                   AllreduceAlgorithm forced, int hosts) {
  using A = AllreduceAlgorithm;
  const bool oneHostShared = shared && hosts == 1, hostsShared = shared && hosts > 1;
  if ((forced == A::kTwoStep && !oneHostShared) || (forced == A::kHierarchical && !hostsShared)) {
    forced = A::kAuto;
  }
  if (forced != A::kAuto) return forced;
  if (hostsShared) return bytes <= kDirectAllreduceBytes ? A::kDirect : A::kHierarchical;
  if (!shared) return bytes <= kDirectAllreduceBytes ? A::kDirect : A::kRing;
  return bytes <= directSharedBytes(size) ? A::kDirect : A::kTwoStep;
}
// --8<-- [end:choose]

void allreduceAuto(const Comm& c, char* data, size_t count, size_t elemSize, ReduceFn fn) {
  SharedBuffers* shared = c.transport.sharedBuffers();
  const Topology& topology = c.transport.topology();
  const int hosts = static_cast<int>(topology.hosts.size());
  // --8<-- [start:hierarchical-usable]
  // Several hosts: the hierarchical all-reduce needs every host's ranks to
  // share memory, and as many on each (every rank sees the same table).
  const bool usable = shared != nullptr && (hosts == 1 || (topology.uniform() &&
                                                           topology.hosts[0].size() >= 2));
  // --8<-- [end:hierarchical-usable]
  switch (chooseAllreduce(count * elemSize, c.size, usable, c.allreduce, hosts)) {
    case AllreduceAlgorithm::kDirect:
      allreduceDirect(c, data, count, elemSize, fn);
      return;
    case AllreduceAlgorithm::kTwoStep:
      allreduceTwoStep(c, *shared, data, count, elemSize, fn);
      return;
    case AllreduceAlgorithm::kHierarchical:
      allreduceHierarchical(c, *shared, topology, data, count, elemSize, fn);
      return;
    default:
      allreduceRing(c, data, count, elemSize, fn);
  }
}

void broadcastAuto(const Comm& c, char* data, size_t bytes, int root) {
  SharedBuffers* shared = c.transport.sharedBuffers();
  const bool oneHost = c.transport.topology().hosts.size() == 1;
  // --8<-- [start:choose-broadcast]
  if (shared != nullptr && oneHost && !c.broadcastChain) {
    broadcastShared(c, *shared, data, bytes, root);
  } else {
    broadcastChain(c, data, bytes, root);
  }
  // --8<-- [end:choose-broadcast]
}

}  // namespace ringreduce
