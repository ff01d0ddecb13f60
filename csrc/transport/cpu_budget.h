// The CPUs a host's ranks of a group may use, for the wait policy's "do the
// ranks fit the cores" rule: the union of the ranks' affinity masks (ranks
// pinned one per core by mpirun or numactl still fit), capped by the CPU
// quota of this process's cgroup (a container given 2 CPUs of a 64-core
// machine: spinning 4 ranks there would burn the quota and be throttled).
#pragma once

#include <string>
#include <vector>

namespace ringreduce {

// The CPUs this process may run on (sched_getaffinity), ascending; empty
// when the kernel does not say.
std::vector<int> allowedCpus();

// Linux's cpulist form ("0-3,8,10-11") and back; parsing stops at the first
// malformed item and returns what came before it.
std::string formatCpuList(const std::vector<int>& cpus);
std::vector<int> parseCpuList(const std::string& list);

// The CPUs the cgroup quota of this process grants, rounded up (the lowest
// along the path to the cgroup root: cgroup v2 cpu.max, v1
// cpu.cfs_quota_us / cpu.cfs_period_us); 0 when there is no quota or it
// cannot be read. The arguments exist for the tests.
int cgroupCpuLimit(const std::string& procCgroup = "/proc/self/cgroup",
                   const std::string& mountRoot = "/sys/fs/cgroup");

// The tighter of two CPU limits where 0 means "none": min(a, b) over the
// positive ones, 0 when neither is.
inline int tighterLimit(int a, int b) {
  if (a <= 0) return b > 0 ? b : 0;
  return b > 0 && b < a ? b : a;
}

}  // namespace ringreduce
