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

bool resolveIPv4(const std::string& host, in_addr* out) {
  addrinfo hints{};
  hints.ai_family = AF_INET;
  addrinfo* res = nullptr;
  if (getaddrinfo(host.c_str(), nullptr, &hints, &res) != 0 || res == nullptr) {
    return false;
  }
  *out = reinterpret_cast<sockaddr_in*>(res->ai_addr)->sin_addr;
  freeaddrinfo(res);
  return true;
}

std::string interfaceAddress(const std::string& ifname) {
  ifaddrs* list = nullptr;
  TORCH_CHECK(getifaddrs(&list) == 0, "[ringreduce] getifaddrs failed: ", errnoText());
  std::string found;
  for (ifaddrs* it = list; it != nullptr; it = it->ifa_next) {
    if (it->ifa_addr != nullptr && it->ifa_addr->sa_family == AF_INET &&
        ifname == it->ifa_name) {
      char buf[INET_ADDRSTRLEN];
      auto* sin = reinterpret_cast<sockaddr_in*>(it->ifa_addr);
      found = inet_ntop(AF_INET, &sin->sin_addr, buf, sizeof(buf));
      break;
    }
  }
  freeifaddrs(list);
  TORCH_CHECK_VALUE(!found.empty(), "[ringreduce] ", kEnvIfname.name, "=", ifname,
                    ": no IPv4 address on that interface");
  return found;
}

// The local address the kernel would use to reach `host` (no packet is sent).
std::string routeTo(const std::string& host) {
  in_addr remote{};
  if (!resolveIPv4(host, &remote)) {
    return "";
  }
  if ((ntohl(remote.s_addr) >> 24) == 127) {
    return "127.0.0.1";
  }
  int fd = socket(AF_INET, SOCK_DGRAM, 0);
  if (fd < 0) {
    return "";
  }
  sockaddr_in to{};
  to.sin_family = AF_INET;
  to.sin_port = htons(9);
  to.sin_addr = remote;
  std::string local;
  sockaddr_in me{};
  socklen_t len = sizeof(me);
  if (connect(fd, reinterpret_cast<sockaddr*>(&to), sizeof(to)) == 0 &&
      getsockname(fd, reinterpret_cast<sockaddr*>(&me), &len) == 0) {
    char buf[INET_ADDRSTRLEN];
    local = inet_ntop(AF_INET, &me.sin_addr, buf, sizeof(buf));
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

std::string formatAddress(const sockaddr_in& addr) {
  char buf[INET_ADDRSTRLEN] = "?";
  inet_ntop(AF_INET, &addr.sin_addr, buf, sizeof(buf));
  return std::string(buf) + ":" + std::to_string(ntohs(addr.sin_port));
}

bool parseAddress(const std::string& text, sockaddr_in* out) {
  auto colon = text.rfind(':');
  if (colon == std::string::npos) {
    return false;
  }
  char* end = nullptr;
  long port = std::strtol(text.c_str() + colon + 1, &end, 10);
  if (*end != '\0' || port <= 0 || port > 65535) {
    return false;
  }
  *out = sockaddr_in{};
  out->sin_family = AF_INET;
  out->sin_port = htons(static_cast<uint16_t>(port));
  return resolveIPv4(text.substr(0, colon), &out->sin_addr);
}

int listenOn(const std::string& addr, sockaddr_in* bound) {
  sockaddr_in want{};
  TORCH_CHECK_VALUE(parseAddress(addr + ":1", &want), "[ringreduce] cannot resolve local address '",
                    addr, "' (set ", kEnvAddr.name, " or ", kEnvIfname.name, ")");
  want.sin_port = 0;
  int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  TORCH_CHECK(fd >= 0, "[ringreduce] socket() failed: ", errnoText());
  if (bind(fd, reinterpret_cast<sockaddr*>(&want), sizeof(want)) != 0 || listen(fd, 128) != 0) {
    std::string err = errnoText();
    ::close(fd);
    TORCH_CHECK(false, "[ringreduce] cannot listen on ", addr, ": ", err);
  }
  socklen_t len = sizeof(*bound);
  getsockname(fd, reinterpret_cast<sockaddr*>(bound), &len);
  return fd;
}

namespace {

// One connection attempt that gives up at the deadline: a blocking connect()
// to a host that drops the SYN (a firewall, a full accept queue) waits for
// the kernel's SYN retries, about two minutes, whatever the group's timeout.
// The connected socket (blocking, as before), or -1 with *err set (kNoAnswer:
// the deadline came first).
constexpr int kNoAnswer = -1;

int connectOnce(const sockaddr_in& to, Clock::time_point deadline, int* err) {
  int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
  TORCH_CHECK(fd >= 0, "[ringreduce] socket() failed: ", errnoText());
  *err = 0;
  if (connect(fd, reinterpret_cast<const sockaddr*>(&to), sizeof(to)) != 0) {
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

int connectTo(const sockaddr_in& to, Clock::time_point deadline) {
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
