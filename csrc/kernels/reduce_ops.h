// Elementwise reduction kernels used by the ring algorithms (CPU).
#pragma once

#include <c10/core/ScalarType.h>
#include <torch/csrc/distributed/c10d/Types.hpp>

#include <cstddef>
#include <string>

#include "kernels/reduce_fn.h"

namespace ringreduce {

// Contract of every kernel: see ReduceFn. Floating 16-bit types are combined
// in float32 and rounded once per element. Integer SUM and PRODUCT wrap around. bool: SUM/MAX/BOR = or, PRODUCT/MIN/BAND = and, BXOR = xor.

// The kernel for (dtype, op), or nullptr with *why set when the pair makes no
// sense (bitwise ops on floats, MIN/MAX on complex, PREMUL_SUM, ...). AVG maps
// to the SUM kernel: the caller divides once at the end.
ReduceFn reduceFunction(c10::ScalarType dtype, c10d::ReduceOp::RedOpType op,
                        std::string* why);

// The kernel with the operands swapped: dst[i] = op(src[i], dst[i]), for a
// kernel reduceFunction returned (nullptr for any other function). Lets a
// rank fold a peer's data into its own buffer in rank order without first
// copying its own aside.
ReduceFn reversedFunction(ReduceFn fn);

// Human name of a reduce op: "SUM", "AVG", ...
const char* reduceOpName(c10d::ReduceOp::RedOpType op);

}  // namespace ringreduce
