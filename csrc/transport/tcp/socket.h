// Thin, checked wrappers over POSIX sockets (IPv4). Every failure names the
// address involved and strerror(errno).
#pragma once

#include <netinet/in.h>

#include <chrono>
#include <cstddef>
#include <string>

namespace ringreduce {
namespace tcp {

using Clock = std::chrono::steady_clock;

// The IPv4 address this rank listens on and advertises: $RINGREDUCE_SOCKET_ADDR,
// else the address of $RINGREDUCE_SOCKET_IFNAME, else the local address of the
// route to the store's host (storeHost, else $MASTER_ADDR), else 127.0.0.1.
std::string chooseLocalAddress(const std::string& storeHost);

// "10.0.0.3:41234"
std::string formatAddress(const sockaddr_in& addr);
// Parses "host:port" (host may be a name) into *out; false on failure.
bool parseAddress(const std::string& text, sockaddr_in* out);

// A listening socket on addr with an ephemeral port; *bound receives the
// actual address. Throws on failure.
int listenOn(const std::string& addr, sockaddr_in* bound);

// Connects to `to`, retrying refused connections until the deadline (the peer
// may not be listening yet); an attempt the peer never answers ends at the
// deadline too. Throws on failure or timeout.
int connectTo(const sockaddr_in& to, Clock::time_point deadline);

void setNonBlocking(int fd, bool on);
void setNoDelay(int fd);
// Blocking I/O of exactly n bytes with a deadline, for the handshake only.
// Returns an empty string on success, else what went wrong.
std::string readFully(int fd, void* buf, size_t n, Clock::time_point deadline);
std::string writeFully(int fd, const void* buf, size_t n, Clock::time_point deadline);

// Milliseconds until the deadline, clamped to [0, INT_MAX - 1].
int millisUntil(Clock::time_point deadline);

}  // namespace tcp
}  // namespace ringreduce
