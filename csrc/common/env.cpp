#include "common/env.h"

#include <c10/util/Exception.h>

#include <cstdlib>

namespace ringreduce {

std::string envString(const EnvVar& var, const std::string& fallback) {
  const char* v = std::getenv(var.name);
  return (v == nullptr || *v == '\0') ? fallback : std::string(v);
}

int64_t envInt(const EnvVar& var, int64_t fallback) {
  const char* v = std::getenv(var.name);
  if (v == nullptr || *v == '\0') {
    return fallback;
  }
  char* end = nullptr;
  long long parsed = std::strtoll(v, &end, 10);
  TORCH_CHECK_VALUE(end != v && *end == '\0', "[ringreduce] environment variable ", var.name,
                    "='", v, "' is not an integer");
  return parsed;
}

bool envIsSet(const EnvVar& var) {
  const char* v = std::getenv(var.name);
  return v != nullptr && *v != '\0';
}

bool debugEnabled() {
  static const bool enabled = envInt(kEnvDebug, 0) != 0;
  return enabled;
}

}  // namespace ringreduce
