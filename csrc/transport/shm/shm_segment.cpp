// The segment layout and the wait policy (see shm_segment.h).
#include "transport/shm/shm_segment.h"

#include <cstddef>
#include <iterator>

#include <linux/futex.h>
#include <sched.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>

#if defined(__x86_64__)
#include <emmintrin.h>
#endif

namespace ringreduce {
namespace shm {
namespace {

// --8<-- [start:sleep]
constexpr int kSleepMs = 2;  // a sleeping rank checks its peers' sockets this often
// --8<-- [end:sleep]

size_t roundUp(size_t n, size_t to) { return (n + to - 1) / to * to; }

long futexWait(std::atomic<uint32_t>* word, uint32_t expected, int ms) {
  timespec ts{ms / 1000, static_cast<long>(ms % 1000) * 1000000L};
  return syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAIT, expected, &ts,
                 nullptr, 0);
}

inline void cpuRelax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#endif
}

int millisUntil(Clock::time_point deadline) {
  const auto ms =
      std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count();
  return ms <= 0 ? 0 : static_cast<int>(std::min<int64_t>(ms, 1 << 30));
}

}  // namespace

Members::Members(std::vector<int> hostRanks, int groupSize, int rank)
    : ranks(std::move(hostRanks)), local(groupSize, -1) {
  for (int i = 0; i < size(); ++i) local[ranks[i]] = i;
  me = local[rank];
}

Layout Layout::of(int size, size_t ringBytes, size_t stagingBytes) {
  Layout l;
  const size_t n = static_cast<size_t>(size);
  l.size = size;
  l.ringBytes = ringBytes;
  l.stagingBytes = stagingBytes;
  l.bells = roundUp(sizeof(SegmentHeader), 64);
  l.controls = l.bells + roundUp(sizeof(Doorbell) * n, 64);
  l.rings = l.controls + sizeof(RingControl) * n * n;
  l.flags = roundUp(l.rings + ringBytes * n * n, 64);
  l.ops = l.flags + sizeof(StageFlags) * n;
  l.slots = l.ops + sizeof(OpSlot) * n;
  l.total = l.slots + 2 * n * l.slotBytes();
  return l;
}

void copyIntoRing(char* dst, const char* src, size_t n, bool streaming) {
#if defined(__x86_64__)
  constexpr size_t kLine = 64;
  // Below a few lines (a message's head or the end of a lap) the fence costs
  // more than the lines it saves.
  if (streaming && n >= 4 * kLine) {
    const size_t lead = (kLine - reinterpret_cast<uintptr_t>(dst) % kLine) % kLine;
    std::memcpy(dst, src, lead);
    size_t i = lead;
    for (; i + kLine <= n; i += kLine) {
      const auto* from = reinterpret_cast<const __m128i*>(src + i);
      auto* to = reinterpret_cast<__m128i*>(dst + i);
      const __m128i a = _mm_loadu_si128(from), b = _mm_loadu_si128(from + 1);
      const __m128i c = _mm_loadu_si128(from + 2), d = _mm_loadu_si128(from + 3);
      _mm_stream_si128(to, a);
      _mm_stream_si128(to + 1, b);
      _mm_stream_si128(to + 2, c);
      _mm_stream_si128(to + 3, d);
    }
    std::memcpy(dst + i, src + i, n - i);
    _mm_sfence();
    return;
  }
#endif
  (void)streaming;
  std::memcpy(dst, src, n);
}

void futexWake(std::atomic<uint32_t>* word) {
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAKE, INT32_MAX, nullptr, nullptr,
          0);
}

void Segment::ring(int rank) {
  Doorbell& b = bell(rank);
  b.ring.fetch_add(1);
  if (b.sleeping.load() != 0) futexWake(&b.ring);
}

void raiseAbortFlag(Segment& seg, uint64_t from) {
  std::atomic<uint64_t>& flag = seg.header().abortedFrom;
  uint64_t seen = flag.load();
  while ((seen == 0 || from < seen) && !flag.compare_exchange_weak(seen, from)) {
  }
}

void throwIfAborted(ControlPlane& plane, Segment& seg, const OpInfo& op) {
  if (plane.aborted()) throwTransportError(unusable(op, plane.abortReason()));
  const uint64_t from = seg.header().abortedFrom.load(std::memory_order_relaxed);
  if (from != 0 && from <= op.ctx.seq) {
    plane.awaitPeerError();
    plane.failOp(op, -1, "another rank aborted the group");
  }
}

void announceOp(Segment& seg, int local, const OpInfo& op) {
  OpSlot& slot = seg.opSlot(local);
  if (slot.words[offsetof(WireHeader, seq) / 8].load(std::memory_order_relaxed) == op.ctx.seq) {
    return;  // only this rank writes its slot
  }
  SendSpec none{-1, nullptr, 0, 0};
  const WireHeader h = messageHeader(op, none);
  uint64_t words[sizeof(WireHeader) / 8];
  std::memcpy(words, &h, sizeof(h));
  const uint64_t v = slot.version.load(std::memory_order_relaxed);
  slot.version.store(v + 1, std::memory_order_relaxed);
  std::atomic_thread_fence(std::memory_order_release);
  for (size_t i = 0; i < std::size(words); ++i) {
    slot.words[i].store(words[i], std::memory_order_relaxed);
  }
  slot.version.store(v + 2, std::memory_order_release);
}

bool announcedOp(Segment& seg, int local, WireHeader* out) {
  OpSlot& slot = seg.opSlot(local);
  const uint64_t before = slot.version.load(std::memory_order_acquire);
  if (before == 0 || before % 2 == 1) return false;
  uint64_t words[sizeof(WireHeader) / 8];
  for (size_t i = 0; i < std::size(words); ++i) {
    words[i] = slot.words[i].load(std::memory_order_relaxed);
  }
  std::atomic_thread_fence(std::memory_order_acquire);
  if (slot.version.load(std::memory_order_relaxed) != before) return false;
  std::memcpy(out, words, sizeof(*out));
  return true;
}

PeerWait::PeerWait(ControlPlane& plane, Segment& seg, int local, const std::vector<int>& localOf,
                   const OpInfo& op)
    : plane_(plane), seg_(seg), mine_(seg.bell(local)), localOf_(localOf), op_(op) {}

PeerWait::~PeerWait() {
  plane_.waitPolicy().noteWait(furthest_);
}

void PeerWait::moved() {
  idleKnown_ = false;
  gone_ = -1;
  if (furthest_ != WaitPolicy::Phase::kNone) {
    plane_.waitPolicy().noteWait(furthest_);
    furthest_ = WaitPolicy::Phase::kNone;
  }
}

void PeerWait::idle(FunctionRef<bool()> ready, FunctionRef<void(std::vector<int>&)> waitingOn,
                    FunctionRef<void()> onTimeout) {
  if (gone_ >= 0) {
    // It may have done its part and exited before we looked: only now, with
    // a full pass that found nothing new, is its absence an error.
    plane_.failOp(op_, gone_, "connection closed by the peer (it exited or aborted)");
  }
  throwIfAborted(plane_, seg_, op_);
  const auto now = Clock::now();
  if (!idleKnown_) {  // the first pass that moved nothing: the wait starts
    idleSince_ = now;
    idleKnown_ = true;
  }
  if (now >= op_.deadline) onTimeout();
  const auto idleUs =
      std::chrono::duration_cast<std::chrono::microseconds>(now - idleSince_).count();
  WaitPolicy& policy = plane_.waitPolicy();
  const int64_t spinUs = policy.spinUs();
  using Phase = WaitPolicy::Phase;
  if (idleUs < spinUs) {
    furthest_ = std::max(furthest_, Phase::kSpun);
    cpuRelax();
    return;
  }
  if (idleUs < spinUs + policy.yieldUs()) {
    furthest_ = std::max(furthest_, Phase::kYielded);
    policy.yield();
    return;
  }
  furthest_ = Phase::kSlept;
  // Sleep on the doorbell: arm, then look once more, so a peer that moved
  // after our last look either is seen now or sees the flag and wakes us.
  mine_.sleeping.store(1);
  const uint32_t seen = mine_.ring.load();
  if (!ready()) {
    const int ms = std::max(1, std::min(kSleepMs, millisUntil(op_.deadline)));
    WaitPolicy::Sleep sleep(policy);
    futexWait(&mine_.ring, seen, ms);
  }
  mine_.sleeping.store(0);
  // What arrived while this rank slept goes first: a peer's mismatching
  // header then fails the op in this rank's own words, not as "another rank
  // aborted" (the peer raises its flag right after reading ours).
  if (ready()) return;
  throwIfAborted(plane_, seg_, op_);
  // A peer that died closed its sockets. Only peers we still wait for count:
  // one that got all it needed from us may legitimately be gone already.
  peers_.clear();
  waitingOn(peers_);
  // A peer that runs another op as this one's number never sends what this
  // rank waits for (or never takes what it sends): its slot says so.
  for (int peer : peers_) {
    WireHeader h;
    const int local = localOf_[peer];
    if (local < 0 || !announcedOp(seg_, local, &h) || h.seq != op_.ctx.seq) continue;
    const RecvSpec spec{peer, nullptr, h.bytes, h.step, {}};
    const std::string err = headerMismatch(op_, spec, h);
    if (!err.empty()) {
      plane_.failOp(op_, peer, err + " (the op the peer announced in shared memory)");
    }
  }
  // A rank that rejected the op at the call says so in the store; ranks on
  // other hosts cannot read the slot: a rank there waiting for this one over
  // TCP reads the op in the store.
  plane_.lookWhileIdle(op_, Clock::now() - idleSince_,
                       std::any_of(localOf_.begin(), localOf_.end(), [](int l) { return l < 0; }));
  gone_ = plane_.closedPeer(peers_);
}

}  // namespace shm
}  // namespace ringreduce
