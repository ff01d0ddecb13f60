// Error helpers: every message a user sees names rank/world, op#seq, the peer
// where there is one, and the tensor (describe()).
#pragma once

#include <c10/core/ScalarType.h>
#include <c10/util/Exception.h>

#include <cstdint>
#include <exception>
#include <string>
#include <vector>

namespace at {
class Tensor;
}

namespace ringreduce {

// torch's name of a dtype: "float32", "int64", ...
std::string dtypeName(c10::ScalarType dtype);

// "float32[2048] cpu", "int64[4, 3] cpu non-contiguous".
std::string describe(const at::Tensor& t);
// "[float32[4] cpu, float32[4] cpu]" (at most a few entries, then "...").
std::string describe(const std::vector<at::Tensor>& ts);

// Names one op on one rank: "[ringreduce rank 2/4] allreduce#17".
struct OpContext {
  int rank = 0;
  int size = 1;
  std::string op;
  uint64_t seq = 0;
  std::string tensor;  // describe() of the op's main tensor, for messages

  std::string prefix() const;
  // "<prefix>: <what> (<tensor>)"
  std::string message(const std::string& what) const;
};

// "[ringreduce rank 2/4]"
std::string rankPrefix(int rank, int size);

// The transport failed (timeout, lost peer, protocol mismatch): the group is no
// longer usable. Surfaces in Python as torch.distributed.DistBackendError.
[[noreturn]] void throwTransportError(const std::string& message);
// The same error as an exception_ptr, to complete a Work or callback with.
std::exception_ptr transportError(const std::string& message);

}  // namespace ringreduce

// Wrong user input: ValueError in Python, prefixed with rank and op.
#define RR_CHECK_VALUE(cond, ctx, ...) \
  TORCH_CHECK_VALUE((cond), (ctx).prefix(), ": ", __VA_ARGS__)
// Wrong user input that is not a value problem: RuntimeError in Python.
#define RR_CHECK(cond, ctx, ...) TORCH_CHECK((cond), (ctx).prefix(), ": ", __VA_ARGS__)
