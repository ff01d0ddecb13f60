// TcpTransport: the collective data path (exchange), abort and close.
//
// exchange() drives all of a step's sends and receives with one poll() loop on
// non-blocking sockets: every message is a WireHeader followed by its payload;
// sends go out with one sendmsg() of header+payload, receives read the header,
// check it against the op (a mismatch aborts instead of corrupting data), then
// read the payload straight into the caller's buffer.
#include "transport/tcp/tcp_transport.h"

#include <poll.h>
#include <sched.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <set>
#include <thread>

#include "common/env.h"
#include "kernels/reduce_ops.h"
#include "transport/tcp/p2p_engine.h"

namespace ringreduce {
namespace tcp {
namespace {

constexpr const char* kAbortKey = "abort";
// Budgets of the error path's store calls: a raise never waits longer on a
// store that does not answer.
constexpr auto kPublishBudget = std::chrono::milliseconds(250);
// How long a rank that saw a peer's abort flag waits for that peer's error in
// the store: longer than kPublishBudget, because a publish that misses its
// budget still lands soon after on a loaded machine (the wait ends as soon as
// the key is there).
constexpr auto kPeerErrorBudget = std::chrono::milliseconds(1000);
constexpr auto kLookupBudget = std::chrono::milliseconds(250);
// After a timeout, how long a rank waits for the ranks it waits on to publish
// whom they wait on (their deadlines differ by their start times).
constexpr auto kWaitChainGrace = std::chrono::milliseconds(500);

using SendState = SendProgress;
using RecvState = RecvProgress;

// Sends as much as the socket takes. Returns false on EOF/error with *err set.
bool progressSend(int fd, SendState& s, std::string* err) {
  while (s.done < s.total()) {
    iovec iov[2];
    int n = 0;
    if (s.done < sizeof(WireHeader)) {
      iov[n++] = {reinterpret_cast<char*>(&s.header) + s.done, sizeof(WireHeader) - s.done};
      iov[n++] = {const_cast<void*>(s.spec->data), s.spec->bytes};
    } else {
      size_t off = s.done - sizeof(WireHeader);
      iov[n++] = {static_cast<char*>(const_cast<void*>(s.spec->data)) + off,
                  s.spec->bytes - off};
    }
    msghdr msg{};
    msg.msg_iov = iov;
    msg.msg_iovlen = n;
    ssize_t r = sendmsg(fd, &msg, MSG_NOSIGNAL | MSG_DONTWAIT);
    if (r < 0) {
      if (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR) return true;
      *err = std::strerror(errno);
      return false;
    }
    s.done += static_cast<size_t>(r);
  }
  return true;
}

// Reads as much as is available. Returns false on EOF/error/mismatch with *err set.
bool progressRecv(int fd, const OpInfo& op, RecvState& s, std::string* err) {
  while (!s.finished()) {
    bool inHeader = s.headerDone < sizeof(WireHeader);
    char* dst = inHeader ? reinterpret_cast<char*>(&s.header) + s.headerDone
                         : static_cast<char*>(s.spec->data) + s.dataDone;
    size_t want = inHeader ? sizeof(WireHeader) - s.headerDone : s.spec->bytes - s.dataDone;
    ssize_t r = ::recv(fd, dst, want, MSG_DONTWAIT);
    if (r == 0) {
      *err = "connection closed by the peer (it exited or aborted)";
      return false;
    }
    if (r < 0) {
      if (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR) return true;
      *err = std::strerror(errno);
      return false;
    }
    if (inHeader) {
      s.headerDone += static_cast<size_t>(r);
      if (s.headerDone == sizeof(WireHeader)) {
        *err = headerMismatch(op, *s.spec, s.header);
        if (!err->empty()) return false;
      }
    } else {
      s.dataDone += static_cast<size_t>(r);
      if (s.spec->onProgress) s.spec->onProgress(s.dataDone);
    }
  }
  return true;
}

}  // namespace

TcpTransport::~TcpTransport() {
  close();
}

// Busy-polls, then polls yielding the core, then sleeps in poll(), each for
// as long as the wait policy allows (transport/wait_policy.h).
int TcpTransport::pollWithSpin(std::vector<pollfd>& pfds, int timeoutMs) {
  if (const int64_t spin = wait_.spinUs(); spin > 0) {
    const auto until = Clock::now() + std::chrono::microseconds(spin);
    do {
      int ready = poll(pfds.data(), pfds.size(), 0);
      if (ready != 0) return ready;
    } while (Clock::now() < until);
  }
  if (const int64_t yield = wait_.yieldUs(); yield > 0) {
    const auto until = Clock::now() + std::chrono::microseconds(yield);
    do {
      int ready = poll(pfds.data(), pfds.size(), 0);
      if (ready != 0) return ready;
      wait_.yield();
    } while (Clock::now() < until && wait_.yieldUs() > 0);
  }
  return poll(pfds.data(), pfds.size(), timeoutMs);
}

void TcpTransport::exchange(const OpInfo& op, std::vector<SendSpec>& sends,
                            std::vector<RecvSpec>& recvs) {
  if (aborted_) {
    throwTransportError(unusable(op, abortReason()));
  }
  std::vector<SendState> ss;
  std::vector<RecvState> rs;
  startProgress(op, sends, recvs, &ss, &rs);
  std::vector<pollfd> pfds;
  std::vector<int> peerOf;
  // Peers this rank stopped writing to in the middle of a message.
  auto midMessage = [&ss] {
    std::vector<int> peers;
    for (auto& s : ss) {
      if (s.done > 0 && s.done < s.total()) peers.push_back(s.spec->peer);
    }
    return peers;
  };
  while (true) {
    pfds.clear();
    peerOf.clear();
    auto watch = [&](int peer, short events) {
      int fd = fds_[kCollective][peer];
      for (auto& p : pfds) {
        if (p.fd == fd) { p.events |= events; return; }
      }
      pfds.push_back({fd, events, 0});
      peerOf.push_back(peer);
    };
    for (auto& s : ss) if (s.done < s.total()) watch(s.spec->peer, POLLOUT);
    for (auto& r : rs) if (!r.finished()) watch(r.spec->peer, POLLIN);
    if (pfds.empty()) {
      return;
    }
    int ms = millisUntil(op.deadline);
    int ready = ms == 0 ? 0 : pollWithSpin(pfds, ms);
    if (aborted_) {
      throwTransportError(unusable(op, abortReason()));
    }
    if (ready == 0) {
      auto [peer, what] = timeoutReport(op, ss, rs);
      fail(op, peer, what, true, midMessage());
    }
    if (ready < 0 && errno != EINTR) {
      fail(op, -1, std::string("poll failed: ") + std::strerror(errno), false, midMessage());
    }
    for (size_t i = 0; i < pfds.size(); ++i) {
      if (pfds[i].revents == 0) continue;
      int peer = peerOf[i];
      std::string err;
      for (auto& s : ss) {
        if (s.spec->peer != peer) continue;
        bool sent;
        {
          // abandon() may run on another thread (a mixed exchange's other
          // half): it must see whether this message is half written.
          std::lock_guard<std::mutex> lock(sendMu_);
          sent = progressSend(pfds[i].fd, s, &err);
          partial_[peer] = s.done > 0 && s.done < s.total();
        }
        if (!sent) {
          fail(op, peer,
               "send failed after " + std::to_string(s.done) + " of " +
                   std::to_string(s.total()) + " bytes: " + err,
               false, midMessage());
        }
      }
      for (auto& r : rs) {
        if (r.spec->peer == peer && !progressRecv(pfds[i].fd, op, r, &err)) {
          fail(op, peer,
               err + " (received " + std::to_string(r.dataDone) + " of " +
                   std::to_string(r.spec->bytes) + " bytes)",
               false, midMessage());
        }
      }
    }
  }
}

void TcpTransport::fail(const OpInfo& op, int peer, const std::string& what, bool timedOut,
                        const std::vector<int>& midMessage) {
  std::string where =
      peer >= 0 ? "with rank " + std::to_string(peer) + " (" + peerAddr_[peer] + "): " : "";
  std::string message = op.ctx.message(where + what);
  if (timedOut && peer >= 0) message += waitChain(op, peer);
  // Looked up before this rank publishes its own error, so it finds a peer's.
  const std::string cause = groupCause(message);
  abandon(op, midMessage);
  abort(message);
  throwTransportError(message + cause + ". The process group is no longer usable.");
}

void TcpTransport::awaitPeerError() {
  if (size_ == 1 || closed_) return;
  try {
    // The peer publishes right after raising the flag (within kPublishBudget,
    // or a little later under load), or never: wait no longer than this.
    (void)store_.waitFor(storeBase_ + kAbortKey, Clock::now() + kPeerErrorBudget,
                         "looking up a peer's error");
  } catch (const std::exception&) {
    // Best effort: failOp() says when the first failure is unknown.
  }
}

std::string TcpTransport::groupCause(const std::string& mine) {
  if (size_ == 1) return "";
  bool answered = false;
  auto first = store_.tryGet(storeBase_ + kAbortKey, Clock::now() + kLookupBudget, &answered);
  if (!answered) {
    return "; the first failure in the group is unknown (the store did not answer within " +
           std::to_string(kLookupBudget.count()) + " ms)";
  }
  if (!first || *first == mine) return "";
  return "; first error in the group: " + *first;
}

std::string TcpTransport::waitChain(const OpInfo& op, int peer) {
  auto key = [&](int r) {
    return storeBase_ + "wait/" + std::to_string(op.ctx.seq) + "/" + std::to_string(r);
  };
  if (!store_.trySetFirst(key(rank_), std::to_string(peer), Clock::now() + kPublishBudget)) {
    return "";
  }
  const auto graceEnd = Clock::now() + kWaitChainGrace;
  std::string chain;
  std::set<int> seen{rank_};
  int cur = peer;
  while (true) {
    if (seen.count(cur) != 0) {
      return "; the waits form a cycle (" + chain.substr(2) +
             "): every rank in it waits for another";
    }
    bool answered = false;
    auto next = store_.tryGet(key(cur), std::min(graceEnd, Clock::now() + kLookupBudget) +
                                            std::chrono::milliseconds(1),
                              &answered);
    if (!answered && Clock::now() < graceEnd) return "";
    if (next) {
      seen.insert(cur);
      chain += "; rank " + std::to_string(cur) + " waits for rank " + *next;
      cur = std::atoi(next->c_str());
      continue;
    }
    if (Clock::now() >= graceEnd) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  return chain + "; rank " + std::to_string(cur) + " made no progress in " + op.ctx.op + "#" +
         std::to_string(op.ctx.seq) + " (stopped, hung, or never called it)";
}

void TcpTransport::abandon(const OpInfo& op, const std::vector<int>& midMessage) {
  WireHeader h = messageHeader(op, SendSpec{-1, nullptr, 0, 0});
  h.kind = static_cast<uint8_t>(OpKind::kAbort);
  std::lock_guard<std::mutex> lock(mu_);
  std::lock_guard<std::mutex> sending(sendMu_);
  for (int peer = 0; peer < size_; ++peer) {
    const int fd = fds_[kCollective][peer];
    if (fd < 0 || partial_[peer] ||
        std::find(midMessage.begin(), midMessage.end(), peer) != midMessage.end()) {
      continue;
    }
    // Best effort: a full socket buffer just means no frame.
    (void)!::send(fd, &h, sizeof(h), MSG_NOSIGNAL | MSG_DONTWAIT);
  }
}

void TcpTransport::confirm(const OpInfo& op) {
  if (size_ == 1) return;
  std::vector<pollfd> pfds;
  std::vector<int> peerOf;
  for (int peer = 0; peer < size_; ++peer) {
    if (peer == rank_) continue;
    pfds.push_back({fds_[kCollective][peer], POLLIN, 0});
    peerOf.push_back(peer);
  }
  if (poll(pfds.data(), pfds.size(), 0) <= 0) return;
  for (size_t i = 0; i < pfds.size(); ++i) {
    if ((pfds[i].revents & POLLIN) == 0) continue;
    WireHeader h{};
    ssize_t r = ::recv(pfds[i].fd, &h, sizeof(h), MSG_PEEK | MSG_DONTWAIT);
    if (r == static_cast<ssize_t>(sizeof(h)) && h.magic == kWireMagic &&
        h.kind == static_cast<uint8_t>(OpKind::kAbort) && h.seq == op.ctx.seq) {
      fail(op, peerOf[i],
           "the peer abandoned this op (it timed out or failed in it) after this rank's "
           "transfers had completed; the op fails on every rank",
           false);
    }
  }
}

void TcpTransport::abort(const std::string& reason) {
  if (aborted_.exchange(true)) return;
  {
    std::lock_guard<std::mutex> lock(mu_);
    abortReason_ = reason;
  }
  if (debugEnabled()) {
    fprintf(stderr, "%s aborting: %s\n", rankPrefix(rank_, size_).c_str(), reason.c_str());
  }
  // Publish the first error before the peers see EOF, so they can name it;
  // bounded, so a store that does not answer never holds up the abort.
  if (size_ > 1 && !closed_) {
    store_.trySetFirst(storeBase_ + kAbortKey, reason, Clock::now() + kPublishBudget);
  }
  {
    // Shutting the sockets down (not closing: other threads may be polling
    // them) makes every peer see EOF at once, so errors spread in milliseconds.
    std::lock_guard<std::mutex> lock(mu_);
    for (auto& channel : fds_) {
      for (int fd : channel) {
        if (fd >= 0) ::shutdown(fd, SHUT_RDWR);
      }
    }
  }
  if (p2p_) p2p_->abort(reason);
}

int TcpTransport::closedPeer(const std::vector<int>& peers) {
  std::vector<pollfd> pfds;
  for (int peer : peers) pfds.push_back({fds_[kCollective][peer], POLLIN, 0});
  if (pfds.empty() || poll(pfds.data(), pfds.size(), 0) <= 0) return -1;
  for (size_t i = 0; i < pfds.size(); ++i) {
    if (pfds[i].revents != 0) return peers[i];
  }
  return -1;
}

bool TcpTransport::hungUp(int peer) {
  char byte;
  const ssize_t r = ::recv(fds_[kCollective][peer], &byte, 1, MSG_PEEK | MSG_DONTWAIT);
  return r == 0 || (r < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR);
}

std::string TcpTransport::abortReason() const {
  std::lock_guard<std::mutex> lock(mu_);
  return abortReason_;
}

void TcpTransport::postSend(const OpInfo& op, int peer, uint64_t tag, const void* data,
                            size_t bytes, P2PCallback done) {
  p2p_->postSend(op, peer, tag, data, bytes, std::move(done));
}

void TcpTransport::postRecv(const OpInfo& op, int peer, uint64_t tag, void* data,
                            size_t bytes, P2PCallback done) {
  p2p_->postRecv(op, peer, tag, data, bytes, std::move(done));
}

void TcpTransport::close() {
  if (closed_.exchange(true)) return;
  if (wakePipe_[1] >= 0) {
    char c = 0;
    (void)!::write(wakePipe_[1], &c, 1);
  }
  if (p2p_) p2p_->stop();
  if (acceptThread_.joinable()) acceptThread_.join();
  p2p_.reset();
  std::lock_guard<std::mutex> lock(mu_);
  for (auto& channel : fds_) {
    for (int& fd : channel) {
      if (fd >= 0) ::close(fd);
      fd = -1;
    }
  }
  for (int* fd : {&listenFd_, &wakePipe_[0], &wakePipe_[1]}) {
    if (*fd >= 0) ::close(*fd);
    *fd = -1;
  }
}

std::string TcpTransport::listenAddress() const {
  return listenFd_ >= 0 ? formatAddress(bound_) : "";
}

}  // namespace tcp

}  // namespace ringreduce
