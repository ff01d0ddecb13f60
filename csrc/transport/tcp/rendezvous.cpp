// TcpMesh set-up: the full mesh, through the c10d::Store.
//
// Keys (under the group's store prefix): ringreduce/<gen>/secret (32 random
// bytes, hex, written by rank 0) and ringreduce/<gen>/addr/<rank> ("ip:port").
// <gen> comes from an atomic counter, so re-creating a group on the same store
// never reads a stale address. Each rank connects to every lower rank (two
// connections: collective and p2p) and accepts from every higher one. Both ends
// present the secret in a Hello; a connection without it is refused, logged,
// and never reaches a collective. The accept thread stays up for the group's
// life so that late strangers are refused the same way.
#include <fcntl.h>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>

#include "common/env.h"
#include "common/thread_name.h"
#include "transport/tcp/p2p_engine.h"
#include "transport/tcp/tcp_mesh.h"

namespace ringreduce {
namespace tcp {

struct Hello {
  uint32_t magic;
  uint32_t version;
  int32_t rank;
  int32_t size;
  int32_t channel;
  char secret[64];
};

// An accepted connection whose hello is still arriving.
struct PendingHello {
  int fd = -1;
  SockAddr from{};
  Hello hello{};
  size_t got = 0;
  Clock::time_point deadline;
};

namespace {

constexpr uint32_t kHelloMagic = 0x52524845;  // "RRHE"
constexpr uint32_t kProtocolVersion = 1;
// --8<-- [start:limits]
constexpr auto kHandshakeTimeout = std::chrono::seconds(5);
// Connections waiting for their hello at once, beyond the group's own two per
// peer: past it the oldest is refused, so idle strangers cannot use up the
// process's descriptors (a peer's hello comes within a millisecond).
constexpr size_t kMaxPendingStrangers = 64;
// accept() failing for want of descriptors (EMFILE, ENFILE) or memory leaves
// the connection queued and the socket readable: the loop stops watching it
// for a while (doubling up to the maximum) instead of spinning on it.
constexpr auto kAcceptBackoffMin = std::chrono::milliseconds(10);
constexpr auto kAcceptBackoffMax = std::chrono::milliseconds(1000);
// Refusals print one line each up to this many, then at most one summary line
// a second.
constexpr uint64_t kRefusalsPrinted = 20;
constexpr auto kRefusalLogInterval = std::chrono::seconds(1);
// --8<-- [end:limits]

std::string randomHex(size_t bytes) {
  std::vector<unsigned char> raw(bytes);
  int fd = ::open("/dev/urandom", O_RDONLY | O_CLOEXEC);
  TORCH_CHECK(fd >= 0 && ::read(fd, raw.data(), bytes) == static_cast<ssize_t>(bytes),
              "[ringreduce] cannot read /dev/urandom for the group secret");
  ::close(fd);
  static const char* kHex = "0123456789abcdef";
  std::string out;
  for (unsigned char c : raw) {
    out += kHex[c >> 4];
    out += kHex[c & 15];
  }
  return out;
}

// Constant-time comparison: no early exit that would leak a prefix match.
bool sameSecret(const char* a, const std::string& b) {
  unsigned char diff = 0;
  for (size_t i = 0; i < sizeof(Hello::secret); ++i) {
    diff |= static_cast<unsigned char>(a[i] ^ b[i]);
  }
  return diff == 0;
}

// The host of the TCPStore behind the group's (prefixed) store, or "" for
// other stores (FileStore, HashStore).
std::string storeHost(const c10::intrusive_ptr<c10d::Store>& store) {
  c10::intrusive_ptr<c10d::Store> s = store;
  while (auto* prefixed = dynamic_cast<c10d::PrefixStore*>(s.get())) {
    s = prefixed->getUnderlyingStore();
  }
  auto* tcp = dynamic_cast<c10d::TCPStore*>(s.get());
  return tcp != nullptr ? tcp->getHost() : "";
}

}  // namespace

TcpMesh::TcpMesh(c10::intrusive_ptr<c10d::Store> store, int rank, int size,
                 std::chrono::milliseconds timeout)
    : store_(std::move(store), rankPrefix(rank, size)), rank_(rank), size_(size),
      wait_(size) {
  for (auto& channel : fds_) channel.assign(size, -1);
  peerAddr_.assign(size, "");
  partial_.assign(size, 0);
  if (size > 1) {
    connectMesh(timeout);
  }
}

void TcpMesh::connectMesh(std::chrono::milliseconds timeout) {
  const auto deadline = Clock::now() + timeout;
  const std::string prefix = rankPrefix(rank_, size_);
  // Every store call below is bounded by the group's deadline: a rank that
  // never comes, or a store whose host stopped, fails the set-up in time.
  const std::string joining = "joining the group";
  // A counter per group size: torch reuses store prefixes (group names start
  // again after destroy_process_group), and a group of another size on the
  // same prefix would skew one shared count, so the ranks read different keys.
  const std::string sized = "ringreduce/" + std::to_string(size_) + "/";
  int64_t generation = (store_.add(sized + "generation", 1, deadline, joining) - 1) / size_;
  storeBase_ = sized + std::to_string(generation) + "/";
  if (rank_ == 0) {
    secret_ = randomHex(sizeof(Hello::secret) / 2);
    store_.set(storeBase_ + "secret", secret_, deadline, joining);
  } else {
    secret_ = store_.get(storeBase_ + "secret", deadline, joining,
                         "rank 0 did not publish the group secret within the group timeout (" +
                             std::to_string(timeout.count()) +
                             " ms; did it call init_process_group / new_group, or did it die?)");
  }
  // From the first descriptor on, a failure closes what was opened (close()
  // takes a partial set-up): a wrong RINGREDUCE_SOCKET_IFNAME or a publish that
  // timed out used to leave the pipe and the listening socket open.
  try {
    TORCH_CHECK(pipe2(wakePipe_, O_CLOEXEC | O_NONBLOCK) == 0, prefix, " pipe2 failed: ",
                std::strerror(errno));
    listenFd_ = listenOn(chooseLocalAddress(storeHost(store_.ptr())), &bound_);
    store_.set(storeBase_ + "addr/" + std::to_string(rank_), formatAddress(bound_), deadline,
               joining);
    acceptThread_ = std::thread([this] {
      nameThisThread("rr-accept");
      acceptLoop();
    });
    for (int peer = 0; peer < rank_; ++peer) {
      connectToLower(peer, deadline);
    }
    std::unique_lock<std::mutex> lock(mu_);
    auto missing = [this] {
      std::string ranks;
      for (int peer = rank_ + 1; peer < size_; ++peer) {
        if (fds_[kCollective][peer] < 0 || fds_[kP2P][peer] < 0) {
          ranks += (ranks.empty() ? "" : ", ") + std::to_string(peer);
        }
      }
      return ranks;
    };
    connected_.wait_until(lock, deadline, [&] { return missing().empty(); });
    TORCH_CHECK(missing().empty(), prefix, " connecting the group: Timed out after ",
                timeout.count(), " ms: no connection from rank(s) ", missing(),
                " (did every rank call init_process_group / new_group / shrink_group?)");
    // Inside the try: an engine that cannot start (no fd for its pipe, no
    // thread) must not leave the accept thread running (std::terminate).
    p2p_ = P2PEngine::start(
        rank_, size_, fds_[kP2P], peerAddr_,
        [this](const std::string& why) { abortFromEngine(why); },
        [this](const std::string& why) { return groupCause(why); });
  } catch (...) {
    close();
    throw;
  }
}

void TcpMesh::connectToLower(int peer, Clock::time_point deadline) {
  const std::string prefix = rankPrefix(rank_, size_);
  std::string addr = store_.get(
      storeBase_ + "addr/" + std::to_string(peer), deadline, "joining the group",
      "rank " + std::to_string(peer) +
          " did not publish its address within the group timeout (did it call "
          "init_process_group / new_group, or did it die?)");
  SockAddr to;
  TORCH_CHECK(parseAddress(addr, &to), prefix, " rank ", peer, " published a bad address '",
              addr, "'");
  peerAddr_[peer] = addr;
  for (int32_t channel = 0; channel < kNumChannels; ++channel) {
    int fd = -1;
    try {
      fd = connectTo(to, deadline);
    } catch (const std::exception& e) {
      TORCH_CHECK(false, prefix, " cannot connect to rank ", peer, ": ", e.what());
    }
    Hello mine{kHelloMagic, kProtocolVersion, rank_, size_, channel, {}};
    std::memcpy(mine.secret, secret_.data(), sizeof(mine.secret));
    Hello theirs{};
    std::string err = writeFully(fd, &mine, sizeof(mine), deadline);
    if (err.empty()) err = readFully(fd, &theirs, sizeof(theirs), deadline);
    if (err.empty() && (theirs.magic != kHelloMagic || theirs.rank != peer ||
                        !sameSecret(theirs.secret, secret_))) {
      err = "it did not authenticate as rank " + std::to_string(peer) + " of this group";
    }
    if (!err.empty()) {
      ::close(fd);
      TORCH_CHECK(false, prefix, " handshake with rank ", peer, " at ", addr, " failed: ", err);
    }
    std::lock_guard<std::mutex> lock(mu_);
    fds_[channel][peer] = fd;
  }
}

// Handshakes run concurrently in this loop (non-blocking, each with its own
// deadline), so a silent stranger cannot hold up the real peers.
void TcpMesh::acceptLoop() {
  std::vector<PendingHello> pending;
  std::vector<pollfd> pfds;
  auto backoff = std::chrono::milliseconds(0);
  auto backoffUntil = Clock::time_point::min();
  while (!closed_) {
    const bool backingOff = Clock::now() < backoffUntil;
    pfds.assign({{listenFd_, static_cast<short>(backingOff ? 0 : POLLIN), 0},
                 {wakePipe_[0], POLLIN, 0}});
    auto next = backingOff ? backoffUntil : Clock::time_point::max();
    for (const auto& p : pending) {
      pfds.push_back({p.fd, POLLIN, 0});
      next = std::min(next, p.deadline);
    }
    int ms = next == Clock::time_point::max() ? -1 : millisUntil(next) + 1;
    if (poll(pfds.data(), pfds.size(), ms) < 0 && errno != EINTR) break;
    if (closed_ || pfds[1].revents != 0) break;
    for (size_t i = 2; i < pfds.size(); ++i) {
      if (pfds[i].revents != 0) readHello(pending[i - 2]);
    }
    for (auto& p : pending) {
      if (p.fd >= 0 && Clock::now() >= p.deadline) {
        refuse(p, "sent no complete hello within " +
                      std::to_string(kHandshakeTimeout.count()) + " s");
      }
    }
    pending.erase(std::remove_if(pending.begin(), pending.end(),
                                 [](const PendingHello& p) { return p.fd < 0; }),
                  pending.end());
    if (pfds[0].revents & POLLIN) {
      PendingHello p;
      p.from.len = sizeof(p.from.storage);
      p.fd = accept4(listenFd_, p.from.ptr(), &p.from.len,
                     SOCK_CLOEXEC | SOCK_NONBLOCK);
      p.deadline = Clock::now() + kHandshakeTimeout;
      if (p.fd >= 0) {
        if (pending.size() >= kMaxPendingStrangers + 2 * static_cast<size_t>(size_)) {
          refuse(pending.front(), "dropped for a newer connection: " +
                                      std::to_string(pending.size()) +
                                      " connections were waiting for their hello");
          pending.erase(pending.begin());
        }
        pending.push_back(p);
        backoff = std::chrono::milliseconds(0);
      } else if (errno == EMFILE || errno == ENFILE || errno == ENOBUFS || errno == ENOMEM) {
        backoff = std::min(kAcceptBackoffMax, std::max(kAcceptBackoffMin, backoff * 2));
        backoffUntil = Clock::now() + backoff;
        logRefusal("(not accepted)", std::string("accept failed: ") + std::strerror(errno) +
                                         "; not accepting for " +
                                         std::to_string(backoff.count()) + " ms");
      }
    }
  }
  for (auto& p : pending) ::close(p.fd);
}

void TcpMesh::readHello(PendingHello& p) {
  auto* buf = reinterpret_cast<char*>(&p.hello);
  ssize_t r = ::recv(p.fd, buf + p.got, sizeof(Hello) - p.got, MSG_DONTWAIT);
  if (r < 0 && (errno == EAGAIN || errno == EINTR)) return;
  if (r <= 0) {
    refuse(p, r == 0 ? "closed after " + std::to_string(p.got) + " of " +
                           std::to_string(sizeof(Hello)) + " hello bytes"
                     : std::string(std::strerror(errno)));
    return;
  }
  p.got += static_cast<size_t>(r);
  // The magic alone tells a stranger from a peer: refuse without waiting.
  if (p.got >= sizeof(p.hello.magic) && p.hello.magic != kHelloMagic) {
    refuse(p, "not a ringreduce peer (bad hello)");
    return;
  }
  if (p.got < sizeof(Hello)) return;
  std::string err;
  {
    std::lock_guard<std::mutex> lock(mu_);
    err = checkHello(p.hello);
  }
  Hello mine{kHelloMagic, kProtocolVersion, rank_, size_, p.hello.channel, {}};
  std::memcpy(mine.secret, secret_.data(), sizeof(mine.secret));
  // A fresh socket's buffer takes the whole reply at once.
  if (err.empty() && ::send(p.fd, &mine, sizeof(mine), MSG_NOSIGNAL) != sizeof(mine)) {
    err = "could not send the reply";
  }
  if (!err.empty()) {
    refuse(p, err);
    return;
  }
  setNoDelay(p.fd);
  {
    std::lock_guard<std::mutex> lock(mu_);
    fds_[p.hello.channel][p.hello.rank] = p.fd;
    peerAddr_[p.hello.rank] = formatAddress(p.from);
  }
  p.fd = -1;  // handed over
  connected_.notify_all();
}

void TcpMesh::refuse(PendingHello& p, const std::string& why) {
  logRefusal(formatAddress(p.from), why);
  ::close(p.fd);
  p.fd = -1;
}

std::string TcpMesh::checkHello(const Hello& h) const {
  if (h.magic != kHelloMagic) return "not a ringreduce peer (bad hello)";
  if (h.version != kProtocolVersion) {
    return "protocol version " + std::to_string(h.version) + ", this rank speaks " +
           std::to_string(kProtocolVersion);
  }
  if (h.size != size_) return "world size " + std::to_string(h.size) + " does not match";
  if (h.rank <= rank_ || h.rank >= size_) {
    return "claims rank " + std::to_string(h.rank) + ", which does not connect to this rank";
  }
  if (h.channel < 0 || h.channel >= kNumChannels) return "bad channel";
  if (!sameSecret(h.secret, secret_)) return "wrong group secret";
  if (fds_[h.channel][h.rank] >= 0) return "rank " + std::to_string(h.rank) + " is already connected";
  return "";
}

void TcpMesh::logRefusal(const std::string& from, const std::string& why) {
  std::string line = rankPrefix(rank_, size_) + " refused connection from " + from + ": " + why;
  std::string print;
  {
    std::lock_guard<std::mutex> lock(mu_);
    ++refusedCount_;
    refused_.push_back(line);
    if (refused_.size() > kKeptRefusals) refused_.pop_front();
    const auto now = Clock::now();
    if (refusedCount_ <= kRefusalsPrinted) {
      print = line;
    } else if (now - refusedLogAt_ >= kRefusalLogInterval) {
      print = line + " (" + std::to_string(refusedCount_ - refusedLogged_ - 1) +
              " more refused since the last line; " + std::to_string(refusedCount_) +
              " in all)";
    }
    if (!print.empty()) {
      refusedLogged_ = refusedCount_;
      refusedLogAt_ = now;
    }
  }
  if (!print.empty()) {
    fprintf(stderr, "%s\n", print.c_str());
    fflush(stderr);
  }
}

std::vector<std::string> TcpMesh::refusedConnections() const {
  std::lock_guard<std::mutex> lock(mu_);
  return std::vector<std::string>(refused_.begin(), refused_.end());
}

uint64_t TcpMesh::refusedCount() const {
  std::lock_guard<std::mutex> lock(mu_);
  return refusedCount_;
}

}  // namespace tcp
}  // namespace ringreduce
