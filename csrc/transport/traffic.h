// Traffic accounting: what one rank moved through one process group.
//
// Payload bytes only (the 48-byte WireHeader of every message and the
// payload-less acknowledgements are not counted), counted once a transfer has
// completed: the collectives' exchanges (Comm::exchange) and the
// point-to-point sends and receives. Ops are counted when issued, under the
// name torch.distributed gives them ("all_reduce", "all_gather_into_tensor",
// "send", ...). Relaxed atomics: a few nanoseconds per message, so it is always
// on. Read and reset from any thread; a reset while ops run splits them
// between the old and new totals.
#pragma once

#include <array>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace ringreduce {

class Traffic {
 public:
  // Index of an op in the counters for the name the backend gives it (its
  // c10d method name: "allreduce", "alltoall_base", "send", ...); -1 if unknown.
  static int opIndex(const char* backendName);
  // The torch.distributed name of counter `index`.
  static const char* distName(int index);
  static constexpr int kOps = 17;

  void countOp(int index) {
    if (index >= 0) ops_[index].fetch_add(1, std::memory_order_relaxed);
  }
  void countOp(const char* backendName) { countOp(opIndex(backendName)); }
  void sent(size_t bytes) { sent_.fetch_add(bytes, std::memory_order_relaxed); }
  void received(size_t bytes) { received_.fetch_add(bytes, std::memory_order_relaxed); }

  uint64_t bytesSent() const { return sent_.load(std::memory_order_relaxed); }
  uint64_t bytesReceived() const { return received_.load(std::memory_order_relaxed); }
  // (dist name, count) of every op issued at least once since the last reset.
  std::vector<std::pair<std::string, uint64_t>> ops() const;
  void reset();

 private:
  std::atomic<uint64_t> sent_{0};
  std::atomic<uint64_t> received_{0};
  std::array<std::atomic<uint64_t>, kOps> ops_{};
};

}  // namespace ringreduce
