// Error helpers: every message a user sees names rank/world, op#seq, the peer
// where there is one, and the tensor (describe()).
#pragma once

#include <c10/core/Device.h>
#include <c10/core/ScalarType.h>
#include <c10/util/Exception.h>
#include <c10/util/SmallVector.h>

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

// What messages say about an op's tensors: their dtype, sizes, device and
// layout are captured when the op is issued, and written out (describe()'s
// text) only when a message is built. Formatting every op's description up
// front cost two ostringstreams per call, about 5% of a one-rank all-reduce.
class TensorDesc {
 public:
  TensorDesc() = default;
  TensorDesc(const at::Tensor& t);                // NOLINT: implicit on purpose
  TensorDesc(const std::vector<at::Tensor>& ts);  // NOLINT
  // Text written after the description (" to rank 1 tag 0").
  TensorDesc& append(std::string suffix);
  bool empty() const { return !list_ && shown_.empty() && suffix_.empty(); }
  std::string str() const;

 private:
  struct Meta {
    bool defined = false;
    c10::ScalarType dtype = c10::ScalarType::Undefined;
    c10::SmallVector<int64_t, 4> sizes;
    c10::Device device = c10::Device(c10::DeviceType::CPU);
    bool sparse = false;
    bool contiguous = true;
  };
  static Meta capture(const at::Tensor& t);
  static std::string text(const Meta& m);

  c10::SmallVector<Meta, 1> shown_;  // the first few tensors of a list
  size_t count_ = 0;                 // tensors in the list
  bool list_ = false;
  std::string suffix_;
};

// Names one op on one rank: "[ringreduce rank 2/4] allreduce#17".
struct OpContext {
  int rank = 0;
  int size = 1;
  std::string op;
  uint64_t seq = 0;
  TensorDesc tensor;  // the op's tensors, for messages

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
