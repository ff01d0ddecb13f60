// The transport factory (see factory.h).
#include "transport/factory.h"

#include <sys/stat.h>
#include <unistd.h>

#include <fstream>
#include <map>
#include <set>

#include "common/env.h"
#include "transport/cpu_budget.h"
#include "transport/routed_transport.h"
#include "transport/shm/shm_transport.h"
#include "transport/tcp/tcp_transport.h"

namespace ringreduce {
namespace {

using Clock = std::chrono::steady_clock;

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

// The file system behind /dev/shm (mount namespaces differ under `ip netns
// exec`, yet see the same tmpfs there).
std::string shmFileSystem() {
  struct stat st {};
  if (::stat("/dev/shm", &st) != 0) return "?";
  return std::to_string(st.st_dev) + ":" + std::to_string(st.st_ino);
}

// Ranks with the same identity share /dev/shm and can futex on it: the same
// "host" for the factory (a network namespace counts as a host of its own).
std::string hostIdentity() {
  char host[256] = {0};
  ::gethostname(host, sizeof(host) - 1);
  return std::string(host) + "|" + readFirstLine("/proc/sys/kernel/random/boot_id") + "|" +
         linkTarget("/proc/self/ns/pid") + "|" + linkTarget("/proc/self/ns/ipc") + "|" +
         linkTarget("/proc/self/ns/net") + "|" + shmFileSystem();
}

// Every rank publishes "<shm wanted 0|1>|<its CPUs, a cpulist>|<identity>"
// and reads everyone's, so all ranks build the same table. *shmWanted: no
// rank set RINGREDUCE_SHM=0. *hostCpus: how many CPUs this rank's host's
// ranks may run on between them (the union of their affinity masks; 0 when
// one of them could not tell).
Topology learnTopology(Mesh& mesh, Clock::time_point deadline, bool* shmWanted,
                       int* hostCpus) {
  const int rank = mesh.rank(), size = mesh.size();
  const std::string what = "learning which ranks share a host";
  StoreCalls& st = mesh.store();
  auto key = [&](int r) { return mesh.storeKey("host/" + std::to_string(r)); };
  const std::string mine = std::string(envInt(kEnvShm, 1) != 0 ? "1" : "0") + "|" +
                           formatCpuList(allowedCpus()) + "|" + hostIdentity();
  st.set(key(rank), mine, deadline, what);
  std::vector<int> peers;
  for (int r = 0; r < size; ++r) {
    if (r != rank) peers.push_back(r);
  }
  Topology t;
  t.hostOf.assign(size, -1);
  t.localIndex.assign(size, -1);
  std::map<std::string, int> hostIndex;
  *shmWanted = true;
  std::vector<std::string> cpusOf(size);
  for (int r = 0; r < size; ++r) {
    std::string theirs = mine;
    if (r != rank) {
      const std::string missing = "rank " + std::to_string(r) +
                                  " did not publish its host within the group timeout (did it die?)";
      const std::string why = awaitKeyWatching(mesh, key(r), peers, deadline, what, missing);
      if (!why.empty()) throwTransportError(rankPrefix(rank, size) + " " + what + ": " + why);
      theirs = st.get(key(r), deadline, what, missing);
    }
    *shmWanted = *shmWanted && theirs.compare(0, 2, "1|") == 0;
    const size_t cpusAt = theirs.find('|') + 1, identityAt = theirs.find('|', cpusAt) + 1;
    cpusOf[r] = theirs.substr(cpusAt, identityAt - 1 - cpusAt);
    const std::string identity = theirs.substr(identityAt);
    auto [at, fresh] = hostIndex.emplace(identity, static_cast<int>(t.hosts.size()));
    if (fresh) t.hosts.emplace_back();
    t.hostOf[r] = at->second;
    t.localIndex[r] = static_cast<int>(t.hosts[at->second].size());
    t.hosts[at->second].push_back(r);
  }
  std::set<int> cpus;
  *hostCpus = 0;
  for (int r : t.hosts[t.hostOf[rank]]) {
    const std::vector<int> theirs = parseCpuList(cpusOf[r]);
    if (theirs.empty()) return t;
    cpus.insert(theirs.begin(), theirs.end());
  }
  *hostCpus = static_cast<int>(cpus.size());
  return t;
}

}  // namespace

std::unique_ptr<Transport> connectGroup(const c10::intrusive_ptr<c10d::Store>& store, int rank,
                                        int size, std::chrono::milliseconds timeout) {
  // One deadline for the whole set-up: the group timeout bounds it all.
  const auto deadline = Clock::now() + timeout;
  // The mesh first: every data path reports failures through it, and it
  // outlives them (each TCP transport holds it).
  auto mesh = std::make_shared<tcp::TcpMesh>(store, rank, size, timeout);
  if (size <= 1) return std::make_unique<tcp::TcpTransport>(mesh, Topology::singleHost(size));
  bool shmWanted = false;
  int hostCpus = 0;
  Topology t = learnTopology(*mesh, deadline, &shmWanted, &hostCpus);
  const int quota = cgroupCpuLimit();
  const int usable = tighterLimit(hostCpus, quota);
  WaitPolicy& policy = mesh->waitPolicy();
  policy.setLocalRanks(static_cast<int>(t.hosts[t.hostOf[rank]].size()), usable);
  if (debugEnabled()) {
    fprintf(stderr,
            "%s %zu host(s); this host's ranks: %zu, on %u CPU(s) (their affinity %d, "
            "cgroup quota %d, machine %u)\n",
            rankPrefix(rank, size).c_str(), t.hosts.size(), t.hosts[t.hostOf[rank]].size(),
            policy.usableCpus(), hostCpus, quota, policy.machineCores());
  }
  auto tcp = std::make_unique<tcp::TcpTransport>(mesh, t);
  if (!shmWanted) return tcp;
  // The shared-memory path takes its point-to-point and its failures from the
  // TCP path and the mesh.
  std::unique_ptr<Transport> shm = shm::attach(*mesh, *tcp, t, deadline);
  if (!shm) return tcp;
  return makeRoutedTransport(std::move(tcp), std::move(shm));
}

}  // namespace ringreduce
