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

namespace {
constexpr size_t kShown = 3;  // tensors of a list a description names
}  // namespace

TensorDesc::Meta TensorDesc::capture(const at::Tensor& t) {
  Meta m;
  if (!t.defined()) {
    return m;
  }
  m.defined = true;
  m.dtype = t.scalar_type();
  m.sizes.assign(t.sizes().begin(), t.sizes().end());
  m.device = t.device();
  m.sparse = t.is_sparse();
  m.contiguous = m.sparse || t.is_contiguous();
  return m;
}

std::string TensorDesc::text(const Meta& m) {
  if (!m.defined) {
    return "undefined tensor";
  }
  std::ostringstream os;
  os << dtypeName(m.dtype) << "[";
  for (size_t d = 0; d < m.sizes.size(); ++d) {
    os << (d ? ", " : "") << m.sizes[d];
  }
  os << "] " << m.device;
  if (m.sparse) {
    os << " sparse";
  } else if (!m.contiguous) {
    os << " non-contiguous";
  }
  return os.str();
}

TensorDesc::TensorDesc(const at::Tensor& t) {
  shown_.push_back(capture(t));
}

TensorDesc::TensorDesc(const std::vector<at::Tensor>& ts) : count_(ts.size()), list_(true) {
  for (size_t i = 0; i < ts.size() && i < kShown; ++i) {
    shown_.push_back(capture(ts[i]));
  }
}

TensorDesc& TensorDesc::append(std::string suffix) {
  suffix_ += suffix;
  return *this;
}

std::string TensorDesc::str() const {
  std::string s;
  if (list_) {
    s = "[";
    for (size_t i = 0; i < shown_.size(); ++i) {
      s += (i ? ", " : "") + text(shown_[i]);
    }
    if (count_ > kShown) {
      s += ", ... (" + std::to_string(count_) + " tensors)";
    }
    s += "]";
  } else if (!shown_.empty()) {
    s = text(shown_[0]);
  }
  return s + suffix_;
}

std::string describe(const at::Tensor& t) {
  return TensorDesc(t).str();
}

std::string describe(const std::vector<at::Tensor>& ts) {
  return TensorDesc(ts).str();
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
    m += " (" + tensor.str() + ")";
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
