// Shared-memory transport (see shm_transport.h for the design).
#include "transport/shm/shm_transport.h"

#include <fcntl.h>
#include <linux/futex.h>
#include <sched.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <dirent.h>
#include <signal.h>

#include <atomic>
#include <cerrno>
#include <cstring>
#include <fstream>
#include <new>
#include <thread>

#include "common/env.h"

namespace ringreduce {
namespace shm {
namespace {

using tcp::Clock;
using tcp::millisUntil;

constexpr uint64_t kSegmentMagic = 0x52524453484d3031;  // "RRDSHM01"
constexpr int64_t kDefaultRingBytes = 256 << 10;
constexpr int64_t kMinRingBytes = 4 << 10;
constexpr int64_t kMaxSegmentBytes = int64_t{256} << 20;
constexpr int kSleepMs = 2;  // a sleeping rank checks its peers' sockets this often

struct alignas(64) Doorbell {
  std::atomic<uint32_t> ring{0};      // futex word: bumped on every push/pop for this rank
  std::atomic<uint32_t> sleeping{0};  // 1 while this rank may sleep on `ring`
};

struct SegmentHeader {
  uint64_t magic;
  int64_t size;
  int64_t ringBytes;
  alignas(64) std::atomic<uint32_t> aborted;
};

// One direction of one pair: the producer owns head, the consumer owns tail;
// both count bytes since the start, so head - tail is what is buffered.
struct RingControl {
  alignas(64) std::atomic<uint64_t> head;
  alignas(64) std::atomic<uint64_t> tail;
};

static_assert(std::atomic<uint32_t>::is_always_lock_free &&
                  std::atomic<uint64_t>::is_always_lock_free,
              "shared-memory atomics must be lock-free");

size_t roundUp(size_t n, size_t to) { return (n + to - 1) / to * to; }

std::string readFirstLine(const char* path) {
  std::ifstream in(path);
  std::string line;
  std::getline(in, line);
  return line;
}

std::string linkTarget(const char* path) {
  char buf[256];
  ssize_t n = ::readlink(path, buf, sizeof(buf) - 1);
  return n > 0 ? std::string(buf, n) : std::string("?");
}

// Ranks with the same identity share /dev/shm and can futex on it.
std::string hostIdentity() {
  char host[256] = {0};
  ::gethostname(host, sizeof(host) - 1);
  return std::string(host) + "|" + readFirstLine("/proc/sys/kernel/random/boot_id") + "|" +
         linkTarget("/proc/self/ns/pid") + "|" + linkTarget("/proc/self/ns/ipc") + "|" +
         linkTarget("/proc/self/ns/net") + "|" + linkTarget("/proc/self/ns/mnt");
}

long futexWait(std::atomic<uint32_t>* word, uint32_t expected, int ms) {
  timespec ts{ms / 1000, static_cast<long>(ms % 1000) * 1000000L};
  return syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAIT, expected, &ts,
                 nullptr, 0);
}

void futexWake(std::atomic<uint32_t>* word) {
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAKE, INT32_MAX, nullptr, nullptr,
          0);
}

inline void cpuRelax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#endif
}

using SendState = SendProgress;
using RecvState = RecvProgress;

class ShmTransport : public Transport {
 public:
  ShmTransport(std::unique_ptr<tcp::TcpTransport> tcp, int rank, int size, void* base,
               size_t bytes, size_t ringBytes)
      : tcp_(std::move(tcp)), rank_(rank), size_(size), base_(base), bytes_(bytes),
        ringBytes_(ringBytes) {
    header_ = static_cast<SegmentHeader*>(base_);
    char* p = static_cast<char*>(base_) + roundUp(sizeof(SegmentHeader), 64);
    bells_ = reinterpret_cast<Doorbell*>(p);
    p += roundUp(sizeof(Doorbell) * size_, 64);
    controls_ = reinterpret_cast<RingControl*>(p);
    p += sizeof(RingControl) * size_ * size_;
    data_ = p;
  }

  ~ShmTransport() override {
    close();
    ::munmap(base_, bytes_);
  }

  static size_t segmentBytes(int size, size_t ringBytes) {
    return roundUp(sizeof(SegmentHeader), 64) + roundUp(sizeof(Doorbell) * size, 64) +
           sizeof(RingControl) * size * size + ringBytes * size * size;
  }

  void exchange(const OpInfo& op, std::vector<SendSpec>& sends,
                std::vector<RecvSpec>& recvs) override;

  void postSend(const OpInfo& op, int peer, uint64_t tag, const void* data, size_t bytes,
                P2PCallback done) override {
    tcp_->postSend(op, peer, tag, data, bytes, std::move(done));
  }
  void postRecv(const OpInfo& op, int peer, uint64_t tag, void* data, size_t bytes,
                P2PCallback done) override {
    tcp_->postRecv(op, peer, tag, data, bytes, std::move(done));
  }

  // Every rank that fails an op raises the segment's flag before anything
  // else, so a flag still down means no peer abandoned this op.
  void confirm(const OpInfo& op) override { throwIfAborted(op); }

  void abort(const std::string& reason) override {
    header_->aborted.store(1);
    for (int r = 0; r < size_; ++r) ring(r);
    tcp_->abort(reason);
  }
  std::string abortReason() const override { return tcp_->abortReason(); }
  std::string name() const override { return "shm"; }
  void close() override { tcp_->close(); }

 private:
  RingControl& control(int from, int to) { return controls_[from * size_ + to]; }
  char* ringData(int from, int to) { return data_ + (from * size_ + to) * ringBytes_; }

  // Wakes `rank` if it sleeps (the sleeping flag saves a syscall per message).
  void ring(int rank) {
    Doorbell& b = bells_[rank];
    b.ring.fetch_add(1);
    if (b.sleeping.load() != 0) futexWake(&b.ring);
  }

  // Copies as much of the message as the ring to s.peer has room for.
  bool progressSend(SendState& s) {
    RingControl& c = control(rank_, s.spec->peer);
    const uint64_t head = c.head.load(std::memory_order_relaxed);
    const uint64_t room = ringBytes_ - (head - c.tail.load(std::memory_order_acquire));
    const size_t n = std::min<size_t>(room, s.total() - s.done);
    if (n == 0) return false;
    char* ringBase = ringData(rank_, s.spec->peer);
    for (size_t written = 0; written < n;) {
      const size_t at = (head + written) % ringBytes_;
      size_t piece = std::min(n - written, ringBytes_ - at);
      const size_t off = s.done + written;
      const char* src;
      if (off < sizeof(WireHeader)) {
        piece = std::min(piece, sizeof(WireHeader) - off);
        src = reinterpret_cast<const char*>(&s.header) + off;
      } else {
        src = static_cast<const char*>(s.spec->data) + (off - sizeof(WireHeader));
      }
      std::memcpy(ringBase + at, src, piece);
      written += piece;
    }
    c.head.store(head + n, std::memory_order_release);
    s.done += n;
    ring(s.spec->peer);
    return true;
  }

  // Takes what the ring from r.peer holds, up to the end of this message.
  bool progressRecv(const OpInfo& op, RecvState& r) {
    RingControl& c = control(r.spec->peer, rank_);
    const uint64_t tail = c.tail.load(std::memory_order_relaxed);
    const uint64_t avail = c.head.load(std::memory_order_acquire) - tail;
    const size_t want = (sizeof(WireHeader) - r.headerDone) + (r.spec->bytes - r.dataDone);
    const size_t n = std::min<size_t>(avail, want);
    if (n == 0) return false;
    const char* ringBase = ringData(r.spec->peer, rank_);
    size_t taken = 0;
    while (taken < n) {
      const size_t at = (tail + taken) % ringBytes_;
      size_t piece = std::min(n - taken, ringBytes_ - at);
      if (r.headerDone < sizeof(WireHeader)) {
        piece = std::min(piece, sizeof(WireHeader) - r.headerDone);
        std::memcpy(reinterpret_cast<char*>(&r.header) + r.headerDone, ringBase + at, piece);
        r.headerDone += piece;
        taken += piece;
        if (r.headerDone == sizeof(WireHeader)) {
          c.tail.store(tail + taken, std::memory_order_release);
          std::string err = headerMismatch(op, *r.spec, r.header);
          if (!err.empty()) {
            tcp_->failOp(op, r.spec->peer, err + " (received 0 of " +
                                               std::to_string(r.spec->bytes) + " bytes)");
          }
        }
      } else {
        std::memcpy(static_cast<char*>(r.spec->data) + r.dataDone, ringBase + at, piece);
        r.dataDone += piece;
        taken += piece;
      }
    }
    c.tail.store(tail + n, std::memory_order_release);
    ring(r.spec->peer);  // the producer may be waiting for room
    if (r.spec->onProgress && r.headerDone == sizeof(WireHeader) && r.dataDone > 0) {
      r.spec->onProgress(r.dataDone);
    }
    return true;
  }

  [[noreturn]] void timeout(const OpInfo& op, const std::vector<SendState>& ss,
                            const std::vector<RecvState>& rs) {
    auto [peer, what] = timeoutReport(op, ss, rs);
    tcp_->failTimeout(op, peer, what);
  }

  void throwIfAborted(const OpInfo& op) {
    if (tcp_->aborted()) throwTransportError(unusable(op, abortReason()));
    if (header_->aborted.load(std::memory_order_relaxed) != 0) {
      tcp_->awaitPeerError();
      tcp_->failOp(op, -1, "another rank aborted the group");
    }
  }

  std::unique_ptr<tcp::TcpTransport> tcp_;
  const int rank_;
  const int size_;
  void* base_;
  const size_t bytes_;
  const size_t ringBytes_;
  SegmentHeader* header_;
  Doorbell* bells_;
  RingControl* controls_;
  char* data_;
};

void ShmTransport::exchange(const OpInfo& op, std::vector<SendSpec>& sends,
                            std::vector<RecvSpec>& recvs) {
  throwIfAborted(op);
  std::vector<SendState> ss;
  std::vector<RecvState> rs;
  startProgress(op, sends, recvs, &ss, &rs);
  std::vector<int> peers;
  Doorbell& mine = bells_[rank_];
  auto idleSince = Clock::now();
  int gone = -1;  // a peer whose connection closed; fatal if a full pass then moves nothing
  while (true) {
    bool progress = false, open = false;
    for (auto& s : ss) {
      if (s.done < s.total()) {
        progress |= progressSend(s);
        open |= s.done < s.total();
      }
    }
    for (auto& r : rs) {
      if (!r.finished()) {
        progress |= progressRecv(op, r);
        open |= !r.finished();
      }
    }
    if (!open) return;
    if (progress) {
      idleSince = Clock::now();
      gone = -1;
      continue;
    }
    if (gone >= 0) {
      // It may have pushed everything and exited before we looked: only now,
      // with nothing left in the rings, is its absence an error.
      tcp_->failOp(op, gone, "connection closed by the peer (it exited or aborted)");
    }
    throwIfAborted(op);
    const auto now = Clock::now();
    const auto idleUs = std::chrono::duration_cast<std::chrono::microseconds>(now - idleSince);
    if (now >= op.deadline) timeout(op, ss, rs);
    WaitPolicy& policy = tcp_->waitPolicy();
    const int64_t spinUs = policy.spinUs();
    if (idleUs.count() < spinUs) {
      cpuRelax();
      continue;
    }
    if (idleUs.count() < spinUs + policy.yieldUs()) {
      policy.yield();
      continue;
    }
    // Sleep on the doorbell: arm, then look once more, so a peer that pushed
    // after our last look either is seen now or sees the flag and wakes us.
    mine.sleeping.store(1);
    const uint32_t seen = mine.ring.load();
    bool ready = false;
    for (auto& s : ss) {
      if (s.done < s.total()) {
        const RingControl& c = control(rank_, s.spec->peer);
        ready |= c.head.load() - c.tail.load() < ringBytes_;
      }
    }
    for (auto& r : rs) {
      if (!r.finished()) {
        const RingControl& c = control(r.spec->peer, rank_);
        ready |= c.head.load() != c.tail.load();
      }
    }
    if (!ready) {
      const int ms = std::max(1, std::min(kSleepMs, millisUntil(op.deadline)));
      futexWait(&mine.ring, seen, ms);
    }
    mine.sleeping.store(0);
    throwIfAborted(op);
    // A peer that died closed its sockets. Only peers we still wait on count:
    // one that got all it needed from us may legitimately be gone already.
    peers.clear();
    for (auto& x : ss) if (x.done < x.total()) peers.push_back(x.spec->peer);
    for (auto& x : rs) if (!x.finished()) peers.push_back(x.spec->peer);
    gone = tcp_->closedPeer(peers);
  }
}

// Maps the segment `name` (creating it when `create`); nullptr on failure.
void* mapSegment(const std::string& name, size_t bytes, bool create, std::string* why) {
  int fd = create ? ::shm_open(name.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600)
                  : ::shm_open(name.c_str(), O_RDWR, 0600);
  if (fd < 0) {
    *why = std::string("shm_open: ") + std::strerror(errno);
    return nullptr;
  }
  if (create) {
    // posix_fallocate reserves the pages now: a full /dev/shm fails here
    // instead of SIGBUS on first touch.
    int err = ::ftruncate(fd, static_cast<off_t>(bytes)) != 0 ? errno
                                                              : ::posix_fallocate(fd, 0, bytes);
    if (err != 0) {
      *why = std::string("reserving ") + std::to_string(bytes) + " bytes: " + std::strerror(err);
      ::close(fd);
      ::shm_unlink(name.c_str());
      return nullptr;
    }
  } else {
    struct stat st {};
    if (::fstat(fd, &st) != 0 || static_cast<size_t>(st.st_size) != bytes) {
      *why = "segment has the wrong size";
      ::close(fd);
      return nullptr;
    }
  }
  void* base = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  ::close(fd);
  if (base == MAP_FAILED) {
    *why = std::string("mmap: ") + std::strerror(errno);
    if (create) ::shm_unlink(name.c_str());
    return nullptr;
  }
  return base;
}

// The segment name's prefix for this pid namespace: names carry the
// creator's pid, so a later start can tell a dead creator's leftovers.
std::string segmentPrefix() {
  struct stat st {};
  unsigned long ns = ::stat("/proc/self/ns/pid", &st) == 0 ? st.st_ino : 0;
  return "ringreduce-" + std::to_string(ns) + "-";
}

// Unlinks segments of this pid namespace whose creator is gone: the name of a
// group whose ranks all died before unlinking it (a crash during set-up).
void reclaimStaleSegments() {
  const std::string prefix = segmentPrefix();
  DIR* dir = ::opendir("/dev/shm");
  if (dir == nullptr) return;
  while (dirent* e = ::readdir(dir)) {
    const std::string name = e->d_name;
    if (name.compare(0, prefix.size(), prefix) != 0) continue;
    const long pid = std::atol(name.c_str() + prefix.size());
    if (pid > 0 && ::kill(static_cast<pid_t>(pid), 0) != 0 && errno == ESRCH) {
      ::shm_unlink(("/" + name).c_str());
    }
  }
  ::closedir(dir);
}

// Waits for the store key `key`, watching the TCP mesh meanwhile: a peer that
// died (its connections closed) makes this give up at once. Returns "" when
// the key appeared, else why not (`missing` at the deadline).
std::string waitWatching(tcp::TcpTransport& tcp, const std::string& key, int rank, int size,
                         Clock::time_point deadline, const std::string& missing) {
  std::vector<int> peers;
  for (int r = 0; r < size; ++r) {
    if (r != rank) peers.push_back(r);
  }
  // One store call for the whole wait (a slow store is no error before the
  // deadline); the mesh is looked at every 100 ms meanwhile.
  int gone = -1;
  auto peerGone = [&] {
    gone = tcp.closedPeer(peers);
    return gone >= 0;
  };
  if (tcp.store().waitForUnless(key, deadline, "setting up shared memory", peerGone,
                                std::chrono::milliseconds(100))) {
    return "";
  }
  if (gone >= 0) {
    return "rank " + std::to_string(gone) + " left during the set-up (it died or failed)";
  }
  return missing;
}

}  // namespace

// Test seams, set from Python by the fault tests only.
ShmTestHooks& hooks() {
  static ShmTestHooks h;
  return h;
}

std::unique_ptr<Transport> overSharedMemory(std::unique_ptr<tcp::TcpTransport> tcp,
                                            const c10::intrusive_ptr<c10d::Store>& store,
                                            int rank, int size,
                                            std::chrono::milliseconds timeout) {
  (void)store;  // every call goes through tcp->store(), bounded by the deadline
  if (size <= 1 || envInt(kEnvShm, 1) == 0) return tcp;
  const auto deadline = Clock::now() + timeout;
  const std::string prefix = rankPrefix(rank, size);
  StoreCalls& st = tcp->store();
  const std::string what = "setting up shared memory";
  // Reads a key another rank sets, giving up early if a peer dies.
  auto getWatched = [&](const std::string& key, const std::string& missing) {
    std::string why = waitWatching(*tcp, key, rank, size, deadline, missing);
    if (!why.empty()) throwTransportError(prefix + " " + what + ": " + why);
    return st.get(key, deadline, what, missing);
  };
  // 1. Same host? Every rank publishes its identity and reads all of them, so
  //    all ranks reach the same answer.
  const std::string me = hostIdentity();
  st.set(tcp->storeKey("shm/host/" + std::to_string(rank)), me, deadline, what);
  for (int r = 0; r < size; ++r) {
    const std::string theirs =
        getWatched(tcp->storeKey("shm/host/" + std::to_string(r)),
                   "rank " + std::to_string(r) +
                       " did not publish its host within the group timeout (did it die?)");
    if (theirs != me) {
      if (debugEnabled()) {
        fprintf(stderr, "%s shared memory not used: rank %d is on another host (%s, here %s)\n",
                prefix.c_str(), r, theirs.c_str(), me.c_str());
      }
      return tcp;
    }
  }
  // 2. Ring size: the default unless the segment would pass kMaxSegmentBytes.
  int64_t ringBytes = envInt(kEnvShmRingBytes, kDefaultRingBytes);
  while (ringBytes > kMinRingBytes &&
         static_cast<int64_t>(ShmTransport::segmentBytes(size, ringBytes)) > kMaxSegmentBytes) {
    ringBytes /= 2;
  }
  ringBytes = std::max<int64_t>(kMinRingBytes, ringBytes / 64 * 64);
  const size_t bytes = ShmTransport::segmentBytes(size, ringBytes);
  // 3. Rank 0 publishes the name, then creates the segment; every rank maps
  //    it and reports; all use it only if all mapped it. The name is in the
  //    store before the segment exists, so whichever rank outlives a crash can
  //    unlink it; every rank does, once all have reported or given up.
  std::string name, why;
  void* base = nullptr;
  if (rank == 0) {
    reclaimStaleSegments();
    name = "/" + segmentPrefix() + std::to_string(::getpid()) + "-" +
           std::to_string(std::chrono::steady_clock::now().time_since_epoch().count());
    st.set(tcp->storeKey("shm/name"), name, deadline, what);
    base = mapSegment(name, bytes, true, &why);
    if (base != nullptr) {
      auto* h = new (base) SegmentHeader();
      h->magic = kSegmentMagic;
      h->size = size;
      h->ringBytes = ringBytes;
      h->aborted.store(0);
      // Doorbells and ring counters start at zero (fresh pages are zeroed).
      if (hooks().dieAfterCreate) ::raise(SIGKILL);
    }
    st.set(tcp->storeKey("shm/created"), base != nullptr ? "1" : "0", deadline, what);
  } else {
    name = getWatched(tcp->storeKey("shm/name"),
                      "rank 0 did not name the shared-memory segment within the group timeout");
    std::string created;
    try {
      created = getWatched(tcp->storeKey("shm/created"),
                           "rank 0 did not create the shared-memory segment within the group "
                           "timeout");
    } catch (...) {
      ::shm_unlink(name.c_str());  // rank 0 may have died after creating it
      throw;
    }
    if (created == "1") {
      base = mapSegment(name, bytes, false, &why);
      auto* h = static_cast<SegmentHeader*>(base);
      if (base != nullptr && (h->magic != kSegmentMagic || h->size != size ||
                              h->ringBytes != ringBytes)) {
        why = "segment header does not match this group";
        ::munmap(base, bytes);
        base = nullptr;
      }
    }
  }
  st.add(tcp->storeKey("shm/ok"), base != nullptr ? 1 : 0, deadline, what);
  if (st.add(tcp->storeKey("shm/reported"), 1, deadline, what) == size) {
    st.set(tcp->storeKey("shm/all"), "1", deadline, what);
  }
  const std::string missing =
      waitWatching(*tcp, tcp->storeKey("shm/all"), rank, size, deadline,
                   "not every rank reported within the group timeout");
  if (!name.empty()) ::shm_unlink(name.c_str());  // idempotent; the mappings stay
  if (!missing.empty()) {
    if (base != nullptr) ::munmap(base, bytes);
    throwTransportError(prefix + " " + what + ": " + missing);
  }
  const bool allMapped = st.add(tcp->storeKey("shm/ok"), 0, deadline, what) == size;
  if (!allMapped) {
    if (base != nullptr) ::munmap(base, bytes);
    if (debugEnabled()) {
      fprintf(stderr, "%s shared memory not used (%s); staying on TCP\n", prefix.c_str(),
              why.empty() ? "another rank could not map it" : why.c_str());
    }
    return tcp;
  }
  if (debugEnabled()) {
    fprintf(stderr, "%s shared memory: %zu bytes, %lld-byte rings\n", prefix.c_str(), bytes,
            static_cast<long long>(ringBytes));
  }
  return std::make_unique<ShmTransport>(std::move(tcp), rank, size, base, bytes, ringBytes);
}

}  // namespace shm
}  // namespace ringreduce
