// Shared-memory transport for a group whose ranks all run on one host (same
// hostname, boot, and pid, ipc and network namespaces). gloo has none; on one
// host it replaces two trips through the kernel's loopback per message with a
// copy into and out of a ring buffer the peer maps too.
//
// Layout: one POSIX shared-memory segment per group, created by rank 0 and
// unlinked once every rank has mapped it. A ring buffer (single producer,
// single consumer, byte stream) per ordered pair of ranks carries the same
// framing as TCP (a WireHeader, checked field by field, then the payload), and
// a doorbell (a futex word) per rank wakes a rank sleeping on any of its rings.
// A waiting rank busy-polls, then yields, then sleeps on its doorbell (the
// RINGREDUCE_SPIN_US / RINGREDUCE_YIELD_US budgets of the TCP transport).
//
// The segment also holds two staging areas and two round flags per rank for
// the two-step all-reduce, which reads peers' data in place (SharedBuffers,
// shm_direct.cpp); its waits follow the same policy (shm_segment.h).
//
// The TCP mesh stays up underneath: point-to-point runs on it, and it is how
// failures travel. A sleeping rank polls its peers' (otherwise idle) collective
// sockets, so a peer that dies (closing them) is named within milliseconds; an
// abort sets a flag in the segment, rings every doorbell and aborts the TCP
// transport (which publishes the error in the store and shuts the sockets).
#pragma once

#include <torch/csrc/distributed/c10d/Store.hpp>

#include <memory>

#include "transport/tcp/tcp_transport.h"

namespace ringreduce {
namespace shm {

// Test seams (the fault tests set them directly; never an environment variable).
struct ShmTestHooks {
  bool dieAfterCreate = false;  // rank 0 SIGKILLs itself right after creating the segment
  // Bytes of each staging area of the two-step all-reduce in groups created
  // from now on (0: the default); every rank must set the same.
  int64_t stagingBytes = 0;
};
ShmTestHooks& hooks();

// The transport for the group: shared memory over `tcp` when every rank is on
// this host and every rank mapped the segment (all ranks decide alike through
// the store), else `tcp` itself. Collective: every rank calls it.
std::unique_ptr<Transport> overSharedMemory(std::unique_ptr<tcp::TcpTransport> tcp,
                                            const c10::intrusive_ptr<c10d::Store>& store,
                                            int rank, int size,
                                            std::chrono::milliseconds timeout);

}  // namespace shm
}  // namespace ringreduce
