// Environment configuration: every RINGREDUCE_* variable the extension reads
// is declared here, once (name, documented default, meaning), and read only
// through envInt/envString with its declaration. kEnvVariables lists them for
// torch_ringreduce.environment() and for the test that checks the table of
// docs/user-guide/environment.md; the Python-side and build variables are declared in
// torch_ringreduce/_env.py.
#pragma once

#include <cstdint>
#include <string>

namespace ringreduce {

struct EnvVar {
  const char* name;
  const char* fallback;  // the default as documented (some depend on the machine)
  const char* meaning;
  bool integer;          // read with envInt (else envString)
};

inline constexpr EnvVar kEnvIfname{"RINGREDUCE_SOCKET_IFNAME", "route to `MASTER_ADDR`",
                                   "network interface whose address peers connect to (its IPv4 one, else its global IPv6 one)",
                                   false};
inline constexpr EnvVar kEnvAddr{"RINGREDUCE_SOCKET_ADDR", "",
                                 "explicit IPv4 or IPv6 address to listen on and advertise", false};
// --8<-- [start:segment]
inline constexpr EnvVar kEnvSegmentBytes{
    "RINGREDUCE_SEGMENT_BYTES", "262144",
    "largest message of a ring step (pipelining / scratch size)", true};
// 256 KiB: the scratch block stays in L2 while it is reduced (measured faster
// than 1-16 MiB on 2-4 ranks).
constexpr int64_t kDefaultSegmentBytes = 256 << 10;
// --8<-- [end:segment]
// The waiting budgets (transport/wait_policy.h): unset, they adapt to the
// machine; set, they are fixed.
inline constexpr EnvVar kEnvSpinUs{
    "RINGREDUCE_SPIN_US",
    "50 when the group's ranks on this host are at most the CPUs they may use (their "
    "affinity, the cgroup quota) and no more threads are runnable than cores, else 0",
    "microseconds a waiting rank busy-polls before sleeping (setting it turns adaptation off)",
    true};
inline constexpr EnvVar kEnvYieldUs{
    "RINGREDUCE_YIELD_US",
    "200, but 0 while more threads are runnable than max(cores, the group's ranks on this "
    "host) + 1",
    "then microseconds it polls, yielding the core between tries, before sleeping (setting "
    "it turns adaptation off)",
    true};
inline constexpr EnvVar kEnvWakeSliceUs{
    "RINGREDUCE_WAKE_SLICE_US", "100",
    "scheduler time slice, in microseconds, a waiting thread asks for while it sleeps "
    "(Linux 6.12+, sched_setattr): woken by its peer, it then takes the core from a "
    "CPU-bound thread at once instead of when that thread's slice ends; `0` leaves the "
    "slice alone",
    true};
inline constexpr EnvVar kEnvShm{
    "RINGREDUCE_SHM", "`1`",
    "`0` keeps collectives on TCP even when every rank is on this host", true};
inline constexpr EnvVar kEnvShmMemfd{
    "RINGREDUCE_SHM_MEMFD", "`1`",
    "`0` names the shared-memory segment in /dev/shm (shm_open) instead of passing an "
    "anonymous memfd, which needs no room in /dev/shm and leaves no name behind (for hosts "
    "where a rank may not open another's /proc/<pid>/fd)",
    true};
inline constexpr EnvVar kEnvShmRingBytes{
    "RINGREDUCE_SHM_RING_BYTES", "262144",
    "bytes of each shared-memory ring buffer (one per ordered pair of ranks; halved while "
    "the segment would pass 256 MiB)",
    true};
inline constexpr EnvVar kEnvAllreduce{
    "RINGREDUCE_ALLREDUCE", "`auto`",
    "all-reduce algorithm of groups created from now on: `auto` (by size, see docs/algorithms.md), "
    "`ring`, `direct` (one step, every rank sends all), `two_step` (shared memory on one "
    "host only) or `hierarchical` (several hosts with as many ranks each, sharing memory "
    "within a host); `auto` where the forced one cannot run; every rank must set the same",
    false};
inline constexpr EnvVar kEnvCpuAvx2{
    "RINGREDUCE_CPU_AVX2", "`1`",
    "`0` runs the baseline (SSE2) build of the CPU kernels (batch norm, and the reductions "
    "every CPU collective folds with) instead of the AVX2 one (bitwise the same results)",
    true};
inline constexpr EnvVar kEnvDebug{"RINGREDUCE_DEBUG", "0",
                                  "`1` logs connection set-up and aborts to stderr", true};

// Every variable above, in the documented table's order.
inline constexpr const EnvVar* kEnvVariables[] = {
    &kEnvIfname,   &kEnvAddr,         &kEnvSegmentBytes, &kEnvSpinUs,
    &kEnvYieldUs,  &kEnvWakeSliceUs,  &kEnvShm,          &kEnvShmMemfd,     &kEnvShmRingBytes,
    &kEnvAllreduce, &kEnvCpuAvx2,     &kEnvDebug};

std::string envString(const EnvVar& var, const std::string& fallback);
int64_t envInt(const EnvVar& var, int64_t fallback);
// Whether the variable is set to a non-empty value.
bool envIsSet(const EnvVar& var);
bool debugEnabled();

}  // namespace ringreduce
