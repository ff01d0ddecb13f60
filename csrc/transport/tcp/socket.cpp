#include "transport/tcp/socket.h"

#include <cstdlib>
#include <arpa/inet.h>
#include <fcntl.h>
#include <ifaddrs.h>
#include <netdb.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <c10/util/Exception.h>

#include <cerrno>
#include <climits>
#include <cstring>
#include <thread>

#include "common/env.h"

namespace ringreduce {
namespace tcp {
namespace {

std::string errnoText() {
  return std::strerror(errno);
}

// The address of `host` (numeric or a name) with `port`: its IPv4 one when it
// has one (a name of a dual-stack host resolves as it always did), else its
// IPv6 one.
bool resolve(const std::string& host, uint16_t port, SockAddr* out) {
  addrinfo* res = nullptr;
  for (int family : {AF_INET, AF_INET6}) {
    addrinfo hints{};
    hints.ai_family = family;
    hints.ai_socktype = SOCK_STREAM;
    if (!host.empty() && getaddrinfo(host.c_str(), nullptr, &hints, &res) == 0 &&
        res != nullptr) {
      break;
    }
    res = nullptr;
  }
  if (res == nullptr) {
    return false;
  }
  *out = SockAddr{};
  std::memcpy(&out->storage, res->ai_addr, res->ai_addrlen);
  out->len = res->ai_addrlen;
  freeaddrinfo(res);
  if (out->family() == AF_INET) {
    reinterpret_cast<sockaddr_in*>(&out->storage)->sin_port = htons(port);
  } else if (out->family() == AF_INET6) {
    reinterpret_cast<sockaddr_in6*>(&out->storage)->sin6_port = htons(port);
  } else {
    return false;
  }
  return true;
}

// The numeric host of an address, without brackets or port.
std::string hostText(const SockAddr& addr) {
  char buf[INET6_ADDRSTRLEN] = "?";
  if (addr.family() == AF_INET6) {
    inet_ntop(AF_INET6, &reinterpret_cast<const sockaddr_in6*>(&addr.storage)->sin6_addr, buf,
              sizeof(buf));
  } else {
    inet_ntop(AF_INET, &reinterpret_cast<const sockaddr_in*>(&addr.storage)->sin_addr, buf,
              sizeof(buf));
  }
  return buf;
}

bool linkLocal(const sockaddr* sa) {
  return sa->sa_family == AF_INET6 &&
         IN6_IS_ADDR_LINKLOCAL(&reinterpret_cast<const sockaddr_in6*>(sa)->sin6_addr);
}

// The interface's IPv4 address, else its IPv6 one that is not link-local (a
// link-local one needs a scope the peers do not know).
std::string interfaceAddress(const std::string& ifname) {
  ifaddrs* list = nullptr;
  TORCH_CHECK(getifaddrs(&list) == 0, "[ringreduce] getifaddrs failed: ", errnoText());
  std::string v4, v6;
  for (ifaddrs* it = list; it != nullptr; it = it->ifa_next) {
    if (it->ifa_addr == nullptr || ifname != it->ifa_name) continue;
    SockAddr a;
    if (it->ifa_addr->sa_family == AF_INET && v4.empty()) {
      std::memcpy(&a.storage, it->ifa_addr, sizeof(sockaddr_in));
      v4 = hostText(a);
    } else if (it->ifa_addr->sa_family == AF_INET6 && v6.empty() && !linkLocal(it->ifa_addr)) {
      std::memcpy(&a.storage, it->ifa_addr, sizeof(sockaddr_in6));
      v6 = hostText(a);
    }
  }
  freeifaddrs(list);
  TORCH_CHECK_VALUE(!v4.empty() || !v6.empty(), "[ringreduce] ", kEnvIfname.name, "=", ifname,
                    ": no IPv4 or (global) IPv6 address on that interface");
  return v4.empty() ? v6 : v4;
}

// The local address the kernel would use to reach `host` (no packet is sent),
// in the family `host` resolves to.
std::string routeTo(const std::string& host) {
  SockAddr remote;
  if (!resolve(host, 9, &remote)) {
    return "";
  }
  if (remote.family() == AF_INET &&
      (ntohl(reinterpret_cast<sockaddr_in*>(&remote.storage)->sin_addr.s_addr) >> 24) == 127) {
    return "127.0.0.1";
  }
  int fd = socket(remote.family(), SOCK_DGRAM, 0);
  if (fd < 0) {
    return "";
  }
  std::string local;
  SockAddr me;
  if (connect(fd, remote.ptr(), remote.len) == 0 && getsockname(fd, me.ptr(), &me.len) == 0 &&
      !linkLocal(me.ptr())) {
    local = hostText(me);
  }
  ::close(fd);
  return local;
}

}  // namespace

std::string chooseLocalAddress(const std::string& storeHost) {
  std::string explicitAddr = envString(kEnvAddr, "");
  if (!explicitAddr.empty()) {
    return explicitAddr;
  }
  std::string ifname = envString(kEnvIfname, "");
  if (!ifname.empty()) {
    return interfaceAddress(ifname);
  }
  const char* masterAddr = std::getenv("MASTER_ADDR");  // torch's, not ours
  for (const std::string& host : {storeHost, std::string(masterAddr ? masterAddr : "")}) {
    std::string local = host.empty() ? "" : routeTo(host);
    if (!local.empty()) {
      return local;
    }
  }
  return "127.0.0.1";
}

std::string formatAddress(const SockAddr& addr) {
  const uint16_t port =
      addr.family() == AF_INET6
          ? ntohs(reinterpret_cast<const sockaddr_in6*>(&addr.storage)->sin6_port)
          : ntohs(reinterpret_cast<const sockaddr_in*>(&addr.storage)->sin_port);
  const std::string host = hostText(addr);
  return (addr.family() == AF_INET6 ? "[" + host + "]" : host) + ":" + std::to_string(port);
}

bool parseAddress(const std::string& text, SockAddr* out) {
  auto colon = text.rfind(':');
  if (colon == std::string::npos) {
    return false;
  }
  char* end = nullptr;
  long port = std::strtol(text.c_str() + colon + 1, &end, 10);
  if (*end != '\0' || port <= 0 || port > 65535) {
    return false;
  }
  std::string host = text.substr(0, colon);
  if (host.size() >= 2 && host.front() == '[' && host.back() == ']') {
    host = host.substr(1, host.size() - 2);
  }
  return resolve(host, static_cast<uint16_t>(port), out);
}

int listenOn(const std::string& addr, SockAddr* bound) {
  std::string host = addr;
  if (host.size() >= 2 && host.front() == '[' && host.back() == ']') {
    host = host.substr(1, host.size() - 2);
  }
  SockAddr want;
  TORCH_CHECK_VALUE(resolve(host, 0, &want), "[ringreduce] cannot resolve local address '",
                    addr, "' (set ", kEnvAddr.name, " or ", kEnvIfname.name, ")");
  int fd = socket(want.family(), SOCK_STREAM | SOCK_CLOEXEC, 0);
  TORCH_CHECK(fd >= 0, "[ringreduce] socket() failed: ", errnoText());
  if (bind(fd, want.ptr(), want.len) != 0 || listen(fd, 128) != 0) {
    std::string err = errnoText();
    ::close(fd);
    TORCH_CHECK(false, "[ringreduce] cannot listen on ", addr, ": ", err);
  }
  *bound = SockAddr{};
  getsockname(fd, bound->ptr(), &bound->len);
  return fd;
}

namespace {

// One connection attempt that gives up at the deadline: a blocking connect()
// to a host that drops the SYN (a firewall, a full accept queue) waits for
// the kernel's SYN retries, about two minutes, whatever the group's timeout.
// The connected socket (blocking, as before), or -1 with *err set (kNoAnswer:
// the deadline came first).
constexpr int kNoAnswer = -1;

int connectOnce(const SockAddr& to, Clock::time_point deadline, int* err) {
  int fd = socket(to.family(), SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
  TORCH_CHECK(fd >= 0, "[ringreduce] socket() failed: ", errnoText());
  *err = 0;
  if (connect(fd, to.ptr(), to.len) != 0) {
    *err = errno;
    while (*err == EINPROGRESS || *err == EINTR) {
      pollfd pfd{fd, POLLOUT, 0};
      const int ready = poll(&pfd, 1, millisUntil(deadline));
      if (ready == 0) {
        *err = kNoAnswer;
        break;
      }
      if (ready < 0) {
        *err = errno;  // EINTR: poll again
        continue;
      }
      socklen_t len = sizeof(*err);
      if (getsockopt(fd, SOL_SOCKET, SO_ERROR, err, &len) != 0) *err = errno;
      break;
    }
  }
  if (*err != 0) {
    ::close(fd);
    return -1;
  }
  setNonBlocking(fd, false);
  return fd;
}

}  // namespace

int connectTo(const SockAddr& to, Clock::time_point deadline) {
  auto backoff = std::chrono::milliseconds(10);
  while (true) {
    int err = 0;
    const int fd = connectOnce(to, deadline, &err);
    if (fd >= 0) {
      setNoDelay(fd);
      return fd;
    }
    if (err == kNoAnswer) {
      throw std::runtime_error("cannot connect to " + formatAddress(to) +
                               ": no answer before the deadline (the host drops the "
                               "connection request, or a firewall does)");
    }
    bool retry = err == ECONNREFUSED || err == ETIMEDOUT || err == EINTR || err == EAGAIN;
    if (!retry || Clock::now() + backoff >= deadline) {
      throw std::runtime_error("cannot connect to " + formatAddress(to) + ": " +
                               std::strerror(err));
    }
    std::this_thread::sleep_for(backoff);
    backoff = std::min(backoff * 2, std::chrono::milliseconds(500));
  }
}

void setNonBlocking(int fd, bool on) {
  int flags = fcntl(fd, F_GETFL, 0);
  fcntl(fd, F_SETFL, on ? (flags | O_NONBLOCK) : (flags & ~O_NONBLOCK));
}

void setNoDelay(int fd) {
  int one = 1;
  setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
}

int millisUntil(Clock::time_point deadline) {
  auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count();
  // One below INT_MAX: callers add 1 to round up, and a group timeout of
  // 25 days or more must not wrap to a negative (infinite) poll timeout.
  return ms <= 0 ? 0 : (ms >= INT_MAX ? INT_MAX - 1 : static_cast<int>(ms));
}

namespace {

// Blocking-with-deadline transfer of exactly n bytes; `reading` picks the direction.
std::string transferFully(int fd, char* p, size_t n, Clock::time_point deadline, bool reading) {
  size_t done = 0;
  while (done < n) {
    pollfd pfd{fd, static_cast<short>(reading ? POLLIN : POLLOUT), 0};
    int ready = poll(&pfd, 1, millisUntil(deadline));
    if (ready == 0) {
      return "Timed out after " + std::to_string(done) + " of " + std::to_string(n) + " bytes";
    }
    if (ready < 0) {
      if (errno == EINTR) continue;
      return std::string("poll: ") + errnoText();
    }
    ssize_t r = reading ? ::recv(fd, p + done, n - done, 0)
                        : ::send(fd, p + done, n - done, MSG_NOSIGNAL);
    if (r == 0 && reading) {
      return "connection closed after " + std::to_string(done) + " of " + std::to_string(n) +
             " bytes";
    }
    if (r < 0) {
      if (errno == EINTR || errno == EAGAIN || errno == EWOULDBLOCK) continue;
      return errnoText();
    }
    done += static_cast<size_t>(r);
  }
  return "";
}

}  // namespace

std::string readFully(int fd, void* buf, size_t n, Clock::time_point deadline) {
  return transferFully(fd, static_cast<char*>(buf), n, deadline, true);
}

std::string writeFully(int fd, const void* buf, size_t n, Clock::time_point deadline) {
  return transferFully(fd, static_cast<char*>(const_cast<void*>(buf)), n, deadline, false);
}

}  // namespace tcp
}  // namespace ringreduce
