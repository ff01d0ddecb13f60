// The algorithm choice, in one place: every threshold, which algorithm a
// collective takes for a buffer, group and transport (docs/algorithms.md,
// "Choosing the all-reduce" and "Shared broadcast"), and the dispatch by it
// (tuning.cpp). The algorithms themselves are declared in algorithms.h, one
// file each.
#pragma once

#include <cstddef>
#include <string>

#include "algorithms/comm.h"
#include "kernels/reduce_fn.h"

namespace ringreduce {

// --8<-- [start:direct-tcp]
// Over TCP the one-step direct all-reduce (every rank sends its whole buffer
// to every other) takes buffers up to this many bytes; (n-1) x the buffer per
// rank buys one latency instead of 2(n-1).
constexpr size_t kDirectAllreduceBytes = 16 * 1024;
// --8<-- [end:direct-tcp]
// --8<-- [start:direct-shm]
// Over shared memory on one host, up to directSharedBytes(size):
constexpr size_t kDirectShared2Bytes = 64 * 1024;  // 2 ranks
constexpr size_t kDirectSharedBytes = 4 * 1024;     // 3 ranks and more
size_t directSharedBytes(int size);
// --8<-- [end:direct-shm]

// The all-reduce for `bytes` on `size` ranks on `hosts` hosts, `shared` when
// every rank has SharedBuffers (on a multi-host group: every host runs the
// same number of ranks, at least two): the forced one (`forced` != kAuto,
// two-step only on one host with shared memory, hierarchical only on several
// hosts with it), else the fastest measured: over TCP direct up to
// kDirectAllreduceBytes, then the ring; over shared memory on one host direct
// up to directSharedBytes(size) (one synchronisation instead of two), then
// two-step (the ring was slower at every size from 4 KiB to 64 MiB on 2-4
// ranks); on several hosts direct up to kDirectAllreduceBytes, then
// hierarchical.
AllreduceAlgorithm chooseAllreduce(size_t bytes, int size, bool shared,
                                   AllreduceAlgorithm forced, int hosts = 1);
// The all-reduce chooseAllreduce picks for this buffer, group and transport.
void allreduceAuto(const Comm& c, char* data, size_t count, size_t elemSize, ReduceFn fn);

// The broadcast this buffer, group and transport take: a one-host group with
// shared buffers broadcasts through them at every size, any other down the
// chain (docs/algorithms.md, "Shared broadcast").
void broadcastAuto(const Comm& c, char* data, size_t bytes, int root);

}  // namespace ringreduce
