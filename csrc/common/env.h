// Environment configuration. Every variable the project reads is listed here
// (and in README.md).
#pragma once

#include <cstdint>
#include <string>

namespace ringreduce {

// RINGREDUCE_SOCKET_IFNAME: network interface whose IPv4 address peers connect to.
constexpr const char* kEnvIfname = "RINGREDUCE_SOCKET_IFNAME";
// RINGREDUCE_SOCKET_ADDR: explicit IPv4 address to listen on and advertise.
constexpr const char* kEnvAddr = "RINGREDUCE_SOCKET_ADDR";
// RINGREDUCE_SEGMENT_BYTES: largest message of a ring step (pipelining unit).
constexpr const char* kEnvSegmentBytes = "RINGREDUCE_SEGMENT_BYTES";
// RINGREDUCE_SPIN_US: microseconds a rank busy-polls before sleeping while it
// waits for a peer (default kDefaultSpinUs when the world size is at most the
// number of cores here, else 0).
constexpr const char* kEnvSpinUs = "RINGREDUCE_SPIN_US";
constexpr int64_t kDefaultSpinUs = 50;
// RINGREDUCE_YIELD_US: microseconds a rank then polls with sched_yield() between
// tries before sleeping (default kDefaultYieldUs when the world size is above
// the number of cores, where the rank it waits for may need this core, else 0).
constexpr const char* kEnvYieldUs = "RINGREDUCE_YIELD_US";
constexpr int64_t kDefaultYieldUs = 200;
// RINGREDUCE_DEBUG=1: log connection set-up and aborts to stderr.
constexpr const char* kEnvDebug = "RINGREDUCE_DEBUG";

std::string envString(const char* name, const std::string& fallback);
int64_t envInt(const char* name, int64_t fallback);
bool debugEnabled();

}  // namespace ringreduce
