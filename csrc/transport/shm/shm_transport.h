// Shared-memory transport among the ranks of a group that run on one host
// (same hostname, boot, pid, ipc and network namespaces, and the same file
// system behind /dev/shm: see transport/factory.cpp). gloo has none; on one host it replaces two trips
// through the kernel's loopback per message with a copy into and out of a ring
// buffer the peer maps too. In a group spread over several hosts each host's
// ranks get their own segment, and the factory routes every other peer to TCP.
//
// Layout: one POSIX shared-memory segment per host of the group, created by
// the host's lowest rank and unlinked once every rank has mapped it. A ring
// buffer (single producer, single consumer, byte stream) per ordered pair of
// local ranks carries the same framing as TCP (a WireHeader, checked field by
// field, then the payload), and a doorbell (a futex word) per rank wakes a
// rank sleeping on any of its rings. A waiting rank busy-polls, then yields,
// then sleeps on its doorbell, as the mesh's WaitPolicy says.
//
// The segment also holds two staging areas and two round flags per rank for
// the two-step and hierarchical all-reduces, which read peers' data in place
// (SharedBuffers, shm_shared_buffers.cpp); their waits follow the same policy.
//
// The mesh (transport/mesh.h, TCP) stays up underneath: point-to-point runs on
// it, and it is how failures travel. A sleeping rank polls its peers'
// (otherwise idle) collective sockets, so a peer that dies (closing them) is
// named within milliseconds; an abort sets a flag in the segment, rings every
// doorbell and aborts the mesh (which publishes the error in the store and
// shuts the sockets).
#pragma once

#include <array>
#include <atomic>
#include <chrono>
#include <memory>

#include "transport/mesh.h"
#include "transport/transport.h"
#include "transport/wire.h"

namespace ringreduce {
namespace shm {

// Test seams (the fault tests set them directly; never an environment variable).
struct ShmTestHooks {
  bool dieAfterCreate = false;  // the creator SIGKILLs itself right after creating the segment
  // The creator's set-up throws right after creating the segment, as a
  // failing store call there would.
  bool failAfterCreate = false;
  // Bytes of each staging area of the two-step all-reduce in groups created
  // from now on (0: the default); every rank must set the same.
  int64_t stagingBytes = 0;
  // How copies into rings store in groups created from now on: -1 as the
  // host's ranks and cores say (measured per op when they fit the cores,
  // else plain: copyIntoRing), 0 plain stores, 1 streaming.
  int ringStores = -1;
  // Added to each measured op time of plain [0] and streaming [1] stores
  // (ring_stores.h). What each op chose: Transport::ringStoreUse.
  std::array<std::atomic<double>, 2> storePenaltyUs{};
  // confirm() sleeps this long before its check: widens the window between
  // an op's last transfer and its final check (the abort-flag tests).
  int64_t confirmDelayMs = 0;
};
ShmTestHooks& hooks();

// The bytes of each staging area (the two-step all-reduce's and the shared
// broadcast's round) of a host with `localRanks` ranks of a group.
size_t stagingBytesFor(int localRanks);

// Shared memory among this rank's host's ranks (topology.hosts), or null when
// the group does not use it: a rank alone on its host, or any rank of any host
// could not map its segment (every rank decides alike through the store, so
// the group's algorithms agree). Collective over the whole group: every rank
// calls it. Point-to-point of the returned transport goes to `p2p`; `mesh`
// and `p2p` must outlive it. Throws past `deadline` or when a peer dies.
std::unique_ptr<Transport> attach(Mesh& mesh, Transport& p2p, const Topology& topology,
                                  std::chrono::steady_clock::time_point deadline);

}  // namespace shm
}  // namespace ringreduce
