// The two-step all-reduce's rounds over shared buffers, which the
// hierarchical all-reduce runs too (allreduce_two_step.cpp).
#pragma once

#include <cstddef>
#include <functional>

#include "algorithms/comm.h"
#include "kernels/reduce_fn.h"
#include "transport/shared_buffers.h"

namespace ringreduce {

// Between the reduce-scatter and the all-gather of a round: all-reduces this
// rank's reduced slice (count elements at `slice`) with other hosts. Empty
// on one host.
using AcrossHosts = std::function<void(char* slice, size_t count)>;

// The rounds of a two-step over `shared` (chunks of at most its staging
// size), counting what peers on this host read of this rank's data (and it
// of theirs).
void twoStepRounds(const Comm& c, SharedBuffers& shared, char* data, size_t count,
                   size_t elemSize, ReduceFn fn, const AcrossHosts& across);

}  // namespace ringreduce
