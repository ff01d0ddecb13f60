// Shared-memory transport set-up: is every rank on this host, the segment's
// name, creation, mapping and unlinking (see shm_transport.h for the design).
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <dirent.h>
#include <signal.h>

#include <cerrno>
#include <cstring>
#include <fstream>
#include <new>

#include "common/env.h"
#include "transport/shm/shm_segment.h"
#include "transport/shm/shm_transport.h"

namespace ringreduce {
namespace shm {
namespace {

using tcp::Clock;

constexpr int64_t kDefaultRingBytes = 256 << 10;
constexpr int64_t kMinRingBytes = 4 << 10;
constexpr int64_t kMaxSegmentBytes = int64_t{256} << 20;
// Each rank's staging area of the two-step all-reduce (two per rank): the
// data it contributes per round (see docs/DESIGN.md for the measurements).
constexpr int64_t kDefaultStagingBytes = 1 << 20;
constexpr int64_t kMinStagingBytes = 4 << 10;
constexpr int64_t kMaxStagingTotal = int64_t{64} << 20;

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

// The segment's sizes: staging areas of kDefaultStagingBytes (or the test
// hook's) halved while all 2n of them would pass kMaxStagingTotal, then rings
// of RINGREDUCE_SHM_RING_BYTES halved while the segment would pass
// kMaxSegmentBytes.
Layout layoutFor(int size) {
  int64_t staging = hooks().stagingBytes > 0 ? hooks().stagingBytes : kDefaultStagingBytes;
  while (staging > kMinStagingBytes && 2 * size * staging > kMaxStagingTotal) staging /= 2;
  staging = std::max<int64_t>(kMinStagingBytes, staging / 64 * 64);
  int64_t ringBytes = envInt(kEnvShmRingBytes, kDefaultRingBytes);
  while (ringBytes > kMinRingBytes &&
         static_cast<int64_t>(Layout::of(size, ringBytes, staging).total) > kMaxSegmentBytes) {
    ringBytes /= 2;
  }
  ringBytes = std::max<int64_t>(kMinRingBytes, ringBytes / 64 * 64);
  return Layout::of(size, static_cast<size_t>(ringBytes), static_cast<size_t>(staging));
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
  // 2. Sizes: see layoutFor.
  const Layout layout = layoutFor(size);
  const size_t bytes = layout.total;
  const int64_t ringBytes = static_cast<int64_t>(layout.ringBytes);
  const int64_t stagingBytes = static_cast<int64_t>(layout.stagingBytes);
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
      h->stagingBytes = stagingBytes;
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
                              h->ringBytes != ringBytes || h->stagingBytes != stagingBytes)) {
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
    fprintf(stderr, "%s shared memory: %zu bytes, %lld-byte rings, %lld-byte staging areas\n",
            prefix.c_str(), bytes, static_cast<long long>(ringBytes),
            static_cast<long long>(stagingBytes));
  }
  return makeShmTransport(std::move(tcp), rank, base, layout);
}

}  // namespace shm
}  // namespace ringreduce
