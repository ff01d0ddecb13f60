// Shared-memory transport set-up: the segment of this rank's host, its name,
// creation, mapping and unlinking (see shm_transport.h for the design).
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <dirent.h>
#include <signal.h>

#include <cerrno>
#include <cstring>
#include <new>

#include "common/env.h"
#include "transport/shm/shm_segment.h"
#include "transport/shm/shm_transport.h"

namespace ringreduce {
namespace shm {
namespace {

// --8<-- [start:sizes]
constexpr int64_t kDefaultRingBytes = 256 << 10;
constexpr int64_t kMinRingBytes = 4 << 10;
constexpr int64_t kMaxSegmentBytes = int64_t{256} << 20;
// Each rank's staging area of the two-step all-reduce (two per rank): the
// data it contributes per round (docs/notes.md: staging sizes).
constexpr int64_t kDefaultStagingBytes = 1 << 20;
constexpr int64_t kMinStagingBytes = 4 << 10;
constexpr int64_t kMaxStagingTotal = int64_t{64} << 20;

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
// --8<-- [end:sizes]

// A segment is passed one of two ways. By default the host's leader creates an
// anonymous memfd and publishes "memfd:<pid>:<fd>"; the others open it as
// /proc/<pid>/fd/<fd> (ranks of one host share a pid namespace: factory.cpp's
// host identity). It takes no room in /dev/shm (a container's is often 64 MiB)
// and has no name to leave behind: it is gone with the last mapping. With
// RINGREDUCE_SHM_MEMFD=0, or where memfd_create fails, the segment is named in
// /dev/shm ("/ringreduce-...", shm_open) and unlinked once every rank mapped it.
constexpr const char* kMemfdPrefix = "memfd:";

bool isNamed(const std::string& name) {
  return !name.empty() && name[0] == '/';
}

// Sizes a new segment's file and reserves its pages (posix_fallocate: a full
// /dev/shm or memory fails here instead of SIGBUS on first touch); 0 or errno.
int reserve(int fd, size_t bytes) {
  return ::ftruncate(fd, static_cast<off_t>(bytes)) != 0 ? errno
                                                         : ::posix_fallocate(fd, 0, bytes);
}

// Maps `bytes` of `fd` and closes it unless `keep`; nullptr on failure (`why`).
void* mapFd(int fd, size_t bytes, bool keep, std::string* why) {
  void* base = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (base == MAP_FAILED) *why = std::string("mmap: ") + std::strerror(errno);
  if (!keep) ::close(fd);
  return base == MAP_FAILED ? nullptr : base;
}

// Maps the named segment `name` (creating it when `create`); nullptr on failure.
void* mapNamed(const std::string& name, size_t bytes, bool create, std::string* why) {
  int fd = create ? ::shm_open(name.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600)
                  : ::shm_open(name.c_str(), O_RDWR, 0600);
  if (fd < 0) {
    *why = std::string("shm_open: ") + std::strerror(errno);
    return nullptr;
  }
  if (create) {
    if (int err = reserve(fd, bytes); err != 0) {
      *why = std::string("reserving ") + std::to_string(bytes) + " bytes in /dev/shm: " +
             std::strerror(err);
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
  void* base = mapFd(fd, bytes, false, why);
  if (base == nullptr && create) ::shm_unlink(name.c_str());
  return base;
}

// The leader's memfd segment: its mapping, and in *fd the descriptor peers
// open through /proc until every rank has reported; nullptr on failure.
void* createMemfd(size_t bytes, int* fd, std::string* why) {
  *fd = ::memfd_create("ringreduce", MFD_CLOEXEC);
  if (*fd < 0) {
    *why = std::string("memfd_create: ") + std::strerror(errno);
    return nullptr;
  }
  void* base = nullptr;
  if (int err = reserve(*fd, bytes); err != 0) {
    *why = std::string("reserving ") + std::to_string(bytes) + " bytes of memory: " +
           std::strerror(err);
  } else {
    base = mapFd(*fd, bytes, true, why);
  }
  if (base == nullptr) {
    ::close(*fd);
    *fd = -1;
  }
  return base;
}

// Another rank's memfd segment, "memfd:<pid>:<fd>"; nullptr on failure.
void* openMemfd(const std::string& name, size_t bytes, std::string* why) {
  const std::string where = name.substr(std::strlen(kMemfdPrefix));
  const size_t colon = where.find(':');
  const std::string path = "/proc/" + where.substr(0, colon) + "/fd/" + where.substr(colon + 1);
  int fd = ::open(path.c_str(), O_RDWR | O_CLOEXEC);
  if (fd < 0) {
    *why = "opening the host leader's segment as " + path + ": " + std::strerror(errno) +
           " (RINGREDUCE_SHM_MEMFD=0 names it in /dev/shm instead)";
    return nullptr;
  }
  struct stat st {};
  if (::fstat(fd, &st) != 0 || static_cast<size_t>(st.st_size) != bytes) {
    *why = "segment has the wrong size";
    ::close(fd);
    return nullptr;
  }
  return mapFd(fd, bytes, false, why);
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


// What one rank's set-up of its host's segment (attach) holds. A named
// segment's name is in the store before the segment exists, so whichever rank
// outlives a crash can unlink it; every rank does, once all have reported or
// given up. A memfd segment has no name to leave.
struct Mapped {
  std::string name;      // "/ringreduce-..." (named) or "memfd:<pid>:<fd>"
  void* base = nullptr;  // null: not mapped (`why`), or alone on the host
  std::string why;
  int fd = -1;           // the leader's memfd, open until every rank reported
};

struct SetUp {
  Mesh& mesh;
  StoreCalls& st;
  const Members& members;
  Clock::time_point deadline;
  std::string prefix;
  int leader;                   // the host's lowest rank: it creates the segment
  std::vector<int> everyone;    // every other rank of the group
  std::vector<int> hostPeers;   // the other ranks of this host
  const std::string what = "setting up shared memory";

  SetUp(Mesh& m, const Members& mem, Clock::time_point d)
      : mesh(m), st(m.store()), members(mem), deadline(d), prefix(rankPrefix(m.rank(), m.size())),
        leader(mem.ranks[0]) {
    for (int r = 0; r < m.size(); ++r) {
      if (r != m.rank()) everyone.push_back(r);
    }
    for (int r : mem.ranks) {
      if (r != m.rank()) hostPeers.push_back(r);
    }
  }

  std::string hostKey(const std::string& name) const {
    return mesh.storeKey("shm/" + std::to_string(leader) + "/" + name);
  }

  // Reads a key another rank of this host sets, giving up early if one dies.
  std::string getWatched(const std::string& key, const std::string& missing) {
    std::string why = awaitKeyWatching(mesh, key, hostPeers, deadline, what, missing);
    if (!why.empty()) throwTransportError(prefix + " " + what + ": " + why);
    return st.get(key, deadline, what, missing);
  }

  // The leader: publishes the name, then creates and maps the segment and
  // says whether it did.
  Mapped createSegment(const Layout& layout) {
    Mapped m;
    reclaimStaleSegments();
    if (envInt(kEnvShmMemfd, 1) != 0) {
      std::string why;
      m.base = createMemfd(layout.total, &m.fd, &why);
      if (m.base != nullptr) {
        m.name = kMemfdPrefix + std::to_string(::getpid()) + ":" + std::to_string(m.fd);
      } else if (debugEnabled()) {
        fprintf(stderr, "%s no memfd segment (%s); naming one in /dev/shm\n", prefix.c_str(),
                why.c_str());
      }
    }
    const bool named = m.base == nullptr;
    if (named) {
      m.name = "/" + segmentPrefix() + std::to_string(::getpid()) + "-" +
               std::to_string(std::chrono::steady_clock::now().time_since_epoch().count());
    }
    try {
      // A name goes in the store before the segment exists: whichever rank
      // outlives a crash unlinks it.
      st.set(hostKey("name"), m.name, deadline, what);
      if (named) m.base = mapNamed(m.name, layout.total, true, &m.why);
      if (m.base != nullptr) {
        auto* h = new (m.base) SegmentHeader();
        h->magic = kSegmentMagic;
        h->size = members.size();
        h->ringBytes = static_cast<int64_t>(layout.ringBytes);
        h->stagingBytes = static_cast<int64_t>(layout.stagingBytes);
        h->abortedFrom.store(0);
        // Doorbells and ring counters start at zero (fresh pages are zeroed).
        if (hooks().dieAfterCreate) ::raise(SIGKILL);
        TORCH_CHECK(!hooks().failAfterCreate, prefix, " ", what,
                    ": failed after creating the segment (testing)");
      }
      st.set(hostKey("created"), m.base != nullptr ? "1" : "0", deadline, what);
    } catch (...) {
      release(m, layout.total);  // a store call failed: nothing of it stays behind
      throw;
    }
    return m;
  }

  // Gives up a segment this rank mapped or created: the mapping, the memfd,
  // and (named, by its creator or once every rank reported) the name.
  // Idempotent.
  static void release(Mapped& m, size_t bytes) {
    if (m.base != nullptr) ::munmap(m.base, bytes);
    m.base = nullptr;
    if (m.fd >= 0) ::close(m.fd);
    m.fd = -1;
    if (isNamed(m.name)) ::shm_unlink(m.name.c_str());
  }

  // The other ranks of the host: map the leader's segment once it says it
  // created it, and check its header against this group.
  Mapped openSegment(const Layout& layout) {
    Mapped m;
    const std::string lead = "rank " + std::to_string(leader);
    m.name = getWatched(hostKey("name"),
                        lead + " did not name the shared-memory segment within the group timeout");
    std::string created;
    try {
      created = getWatched(hostKey("created"), lead +
                                                   " did not create the shared-memory segment "
                                                   "within the group timeout");
    } catch (...) {
      // The creator may have died after creating it.
      if (isNamed(m.name)) ::shm_unlink(m.name.c_str());
      throw;
    }
    if (created != "1") return m;
    m.base = isNamed(m.name) ? mapNamed(m.name, layout.total, false, &m.why)
                             : openMemfd(m.name, layout.total, &m.why);
    auto* h = static_cast<SegmentHeader*>(m.base);
    if (m.base != nullptr &&
        (h->magic != kSegmentMagic || h->size != members.size() ||
         h->ringBytes != static_cast<int64_t>(layout.ringBytes) ||
         h->stagingBytes != static_cast<int64_t>(layout.stagingBytes))) {
      m.why = "segment header does not match this group";
      ::munmap(m.base, layout.total);
      m.base = nullptr;
    }
    return m;
  }

  // Every rank of the group reports; shared memory is used only if every rank
  // that has local peers mapped its host's segment, so the choice of
  // algorithms (which depends on it) is the same everywhere. Unlinks the
  // name; unmaps `m` when not every rank mapped (false), raises when one
  // never reported.
  bool everyRankMapped(Mapped& m, size_t bytes) {
    const bool ok = members.size() < 2 || m.base != nullptr;
    const int size = mesh.size();
    st.add(mesh.storeKey("shm/ok"), ok ? 1 : 0, deadline, what);
    if (st.add(mesh.storeKey("shm/reported"), 1, deadline, what) == size) {
      st.set(mesh.storeKey("shm/all"), "1", deadline, what);
    }
    const std::string missing =
        awaitKeyWatching(mesh, mesh.storeKey("shm/all"), everyone, deadline, what,
                         "not every rank reported within the group timeout");
    // Every rank reported: none will open the segment any more; the mappings stay.
    if (isNamed(m.name)) ::shm_unlink(m.name.c_str());  // idempotent
    if (m.fd >= 0) ::close(m.fd);
    m.fd = -1;
    if (!missing.empty()) {
      release(m, bytes);
      throwTransportError(prefix + " " + what + ": " + missing);
    }
    if (st.add(mesh.storeKey("shm/ok"), 0, deadline, what) == size) return true;
    if (m.base != nullptr) ::munmap(m.base, bytes);
    m.base = nullptr;
    // Never silent: each rank that could not map says why, and rank 0 what it means.
    if (!m.why.empty()) {
      fprintf(stderr, "%s ringreduce: no shared memory with this host's ranks: %s\n",
              prefix.c_str(), m.why.c_str());
    }
    if (mesh.rank() == 0) {
      fprintf(stderr,
              "%s ringreduce: a rank could not map its host's shared-memory segment (its "
              "reason is on its stderr): this group's collectives go over TCP "
              "(RINGREDUCE_SHM=0 chooses TCP without this warning)\n",
              prefix.c_str());
    }
    return false;
  }
};

}  // namespace

// Test seams, set from Python by the fault tests only.
ShmTestHooks& hooks() {
  static ShmTestHooks h;
  return h;
}

size_t stagingBytesFor(int localRanks) {
  return layoutFor(localRanks).stagingBytes;
}

std::unique_ptr<Transport> attach(Mesh& mesh, Transport& p2p, const Topology& topology,
                                  Clock::time_point deadline) {
  const int rank = mesh.rank();
  Members members(topology.hosts[topology.hostOf[rank]], mesh.size(), rank);
  SetUp setUp(mesh, members, deadline);
  // 1. Sizes: see layoutFor (every rank of the host computes the same).
  const Layout layout = layoutFor(members.size());
  // 2. The host's segment, created by its lowest rank and mapped by the others.
  Mapped mapped;
  if (members.size() >= 2) {
    mapped = rank == setUp.leader ? setUp.createSegment(layout) : setUp.openSegment(layout);
  }
  // 3. Whether every rank that has local peers mapped its host's segment (a
  // store call that throws there leaves nothing mapped either).
  bool allMapped = false;
  try {
    allMapped = setUp.everyRankMapped(mapped, layout.total);
  } catch (...) {
    SetUp::release(mapped, layout.total);
    throw;
  }
  if (!allMapped) return nullptr;
  if (mapped.base == nullptr) return nullptr;  // alone on this host
  // --8<-- [start:stores]
  const RingStores stores = hooks().ringStores == 1 ? RingStores::kStreaming
                            : hooks().ringStores == 0 || !mesh.waitPolicy().ranksFitCores()
                                ? RingStores::kPlain
                                : RingStores::kMeasured;
  // --8<-- [end:stores]
  static const char* const kStoreNames[] = {"plain", "streaming", "measured"};
  if (debugEnabled()) {
    fprintf(stderr,
            "%s shared memory with %d rank(s) of this host: %zu bytes, %zu-byte rings "
            "(%s stores), %zu-byte staging areas\n",
            setUp.prefix.c_str(), members.size(), layout.total, layout.ringBytes,
            kStoreNames[static_cast<int>(stores)], layout.stagingBytes);
  }
  return makeShmTransport(mesh, p2p, topology, std::move(members), mapped.base, layout,
                          stores);
}

}  // namespace shm
}  // namespace ringreduce
