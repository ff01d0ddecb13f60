#include "kernels/reduce_ops.h"

#include "common/errors.h"

#include "kernels/cpu_isa.h"
#include "kernels/reduce_kernels.h"

#include <string>
#include <unordered_map>

namespace ringreduce {
namespace {

using Op = c10d::ReduceOp::RedOpType;

// The kernel of the build that runs (cpu_isa.h).
ReduceFn kernelFor(c10::ScalarType dtype, Op op, bool reversed) {
#ifdef RINGREDUCE_CPU_AVX2
  if (cpuKernelsAvx2()) return reduce_avx2::kernelFor(dtype, op, reversed);
#endif
  return reduce_baseline::kernelFor(dtype, op, reversed);
}

}  // namespace

const char* reduceOpName(Op op) {
  switch (op) {
    case Op::SUM: return "SUM";
    case Op::AVG: return "AVG";
    case Op::PRODUCT: return "PRODUCT";
    case Op::MIN: return "MIN";
    case Op::MAX: return "MAX";
    case Op::BAND: return "BAND";
    case Op::BOR: return "BOR";
    case Op::BXOR: return "BXOR";
    case Op::PREMUL_SUM: return "PREMUL_SUM";
    default: return "UNUSED";
  }
}

ReduceFn reduceFunction(c10::ScalarType dtype, Op op, std::string* why) {
  ReduceFn fn = kernelFor(dtype, op, false);
  if (fn == nullptr && why != nullptr) {
    *why = std::string("reduce op ") + reduceOpName(op) + " is not supported for dtype " +
           dtypeName(dtype);
    if (op == Op::PREMUL_SUM) {
      *why += " (PREMUL_SUM is NCCL-only)";
    } else if (op == Op::AVG) {
      *why += " (AVG needs a floating or complex dtype)";
    }
  }
  return fn;
}

ReduceFn reversedFunction(ReduceFn fn) {
  // Every kernel and its reversed twin, built once from the same table; never
  // destroyed, so a worker thread still reducing at exit never reads a freed map.
  static const auto* twins = [] {
    auto* m = new std::unordered_map<ReduceFn, ReduceFn>();
    for (c10::ScalarType dtype :
         {c10::kFloat, c10::kDouble, c10::kHalf, c10::kBFloat16, c10::kChar, c10::kByte,
          c10::kShort, c10::kInt, c10::kLong, c10::kBool, c10::kComplexFloat,
          c10::kComplexDouble}) {
      for (Op op : {Op::SUM, Op::AVG, Op::PRODUCT, Op::MIN, Op::MAX, Op::BAND, Op::BOR,
                    Op::BXOR}) {
        if (ReduceFn f = kernelFor(dtype, op, false)) m->emplace(f, kernelFor(dtype, op, true));
      }
    }
    return m;
  }();
  auto it = twins->find(fn);
  return it == twins->end() ? nullptr : it->second;
}

}  // namespace ringreduce
