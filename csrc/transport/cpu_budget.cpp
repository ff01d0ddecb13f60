#include "transport/cpu_budget.h"

#include <sched.h>

#include <algorithm>
#include <cerrno>
#include <fstream>
#include <set>
#include <sstream>

namespace ringreduce {
namespace {

// ceil(quota / period) CPUs, or 0 for no quota ("max", -1) or unreadable.
int quotaCpus(long long quota, long long period) {
  if (quota <= 0 || period <= 0) return 0;
  return static_cast<int>((quota + period - 1) / period);
}

int readV2(const std::string& dir) {
  std::ifstream in(dir + "/cpu.max");
  std::string quota;
  long long period = 0;
  if (!(in >> quota >> period) || quota == "max") return 0;
  try {
    return quotaCpus(std::stoll(quota), period);
  } catch (const std::exception&) {
    return 0;
  }
}

int readV1(const std::string& dir) {
  std::ifstream q(dir + "/cpu.cfs_quota_us"), p(dir + "/cpu.cfs_period_us");
  long long quota = 0, period = 0;
  if (!(q >> quota) || !(p >> period)) return 0;
  return quotaCpus(quota, period);
}

// The lowest quota from `dir`/`path` up to `dir` (the cgroup's ancestors
// cap it too); a path that does not exist under the mount (a container's
// view without a cgroup namespace) is skipped, its root still read.
int lowestAlong(const std::string& dir, std::string path, int (*read)(const std::string&)) {
  int lowest = 0;
  while (true) {
    lowest = tighterLimit(lowest, read(dir + path));
    if (path.empty() || path == "/") break;
    const size_t cut = path.find_last_of('/');
    path = cut == std::string::npos ? "" : path.substr(0, cut);
  }
  return lowest;
}

}  // namespace

std::vector<int> allowedCpus() {
  for (int n = CPU_SETSIZE; n <= (1 << 16); n *= 2) {
    cpu_set_t* set = CPU_ALLOC(n);
    if (set == nullptr) return {};
    const size_t bytes = CPU_ALLOC_SIZE(n);
    CPU_ZERO_S(bytes, set);
    if (sched_getaffinity(0, bytes, set) == 0) {
      std::vector<int> cpus;
      for (int c = 0; c < n; ++c) {
        if (CPU_ISSET_S(c, bytes, set)) cpus.push_back(c);
      }
      CPU_FREE(set);
      return cpus;
    }
    const int err = errno;
    CPU_FREE(set);
    if (err != EINVAL) return {};  // EINVAL: the kernel has more CPUs than the set
  }
  return {};
}

std::string formatCpuList(const std::vector<int>& cpus) {
  std::ostringstream out;
  for (size_t i = 0; i < cpus.size();) {
    size_t j = i;
    while (j + 1 < cpus.size() && cpus[j + 1] == cpus[j] + 1) ++j;
    if (i > 0) out << ',';
    out << cpus[i];
    if (j > i) out << '-' << cpus[j];
    i = j + 1;
  }
  return out.str();
}

std::vector<int> parseCpuList(const std::string& list) {
  std::set<int> cpus;
  std::istringstream in(list);
  std::string item;
  while (std::getline(in, item, ',')) {
    int first = -1, last = -1;
    char dash = 0, extra = 0;
    std::istringstream one(item);
    if (!(one >> first) || first < 0) break;
    if (one >> dash) {
      if (dash != '-' || !(one >> last) || last < first || (one >> extra)) break;
    } else {
      last = first;
    }
    for (int c = first; c <= last; ++c) cpus.insert(c);
  }
  return {cpus.begin(), cpus.end()};
}

int cgroupCpuLimit(const std::string& procCgroup, const std::string& mountRoot) {
  std::ifstream in(procCgroup);
  std::string line;
  int lowest = 0;
  auto take = [&lowest](int cpus) { lowest = tighterLimit(lowest, cpus); };
  // "<id>:<controllers>:<path>": v2 has id 0 and no controllers; v1 names
  // them, and the cpu controller's mount is named after its list ("cpu",
  // "cpu,cpuacct").
  while (std::getline(in, line)) {
    const size_t a = line.find(':'), b = line.find(':', a + 1);
    if (a == std::string::npos || b == std::string::npos) continue;
    const std::string controllers = line.substr(a + 1, b - a - 1);
    std::string path = line.substr(b + 1);
    if (path == "/") path.clear();
    if (controllers.empty()) {
      take(lowestAlong(mountRoot, path, readV2));
      continue;
    }
    std::istringstream names(controllers);
    std::string name;
    bool cpu = false;
    while (std::getline(names, name, ',')) cpu = cpu || name == "cpu";
    if (cpu) {
      take(lowestAlong(mountRoot + "/" + controllers, path, readV1));
      if (controllers != "cpu") take(lowestAlong(mountRoot + "/cpu", path, readV1));
    }
  }
  return lowest;
}

}  // namespace ringreduce
