#include "common/errors.h"

#include <ATen/ATen.h>

#include <sstream>

namespace ringreduce {

std::string dtypeName(c10::ScalarType dtype) {
  // ScalarType names are "Float", "Long", ...: users know torch's names.
  static const std::pair<c10::ScalarType, const char*> kNames[] = {
      {c10::kFloat, "float32"}, {c10::kDouble, "float64"}, {c10::kHalf, "float16"},
      {c10::kBFloat16, "bfloat16"}, {c10::kChar, "int8"}, {c10::kByte, "uint8"},
      {c10::kShort, "int16"}, {c10::kInt, "int32"}, {c10::kLong, "int64"},
      {c10::kBool, "bool"}, {c10::kComplexFloat, "complex64"},
      {c10::kComplexDouble, "complex128"}};
  for (const auto& [type, name] : kNames) {
    if (type == dtype) {
      return name;
    }
  }
  return c10::toString(dtype);
}

std::string describe(const at::Tensor& t) {
  if (!t.defined()) {
    return "undefined tensor";
  }
  std::string dtype = dtypeName(t.scalar_type());
  std::ostringstream os;
  os << dtype << "[";
  for (int64_t d = 0; d < t.dim(); ++d) {
    os << (d ? ", " : "") << t.size(d);
  }
  os << "] " << t.device();
  if (t.is_sparse()) {
    os << " sparse";
  } else if (!t.is_contiguous()) {
    os << " non-contiguous";
  }
  return os.str();
}

std::string describe(const std::vector<at::Tensor>& ts) {
  constexpr size_t kShown = 3;
  std::ostringstream os;
  os << "[";
  for (size_t i = 0; i < ts.size() && i < kShown; ++i) {
    os << (i ? ", " : "") << describe(ts[i]);
  }
  if (ts.size() > kShown) {
    os << ", ... (" << ts.size() << " tensors)";
  }
  os << "]";
  return os.str();
}

std::string rankPrefix(int rank, int size) {
  return "[ringreduce rank " + std::to_string(rank) + "/" + std::to_string(size) + "]";
}

std::string OpContext::prefix() const {
  std::string p = rankPrefix(rank, size);
  if (!op.empty()) {
    p += " " + op + "#" + std::to_string(seq);
  }
  return p;
}

std::string OpContext::message(const std::string& what) const {
  std::string m = prefix() + ": " + what;
  if (!tensor.empty()) {
    m += " (" + tensor + ")";
  }
  return m;
}

void throwTransportError(const std::string& message) {
  C10_THROW_ERROR(DistBackendError, message);
}

std::exception_ptr transportError(const std::string& message) {
  try {
    throwTransportError(message);
  } catch (...) {
    return std::current_exception();
  }
}

}  // namespace ringreduce
