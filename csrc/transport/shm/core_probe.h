// How far apart two CPUs are now, for a benchmark that must say why a run was
// slow: a VM's vCPUs can move apart on the host within seconds, and then
// handing data from one core to the other through the caches gets several
// times slower while streaming stores, through memory, do not
// (docs/transports.md, "Writing the rings and the staging areas").
#pragma once

#include <cstddef>
#include <vector>

namespace ringreduce {
namespace shm {

struct CoreProbe {
  double roundTripNs = 0;     // a cache line passed there and back, the best of 3 x 2,000
  double plainGBps = 0;       // pieces written on cpuA with plain stores, copied out on cpuB
  double streamingGBps = 0;   // the same with streaming stores (copyIntoRing)
};

// Two threads pinned to cpuA and cpuB (each in this process's affinity; throws
// std::runtime_error otherwise): the round trip, then `pieces` pieces of
// `pieceBytes` handed over through two buffers, plain and streaming, the best
// of two each. About 0.1 s where the cores are near; bounded by `limitS`
// seconds in all (a pinned thread that is not scheduled), after which it
// throws.
CoreProbe probeCores(int cpuA, int cpuB, size_t pieceBytes, int pieces, double limitS);

// What a 2-rank SUM all-reduce of `bytes` of float32 costs these two cores
// with no library around it: two threads pinned to cpuA and cpuB, each
// copying its buffer into an area the other reads (plain stores), raising a
// counter, waiting for the other's, folding the other's area into its own
// buffer with the backend's SUM kernel and saying so, `rounds` times in a
// row. The per-exchange microseconds of each of `runs` runs, in order (the
// writer's clock). The same limit and errors as probeCores.
std::vector<double> probeExchange(int cpuA, int cpuB, size_t bytes, int rounds, int runs,
                                  double limitS);

}  // namespace shm
}  // namespace ringreduce
