// The fault-injection seams the tests set (torch_ringreduce._C's "_test..."
// functions, csrc/bindings/bind_testing.cpp), in one place instead of in the
// headers of the code they act on. Each is read once where it acts (a relaxed
// atomic load; 0, or -1 for the tag: off). The shared-memory transport's seams,
// which the benchmarks also set, are shm::hooks() (transport/shm/shm_transport.h).
#pragma once

#include <atomic>
#include <cstdint>

namespace ringreduce {

struct TestHooks {
  // Each op run sleeps this long after completing its Work, before its thread
  // takes the next one, as a preempted worker would (op_executor.cpp).
  std::atomic<int64_t> completeDelayMs{0};
  // The next this-many collectives throw a ValueError once makeOp has numbered
  // them, before they are queued, as a failed allocation of the host copies of
  // CUDA tensors does (issue.cpp).
  std::atomic<int64_t> rejectAfterNumbering{0};
  // The next this-many Works get a C++ callback on their Future that throws
  // (Work::complete must log it, and the op still succeed; work.cpp).
  std::atomic<int64_t> throwingCallbacks{0};
  // A TCP op's confirm() sleeps this long (ms) before its check (tcp_transport.cpp).
  std::atomic<int64_t> tcpConfirmDelayMs{0};
  // A point-to-point send with this tag fails on the engine as a broken
  // connection does, which aborts the group from the engine's thread (p2p_wire.cpp).
  std::atomic<int64_t> tcpFailSendTag{-1};
  // Groups created from now on broadcast down the chain even on one host with
  // shared memory (tuning.cpp); the benchmarks set it too. Every rank must set
  // the same: a chain's receiver and a shared broadcast's root wait for each
  // other until the timeout.
  std::atomic<bool> broadcastChain{false};
};

// The process's one set.
inline TestHooks& testHooks() {
  static TestHooks hooks;
  return hooks;
}

}  // namespace ringreduce
