#include "kernels/reduce_ops.h"

#include "common/errors.h"

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <c10/util/complex.h>

#include <algorithm>
#include <type_traits>

namespace ringreduce {
namespace {

using Op = c10d::ReduceOp::RedOpType;

struct Sum { template <typename T> T operator()(T a, T b) const { return a + b; } };
struct Prod { template <typename T> T operator()(T a, T b) const { return a * b; } };
struct Min { template <typename T> T operator()(T a, T b) const { return b < a ? b : a; } };
struct Max { template <typename T> T operator()(T a, T b) const { return a < b ? b : a; } };
struct BitAnd { template <typename T> T operator()(T a, T b) const { return a & b; } };
struct BitOr { template <typename T> T operator()(T a, T b) const { return a | b; } };
struct BitXor { template <typename T> T operator()(T a, T b) const { return a ^ b; } };

// Integers wrap around instead of overflowing (signed overflow is undefined).
template <typename T>
using Wide = std::conditional_t<std::is_integral_v<T> && std::is_signed_v<T>,
                                std::make_unsigned_t<T>, T>;

template <typename T, typename F>
void applyWrapping(void* dst, const void* src, size_t count) {
  auto* __restrict a = static_cast<T*>(dst);
  const auto* __restrict b = static_cast<const T*>(src);
  F f;
  for (size_t i = 0; i < count; ++i) {
    a[i] = static_cast<T>(f(static_cast<Wide<T>>(a[i]), static_cast<Wide<T>>(b[i])));
  }
}

template <typename T, typename F>
void apply(void* dst, const void* src, size_t count) {
  auto* __restrict a = static_cast<T*>(dst);
  const auto* __restrict b = static_cast<const T*>(src);
  F f;
  for (size_t i = 0; i < count; ++i) {
    a[i] = f(a[i], b[i]);
  }
}

// 16-bit floats: combine in float32, round once.
template <typename T, typename F>
void applyHalf(void* dst, const void* src, size_t count) {
  auto* __restrict a = static_cast<T*>(dst);
  const auto* __restrict b = static_cast<const T*>(src);
  F f;
  for (size_t i = 0; i < count; ++i) {
    a[i] = static_cast<T>(f(static_cast<float>(a[i]), static_cast<float>(b[i])));
  }
}

template <typename T>
ReduceFn integerKernel(Op op) {
  switch (op) {
    case Op::SUM: return &applyWrapping<T, Sum>;
    case Op::PRODUCT: return &applyWrapping<T, Prod>;
    case Op::MIN: return &apply<T, Min>;
    case Op::MAX: return &apply<T, Max>;
    case Op::BAND: return &apply<T, BitAnd>;
    case Op::BOR: return &apply<T, BitOr>;
    case Op::BXOR: return &apply<T, BitXor>;
    default: return nullptr;
  }
}

template <typename T, bool kHalf>
ReduceFn floatKernel(Op op) {
  switch (op) {
    case Op::SUM:
    case Op::AVG: return kHalf ? &applyHalf<T, Sum> : &apply<T, Sum>;
    case Op::PRODUCT: return kHalf ? &applyHalf<T, Prod> : &apply<T, Prod>;
    case Op::MIN: return kHalf ? &applyHalf<T, Min> : &apply<T, Min>;
    case Op::MAX: return kHalf ? &applyHalf<T, Max> : &apply<T, Max>;
    default: return nullptr;
  }
}

template <typename T>
ReduceFn complexKernel(Op op) {
  switch (op) {
    case Op::SUM:
    case Op::AVG: return &apply<T, Sum>;
    case Op::PRODUCT: return &apply<T, Prod>;
    default: return nullptr;
  }
}

ReduceFn boolKernel(Op op) {
  switch (op) {
    case Op::SUM:
    case Op::MAX:
    case Op::BOR: return &apply<bool, BitOr>;
    case Op::PRODUCT:
    case Op::MIN:
    case Op::BAND: return &apply<bool, BitAnd>;
    case Op::BXOR: return &apply<bool, BitXor>;
    default: return nullptr;
  }
}

ReduceFn lookup(c10::ScalarType dtype, Op op) {
  switch (dtype) {
    case c10::kFloat: return floatKernel<float, false>(op);
    case c10::kDouble: return floatKernel<double, false>(op);
    case c10::kHalf: return floatKernel<c10::Half, true>(op);
    case c10::kBFloat16: return floatKernel<c10::BFloat16, true>(op);
    case c10::kChar: return op == Op::AVG ? nullptr : integerKernel<int8_t>(op);
    case c10::kByte: return op == Op::AVG ? nullptr : integerKernel<uint8_t>(op);
    case c10::kShort: return op == Op::AVG ? nullptr : integerKernel<int16_t>(op);
    case c10::kInt: return op == Op::AVG ? nullptr : integerKernel<int32_t>(op);
    case c10::kLong: return op == Op::AVG ? nullptr : integerKernel<int64_t>(op);
    case c10::kBool: return boolKernel(op);
    case c10::kComplexFloat: return complexKernel<c10::complex<float>>(op);
    case c10::kComplexDouble: return complexKernel<c10::complex<double>>(op);
    default: return nullptr;
  }
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
  ReduceFn fn = lookup(dtype, op);
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

}  // namespace ringreduce
