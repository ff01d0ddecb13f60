#include "backend/validate.h"

#include <ATen/MemoryOverlap.h>

namespace ringreduce {

void checkTensor(const OpContext& ctx, const at::Tensor& t, const std::string& what) {
  RR_CHECK_VALUE(t.defined(), ctx, what, " is an undefined tensor");
  RR_CHECK_VALUE(t.layout() == at::kStrided, ctx, what, " must be dense, got ", describe(t),
                 " (sparse tensors are not supported)");
#ifdef RINGREDUCE_WITH_CUDA
  RR_CHECK_VALUE(t.device().is_cpu() || t.is_cuda(), ctx, what,
                 " must be a CPU or CUDA tensor, got ", describe(t));
#else
  RR_CHECK_VALUE(!t.is_cuda(), ctx, what, " is ", describe(t),
                 ": CUDA tensors need the CUDA build of torch_ringreduce (not built here)");
  RR_CHECK_VALUE(t.device().is_cpu(), ctx, what, " must be a CPU tensor, got ", describe(t));
#endif
  // Every dtype we move has a SUM kernel (bool's is OR), so that is the test.
  RR_CHECK_VALUE(reduceFunction(t.scalar_type(), c10d::ReduceOp::SUM, nullptr) != nullptr, ctx,
                 what, " has unsupported dtype ", dtypeName(t.scalar_type()));
}

int64_t checkCoalescedPairs(const OpContext& ctx, const std::vector<at::Tensor>& small,
                            const std::string& smallName, const std::vector<at::Tensor>& large,
                            const std::string& largeName, int worldSize) {
  RR_CHECK_VALUE(!small.empty(), ctx, "needs at least one ", smallName, " tensor");
  RR_CHECK_VALUE(large.size() == small.size(), ctx, "expected one ", largeName, " per ",
                 smallName, " (", small.size(), "), got ", large.size());
  int64_t total = 0;
  for (size_t j = 0; j < small.size(); ++j) {
    const std::string i = std::to_string(j);
    checkLike(ctx, small[j], small[0].scalar_type(), small[j].numel(), smallName + " " + i);
    checkLike(ctx, large[j], small[0].scalar_type(), small[j].numel() * worldSize,
              largeName + " " + i + " (world size x " + smallName + " " + i + ")");
    total += small[j].numel();
  }
  return total;
}

void checkWritable(const OpContext& ctx, const at::Tensor& t, const std::string& what) {
  checkTensor(ctx, t, what);
  RR_CHECK_VALUE(at::has_internal_overlap(t) != at::MemOverlap::Yes, ctx, what, " is ",
                 describe(t),
                 ", whose elements overlap in memory (expanded or a self-overlapping view): "
                 "the op writes into it, so pass a tensor that owns its elements "
                 "(e.g. .clone())");
}

const at::Tensor& single(const OpContext& ctx, const std::vector<at::Tensor>& ts,
                         const std::string& what) {
  RR_CHECK_VALUE(ts.size() == 1, ctx, "expected exactly one ", what, " tensor, got ",
                 ts.size(), " ", describe(ts));
  checkTensor(ctx, ts[0], what);
  return ts[0];
}

void checkLike(const OpContext& ctx, const at::Tensor& t, c10::ScalarType dtype, int64_t numel,
               const std::string& what) {
  checkTensor(ctx, t, what);
  RR_CHECK_VALUE(t.scalar_type() == dtype, ctx, what, " has dtype ", dtypeName(t.scalar_type()),
                 ", expected ", dtypeName(dtype), " (", describe(t), ")");
  RR_CHECK_VALUE(t.numel() == numel, ctx, what, " has ", t.numel(), " elements, expected ",
                 numel, " (", describe(t), ")");
}

void checkList(const OpContext& ctx, const std::vector<at::Tensor>& ts, size_t n,
               c10::ScalarType dtype, int64_t numel, const std::string& what) {
  RR_CHECK_VALUE(ts.size() == n, ctx, what, " list has ", ts.size(), " tensors, expected ", n,
                 " (one per rank)");
  for (size_t i = 0; i < ts.size(); ++i) {
    checkLike(ctx, ts[i], dtype, numel, what + " tensor " + std::to_string(i));
  }
}

void checkRoot(const OpContext& ctx, int64_t root, int size, const char* name) {
  RR_CHECK_VALUE(root >= 0 && root < size, ctx, "invalid ", name, " ", root,
                 ": must be in [0, ", size, ")");
}

ReduceFn checkReduce(const OpContext& ctx, c10::ScalarType dtype, const c10d::ReduceOp& op) {
  std::string why;
  ReduceFn fn = reduceFunction(dtype, op.op_, &why);
  RR_CHECK_VALUE(fn != nullptr, ctx, why);
  return fn;
}

std::vector<at::Tensor> equalBlocks(const at::Tensor& t, int64_t count, int n) {
  std::vector<at::Tensor> blocks;
  at::Tensor flat = t.view(-1);
  for (int i = 0; i < n; ++i) blocks.push_back(flat.narrow(0, i * count, count));
  return blocks;
}

std::vector<char*> blocksOf(const std::vector<at::Tensor>& ts) {
  std::vector<char*> out;
  for (const auto& t : ts) out.push_back(bytesOf(t));
  return out;
}

at::Tensor staged(const at::Tensor& t) {
  return t.is_contiguous() ? t : t.contiguous();
}

bool overlapping(const at::Tensor& t, const std::vector<at::Tensor>& others) {
  if (t.numel() == 0) return false;
  for (const auto& o : others) {
    if (o.numel() > 0 && at::get_overlap_status(t, o) != at::MemOverlapStatus::No) return true;
  }
  return false;
}

void writeBack(const at::Tensor& t, const at::Tensor& s) {
  if (!s.is_same(t)) {
    t.copy_(s);  // s is a contiguous copy of t: same shape
  }
}

}  // namespace ringreduce
