// The shared-memory segment of one group as every rank maps it, and how a rank
// waits for its peers in it. Shared by the ring-buffer transport
// (shm_transport.cpp), the two-step staging areas (shm_shared_buffers.cpp) and the
// set-up (shm_setup.cpp); nothing outside transport/shm/ includes it.
//
// Layout (every part 64-byte aligned, each atomic on its own cache line but an
// OpSlot's, which share their one line):
//   SegmentHeader | Doorbell x n | RingControl x n*n | ring data x n*n
//   | StageFlags x n | OpSlot x n | staging slots x 2*n (double-buffered, per rank)
// A staging slot is a 64-byte stamp (the WireHeader of its round) and then
// stagingBytes of data.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

#include "common/function_ref.h"
#include "transport/mesh.h"
#include "transport/shared_buffers.h"
#include "transport/wire.h"

namespace ringreduce {
namespace shm {

using Clock = std::chrono::steady_clock;

// The ranks that share one segment: the group's ranks on this host. Segments
// index ranks by their place here (local indices); the mesh, errors and
// Transport peers use ranks of the whole group.
struct Members {
  std::vector<int> ranks;  // ranks of the group, ascending; ranks[local] = rank
  std::vector<int> local;  // per rank of the group: its local index, or -1
  int me = 0;              // this rank's local index

  Members(std::vector<int> hostRanks, int groupSize, int rank);
  int size() const { return static_cast<int>(ranks.size()); }
};

constexpr uint64_t kSegmentMagic = 0x52524453484d3034;  // "RRDSHM04"
constexpr size_t kSlotStampBytes = 64;

struct alignas(64) Doorbell {
  std::atomic<uint32_t> ring{0};      // futex word: bumped on every push/pop for this rank
  std::atomic<uint32_t> sleeping{0};  // 1 while this rank may sleep on `ring`
};

struct SegmentHeader {
  uint64_t magic;
  int64_t size;
  int64_t ringBytes;
  int64_t stagingBytes;
  // 0 while no rank aborted; else the lowest op seq that an aborting rank
  // had not finished (ops before it completed on that rank, and stay valid).
  alignas(64) std::atomic<uint64_t> abortedFrom;
};

// One direction of one pair: the producer owns head, the consumer owns tail;
// both count bytes since the start, so head - tail is what is buffered.
struct RingControl {
  alignas(64) std::atomic<uint64_t> head;
  alignas(64) std::atomic<uint64_t> tail;
};

// One rank's round flags (it alone writes them; they only grow).
struct StageFlags {
  alignas(64) std::atomic<uint64_t> staged;
  alignas(64) std::atomic<uint64_t> reduced;
};

// The op a rank is in: its messages' header (step and bytes 0), written when
// the op first touches the segment. A rank that waits on a peer long enough
// to sleep reads the peer's slot, so ops that differ across ranks fail even
// when no message of the peer's ever reaches this rank (two ranks that each
// think they are a gather's root only receive; two broadcast roots block on
// full rings). A sequence lock: `version` is odd while its owner writes.
struct alignas(64) OpSlot {
  std::atomic<uint64_t> version;
  std::atomic<uint64_t> words[sizeof(WireHeader) / 8];
};

static_assert(std::atomic<uint32_t>::is_always_lock_free &&
                  std::atomic<uint64_t>::is_always_lock_free,
              "shared-memory atomics must be lock-free");

// Byte offsets of the parts of a segment for `size` ranks.
struct Layout {
  int size = 0;
  size_t ringBytes = 0;
  size_t stagingBytes = 0;
  size_t bells = 0, controls = 0, rings = 0, flags = 0, ops = 0, slots = 0, total = 0;

  static Layout of(int size, size_t ringBytes, size_t stagingBytes);
  size_t slotBytes() const { return kSlotStampBytes + stagingBytes; }
};

// One rank's view of a mapped segment (it does not own the mapping).
class Segment {
 public:
  Segment(void* base, const Layout& layout) : base_(static_cast<char*>(base)), layout_(layout) {}

  const Layout& layout() const { return layout_; }
  SegmentHeader& header() { return *reinterpret_cast<SegmentHeader*>(base_); }
  Doorbell& bell(int rank) { return reinterpret_cast<Doorbell*>(base_ + layout_.bells)[rank]; }
  RingControl& control(int from, int to) {
    return reinterpret_cast<RingControl*>(base_ + layout_.controls)[from * layout_.size + to];
  }
  char* ringData(int from, int to) {
    return base_ + layout_.rings + (from * layout_.size + to) * layout_.ringBytes;
  }
  StageFlags& flags(int rank) {
    return reinterpret_cast<StageFlags*>(base_ + layout_.flags)[rank];
  }
  OpSlot& opSlot(int rank) { return reinterpret_cast<OpSlot*>(base_ + layout_.ops)[rank]; }
  // Rank `rank`'s slot in buffer 0 or 1: the stamp, then the data.
  char* slot(int buffer, int rank) {
    return base_ + layout_.slots + (buffer * layout_.size + rank) * layout_.slotBytes();
  }
  // Wakes `rank` if it sleeps (the sleeping flag saves a syscall per message).
  void ring(int rank);

 private:
  char* base_;
  Layout layout_;
};

void futexWake(std::atomic<uint32_t>* word);

// This rank starts `op` (a no-op when its slot already names it).
void announceOp(Segment& seg, int local, const OpInfo& op);
// The op local rank `local` announced last, or false when its slot is being
// written (look again later).
bool announcedOp(Segment& seg, int local, WireHeader* out);

// Copies n bytes into a ring whose consumer, a peer rank, reads them next.
// `streaming` (x86-64): whole 64-byte lines with non-temporal stores, then a
// store fence, so the bytes are visible before the caller publishes `head`.
// A plain store must first take the line back from the consumer's cache,
// where it read the ring's last lap, but leaves the bytes in the producer's
// cache; a streamed line skips that transfer and the consumer reads it from
// memory. Which wins depends on the machine (ring_stores.h measures it per
// op). Below kStreamingMinBytes a message streams no faster, and with more
// ranks on the host than cores a consumer often runs next on the producer's
// own core, where plain stores leave the bytes in its caches: there every
// message takes plain stores.
// --8<-- [start:streaming-min]
constexpr size_t kStreamingMinBytes = 16 << 10;
// --8<-- [end:streaming-min]
void copyIntoRing(char* dst, const char* src, size_t n, bool streaming);

// Fails `op` if this transport aborted, or a rank aborted the group before
// finishing `op` (the segment's flag goes up before a failing rank publishes
// its error: docs/transports.md, "The fault model"). A rank that aborted in a later op finished this
// one, so its abort does not fail it.
void throwIfAborted(ControlPlane& plane, Segment& seg, const OpInfo& op);
// Raises the segment's abort flag for every op from seq `from` on.
void raiseAbortFlag(Segment& seg, uint64_t from);

// How a rank waits for its peers in the segment, for every wait alike:
// busy-poll, then yield, then sleep on its doorbell a few ms at a time, as
// the WaitPolicy says. Each idle pass checks the group's
// abort flag and the op's deadline; each sleep also checks the peers still
// waited for, and one whose connection closed fails the op if the next full
// pass moves nothing (it may have finished its part and exited).
class PeerWait {
 public:
  // `local`: this rank's index in the segment; `localOf`: per rank of the
  // group, its index in the segment (-1 elsewhere).
  PeerWait(ControlPlane& plane, Segment& seg, int local, const std::vector<int>& localOf,
           const OpInfo& op);
  // Counts the wait in progress (WaitPolicy::noteWait).
  ~PeerWait();
  PeerWait(const PeerWait&) = delete;
  PeerWait& operator=(const PeerWait&) = delete;

  // The last pass moved something: spin again, forget a closed peer.
  void moved();
  // The last full pass moved nothing. Throws as above; calls onTimeout (which
  // must throw) past the deadline; else spins, yields or sleeps, unless
  // ready() (looked at after arming the doorbell) says there is work already.
  // waitingOn(out) fills the peers still waited for (ranks of the group).
  void idle(FunctionRef<bool()> ready, FunctionRef<void(std::vector<int>&)> waitingOn,
            FunctionRef<void()> onTimeout);

 private:
  ControlPlane& plane_;
  Segment& seg_;
  Doorbell& mine_;
  const std::vector<int>& localOf_;
  const OpInfo& op_;
  // When the wait began: the first idle() since the last move (an exchange
  // that never waits reads no clock).
  Clock::time_point idleSince_;
  bool idleKnown_ = false;
  int gone_ = -1;  // a peer whose connection closed; fatal if a full pass then moves nothing
  // How far the current wait got (spin, yield, sleep); counted when it ends.
  WaitPolicy::Phase furthest_ = WaitPolicy::Phase::kNone;
  std::vector<int> peers_;
};

// shm_transport.cpp: the transport over a mapped segment (it unmaps it);
// point-to-point goes to `p2p`.
// `stores`: how copies into rings store (copyIntoRing).
enum class RingStores { kPlain, kStreaming, kMeasured };
std::unique_ptr<Transport> makeShmTransport(Mesh& mesh, Transport& p2p, const Topology& topology,
                                            Members members, void* base, const Layout& layout,
                                            RingStores stores);
// shm_shared_buffers.cpp: the segment's staging areas as SharedBuffers,
// stores into them as `stores` says, its choices counted in `use`
// (ring_stores.h; it outlives them).
class StoreUse;
std::unique_ptr<SharedBuffers> makeSharedBuffers(ControlPlane& plane, Segment& seg,
                                                 const Members& members, RingStores stores,
                                                 StoreUse& use);

}  // namespace shm
}  // namespace ringreduce
