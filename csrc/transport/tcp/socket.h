// Thin, checked wrappers over POSIX sockets, IPv4 and IPv6. Every failure
// names the address involved and strerror(errno).
#pragma once

#include <netinet/in.h>
#include <sys/socket.h>

#include <chrono>
#include <cstddef>
#include <string>

namespace ringreduce {
namespace tcp {

using Clock = std::chrono::steady_clock;

// An IPv4 or IPv6 socket address.
struct SockAddr {
  sockaddr_storage storage{};
  socklen_t len = sizeof(sockaddr_storage);
  int family() const { return storage.ss_family; }
  sockaddr* ptr() { return reinterpret_cast<sockaddr*>(&storage); }
  const sockaddr* ptr() const { return reinterpret_cast<const sockaddr*>(&storage); }
};

// The address this rank listens on and advertises (IPv4 or IPv6):
// $RINGREDUCE_SOCKET_ADDR, else the address of $RINGREDUCE_SOCKET_IFNAME (its
// IPv4 one, else its global IPv6 one), else the local address of the route to
// the store's host (storeHost, else $MASTER_ADDR), else 127.0.0.1.
std::string chooseLocalAddress(const std::string& storeHost);

// "10.0.0.3:41234", "[fd00::3]:41234"
std::string formatAddress(const SockAddr& addr);
// Parses "host:port", "[ipv6]:port" or "ipv6:port" (the last colon ends the
// host; a host may be a name) into *out; false on failure.
bool parseAddress(const std::string& text, SockAddr* out);

// A listening socket on addr with an ephemeral port; *bound receives the
// actual address. Throws on failure.
int listenOn(const std::string& addr, SockAddr* bound);

// Connects to `to`, retrying refused connections until the deadline (the peer
// may not be listening yet); an attempt the peer never answers ends at the
// deadline too. Throws on failure or timeout.
int connectTo(const SockAddr& to, Clock::time_point deadline);

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
