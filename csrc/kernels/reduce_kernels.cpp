// The elementwise reduction kernels (contract: ReduceFn), as one table per
// build (reduce_kernels.h). reduce_kernels_avx2.cpp compiles this file again
// as namespace reduce_avx2 (cpu_isa.h).
#include "kernels/reduce_kernels.h"

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <c10/util/complex.h>

#include <cstdint>
#include <type_traits>

#ifndef RR_REDUCE_KERNELS
#define RR_REDUCE_KERNELS reduce_baseline
#endif

namespace ringreduce {
namespace RR_REDUCE_KERNELS {
namespace {

using Op = c10d::ReduceOp::RedOpType;

struct Sum { template <typename T> T operator()(T a, T b) const { return a + b; } };
struct Prod { template <typename T> T operator()(T a, T b) const { return a * b; } };
struct Min { template <typename T> T operator()(T a, T b) const { return b < a ? b : a; } };
struct Max { template <typename T> T operator()(T a, T b) const { return a < b ? b : a; } };
// Floating point: a NaN on any rank is the result, as torch.minimum/maximum
// and amin/amax give, whatever rank it came from and in whatever order the
// ranks are folded (the integer form above keeps the left operand for a NaN
// on the right, so a NaN from any rank but the first would be dropped).
struct NanMin {
  template <typename T> T operator()(T a, T b) const { return (b < a || b != b) ? b : a; }
};
struct NanMax {
  template <typename T> T operator()(T a, T b) const { return (a < b || b != b) ? b : a; }
};
struct BitAnd { template <typename T> T operator()(T a, T b) const { return a & b; } };
struct BitOr { template <typename T> T operator()(T a, T b) const { return a | b; } };
struct BitXor { template <typename T> T operator()(T a, T b) const { return a ^ b; } };

// Operands swapped: Rev<F>()(a, b) = F()(b, a), for the reversed kernels
// (reversedFunction).
template <typename F>
struct Rev {
  template <typename T> T operator()(T a, T b) const { return F()(b, a); }
};
template <bool kRev, typename F>
using Maybe = std::conditional_t<kRev, Rev<F>, F>;

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

template <typename T, bool kRev>
ReduceFn integerKernel(Op op) {
  switch (op) {
    case Op::SUM: return &applyWrapping<T, Maybe<kRev, Sum>>;
    case Op::PRODUCT: return &applyWrapping<T, Maybe<kRev, Prod>>;
    case Op::MIN: return &apply<T, Maybe<kRev, Min>>;
    case Op::MAX: return &apply<T, Maybe<kRev, Max>>;
    case Op::BAND: return &apply<T, Maybe<kRev, BitAnd>>;
    case Op::BOR: return &apply<T, Maybe<kRev, BitOr>>;
    case Op::BXOR: return &apply<T, Maybe<kRev, BitXor>>;
    default: return nullptr;
  }
}

template <typename T, bool kHalf, typename F>
ReduceFn floatApply() {
  return kHalf ? &applyHalf<T, F> : &apply<T, F>;
}

template <typename T, bool kHalf, bool kRev>
ReduceFn floatKernel(Op op) {
  switch (op) {
    case Op::SUM:
    case Op::AVG: return floatApply<T, kHalf, Maybe<kRev, Sum>>();
    case Op::PRODUCT: return floatApply<T, kHalf, Maybe<kRev, Prod>>();
    case Op::MIN: return floatApply<T, kHalf, Maybe<kRev, NanMin>>();
    case Op::MAX: return floatApply<T, kHalf, Maybe<kRev, NanMax>>();
    default: return nullptr;
  }
}

template <typename T, bool kRev>
ReduceFn complexKernel(Op op) {
  switch (op) {
    case Op::SUM:
    case Op::AVG: return &apply<T, Maybe<kRev, Sum>>;
    case Op::PRODUCT: return &apply<T, Maybe<kRev, Prod>>;
    default: return nullptr;
  }
}

template <bool kRev>
ReduceFn boolKernel(Op op) {
  switch (op) {
    case Op::SUM:
    case Op::MAX:
    case Op::BOR: return &apply<bool, Maybe<kRev, BitOr>>;
    case Op::PRODUCT:
    case Op::MIN:
    case Op::BAND: return &apply<bool, Maybe<kRev, BitAnd>>;
    case Op::BXOR: return &apply<bool, Maybe<kRev, BitXor>>;
    default: return nullptr;
  }
}

template <bool kRev>
ReduceFn lookup(c10::ScalarType dtype, Op op) {
  switch (dtype) {
    case c10::kFloat: return floatKernel<float, false, kRev>(op);
    case c10::kDouble: return floatKernel<double, false, kRev>(op);
    case c10::kHalf: return floatKernel<c10::Half, true, kRev>(op);
    case c10::kBFloat16: return floatKernel<c10::BFloat16, true, kRev>(op);
    case c10::kChar: return op == Op::AVG ? nullptr : integerKernel<int8_t, kRev>(op);
    case c10::kByte: return op == Op::AVG ? nullptr : integerKernel<uint8_t, kRev>(op);
    case c10::kShort: return op == Op::AVG ? nullptr : integerKernel<int16_t, kRev>(op);
    case c10::kInt: return op == Op::AVG ? nullptr : integerKernel<int32_t, kRev>(op);
    case c10::kLong: return op == Op::AVG ? nullptr : integerKernel<int64_t, kRev>(op);
    case c10::kBool: return boolKernel<kRev>(op);
    case c10::kComplexFloat: return complexKernel<c10::complex<float>, kRev>(op);
    case c10::kComplexDouble: return complexKernel<c10::complex<double>, kRev>(op);
    default: return nullptr;
  }
}

}  // namespace

ReduceFn kernelFor(c10::ScalarType dtype, c10d::ReduceOp::RedOpType op, bool reversed) {
  return reversed ? lookup<true>(dtype, op) : lookup<false>(dtype, op);
}

}  // namespace RR_REDUCE_KERNELS
}  // namespace ringreduce
