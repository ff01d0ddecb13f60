// Argument checks and staging shared by the collective methods. Every check
// throws ValueError/RuntimeError naming rank, op and the tensor at fault.
#pragma once

#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/Types.hpp>

#include <string>
#include <vector>

#include "common/errors.h"
#include "kernels/reduce_ops.h"

namespace ringreduce {

// A defined, dense tensor of a supported dtype, on the CPU (or a CUDA device
// in a CUDA build).
void checkTensor(const OpContext& ctx, const at::Tensor& t, const std::string& what);
// A tensor the op writes into: checkTensor-valid and not expanded or
// otherwise self-overlapping (one element would receive several results).
void checkWritable(const OpContext& ctx, const at::Tensor& t, const std::string& what);
// Exactly one tensor (c10d's multi-tensor-per-process form is not supported).
const at::Tensor& single(const OpContext& ctx, const std::vector<at::Tensor>& ts,
                         const std::string& what);
// t is checkTensor-valid, has `dtype` and `numel` elements.
void checkLike(const OpContext& ctx, const at::Tensor& t, c10::ScalarType dtype, int64_t numel,
               const std::string& what);
// The pairs of a coalesced tensor op: each `small` tensor (dtype of the first)
// has a `large` one of world size times its elements. Returns the total of
// `small`'s elements.
int64_t checkCoalescedPairs(const OpContext& ctx, const std::vector<at::Tensor>& small,
                            const std::string& smallName, const std::vector<at::Tensor>& large,
                            const std::string& largeName, int worldSize);
// A list of exactly `n` tensors, each like (dtype, numel).
void checkList(const OpContext& ctx, const std::vector<at::Tensor>& ts, size_t n,
               c10::ScalarType dtype, int64_t numel, const std::string& what);
void checkRoot(const OpContext& ctx, int64_t root, int size, const char* name);
// The kernel for (dtype, op), or a ValueError saying why there is none.
ReduceFn checkReduce(const OpContext& ctx, c10::ScalarType dtype, const c10d::ReduceOp& op);

// AVG runs as SUM followed by this one division, the same on every rank.
inline void finishAverage(const c10d::ReduceOp& op, const at::Tensor& t, int size) {
  if (op.op_ == c10d::ReduceOp::AVG) t.div_(size);
}

// t itself when contiguous, else a contiguous copy to run the op on.
at::Tensor staged(const at::Tensor& t);
// Whether `t` shares memory with any of `others` (a copy of it is then sent).
bool overlapping(const at::Tensor& t, const std::vector<at::Tensor>& others);
// Copies the result back into the caller's tensor when `s` is a copy.
void writeBack(const at::Tensor& t, const at::Tensor& s);
inline char* bytesOf(const at::Tensor& t) {
  return static_cast<char*>(t.data_ptr());
}
inline size_t nbytes(const at::Tensor& t) {
  return static_cast<size_t>(t.numel()) * t.element_size();
}
// The n equal blocks of `count` elements each that make up contiguous `t`
// (count may be 0, where Tensor::split would not give n blocks).
std::vector<at::Tensor> equalBlocks(const at::Tensor& t, int64_t count, int n);
std::vector<char*> blocksOf(const std::vector<at::Tensor>& ts);

}  // namespace ringreduce
