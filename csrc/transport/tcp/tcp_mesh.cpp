// TcpMesh: failure paths (fail, abort, the first error in the group, the
// wait chain after a timeout), abandon, close. The set-up is rendezvous.cpp.
#include "transport/tcp/tcp_mesh.h"

#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <set>
#include <thread>
#include <optional>
#include <string>

#include "common/env.h"
#include "transport/tcp/p2p_engine.h"

namespace ringreduce {
namespace tcp {
namespace {

constexpr const char* kAbortKey = "abort";
// --8<-- [start:budgets]
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
// --8<-- [end:budgets]

}  // namespace

TcpMesh::~TcpMesh() {
  close();
}

void TcpMesh::fail(const OpInfo& op, int peer, const std::string& what, bool timedOut,
                   const std::vector<int>& midMessage, bool noteRejection) {
  std::string where =
      peer >= 0 ? "with rank " + std::to_string(peer) + " (" + peerAddr_[peer] + "): " : "";
  std::string message = op.ctx.message(where + what);
  // After a timeout the peers learn first that this op is abandoned (abort
  // frames, the data paths' hook): following the wait chain may take a
  // second, and a peer that finished its transfers meanwhile would otherwise
  // confirm the op this rank fails. They wait for this rank's error to be
  // published before they raise (awaitPeerError), so their messages still
  // name it. Other failures (a mismatch, a closed connection) tell them after
  // the quick lookup below: a peer still in the op then finds its own cause
  // (the mismatching header) instead of only "another rank aborted".
  const bool followChain = timedOut && peer >= 0;
  if (followChain) {
    abandon(op, midMessage);
    message += waitChain(op, peer);
  }
  // Looked up before this rank publishes its own error, so it finds a peer's.
  bool answered = false, remote = false;
  const std::string cause = groupCause(message, &answered, &remote);
  int none = static_cast<int>(Failure::kNone);
  const Failure kind = timedOut ? Failure::kTimeout : remote ? Failure::kRemote : Failure::kLocal;
  failure_.compare_exchange_strong(none, static_cast<int>(kind));
  if (!followChain) abandon(op, midMessage);
  // A store that did not answer that will not answer this either.
  if (noteRejection && answered) message += rejectionNote(op);
  abort(message);
  throwTransportError(message + cause + ". The process group is no longer usable.");
}

void TcpMesh::awaitPeerError() {
  if (size_ == 1 || closed_) return;
  try {
    // A store that does not answer a quick look will not answer the wait
    // either (its host stopped): no second spent on it.
    bool answered = false;
    if (store_.tryGet(storeBase_ + kAbortKey, Clock::now() + kLookupBudget, &answered) ||
        !answered) {
      return;
    }
    // The peer publishes once it has followed its wait chain and looked up
    // the group's first error (up to kWaitChainGrace + kLookupBudget after
    // its abort frame or flag), or never: wait no longer than this.
    (void)store_.waitFor(storeBase_ + kAbortKey, Clock::now() + kPeerErrorBudget,
                         "looking up a peer's error");
  } catch (const std::exception&) {
    // Best effort: failOp() says when the first failure is unknown.
  }
}

std::string TcpMesh::groupCause(const std::string& mine, bool* storeAnswered, bool* remote) {
  if (size_ == 1) return "";
  bool answered = false;
  auto first = store_.tryGet(storeBase_ + kAbortKey, Clock::now() + kLookupBudget, &answered);
  if (storeAnswered != nullptr) *storeAnswered = answered;
  if (!answered) {
    return "; the first failure in the group is unknown (the store did not answer within " +
           std::to_string(kLookupBudget.count()) + " ms)";
  }
  if (!first || *first == mine) return "";
  if (remote != nullptr) *remote = true;
  return "; first error in the group: " + *first;
}

std::string TcpMesh::waitChain(const OpInfo& op, int peer) {
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

std::string TcpMesh::rejectedKey(uint64_t seq) const {
  // A few keys per group, reused: a rank that catches its errors in a loop
  // does not grow the store. The value carries the seq it is for.
  return storeBase_ + "rejected/" + std::to_string(seq % kRejectedKeys);
}

void TcpMesh::publishRejected(uint64_t seq, const std::string& message) {
  if (size_ == 1 || closed_ || aborted_) return;
  try {
    store_.set(rejectedKey(seq),
               std::to_string(seq) + "\n" + std::to_string(rank_) + "\n" + message,
               Clock::now() + kPublishBudget, "publishing a rejected op");
  } catch (const std::exception&) {
    // Best effort: peers in the op then fail at the timeout, as before.
  }
}

namespace {

struct Rejection {
  int rank = -1;
  std::string message;
};

// A published rejection ("<seq>\n<rank>\n<message>") if it is for `seq` and
// names a rank of the group.
std::optional<Rejection> parseRejection(const std::optional<std::string>& value, uint64_t seq,
                                        int size) {
  if (!value) return std::nullopt;
  const size_t a = value->find('\n');
  const size_t b = a == std::string::npos ? a : value->find('\n', a + 1);
  if (b == std::string::npos || value->substr(0, a) != std::to_string(seq)) return std::nullopt;
  Rejection r{std::atoi(value->substr(a + 1, b - a - 1).c_str()), value->substr(b + 1)};
  if (r.rank < 0 || r.rank >= size) return std::nullopt;
  return r;
}

// `who`: "it" (the failure names the peer already) or "rank 3".
std::string rejectionText(const std::string& who, const std::string& message) {
  return who + " rejected this op at the call and does not run it (" + message + ")";
}

bool collective(const OpInfo& op) {
  return op.kind != OpKind::kSend && op.kind != OpKind::kAbort;
}

}  // namespace

std::string TcpMesh::rejectionNote(const OpInfo& op) {
  if (size_ == 1 || !collective(op)) return "";
  auto r = parseRejection(store_.tryGet(rejectedKey(op.ctx.seq), Clock::now() + kLookupBudget),
                          op.ctx.seq, size_);
  if (!r || r->rank == rank_) return "";
  return "; " + rejectionText("rank " + std::to_string(r->rank), r->message);
}

namespace {

// Whether a wait idle for `idle` is due a look at the store (last one at
// `lookedAt`, which this claims): from kLookAfter on, every 100 ms
// while the wait is young, then less often (a quarter of the wait, at most
// every 2 s): long waits for a slow peer are common and each look is a store
// request.
bool lookDue(std::atomic<int64_t>& lookedAt, Clock::duration idle) {
  if (idle < ControlPlane::kLookAfter) return false;
  const Clock::duration every = std::clamp<Clock::duration>(
      idle / 4, ControlPlane::kLookAfter, std::chrono::seconds(2));
  const int64_t now = Clock::now().time_since_epoch().count();
  int64_t last = lookedAt.load(std::memory_order_relaxed);
  return now - last >= every.count() &&
         lookedAt.compare_exchange_strong(last, now, std::memory_order_relaxed);
}

}  // namespace

void TcpMesh::lookWhileIdle(const OpInfo& op, Clock::duration idle, bool acrossHosts,
                            const std::vector<int>& waitingOn,
                            const std::vector<int>& midMessage) {
  if (size_ == 1 || !collective(op)) return;
  lookForRejection(op, idle);
  if (acrossHosts) lookForOtherOp(op, idle, waitingOn, midMessage);
}

void TcpMesh::lookForRejection(const OpInfo& op, Clock::duration idle) {
  if (!lookDue(rejectionLookedAt_, idle)) return;
  auto r = parseRejection(store_.peek(rejectedKey(op.ctx.seq),
                                      std::min(op.deadline, Clock::now() + kLookupBudget)),
                          op.ctx.seq, size_);
  if (!r || r->rank == rank_) return;
  // The peer's error names the op and its arguments; this rank's says which
  // op waited and for whom.
  fail(op, r->rank, rejectionText("it", r->message), false, {}, false);
}

void TcpMesh::lookForOtherOp(const OpInfo& op, Clock::duration idle,
                             const std::vector<int>& waitingOn,
                             const std::vector<int>& midMessage) {
  if (!lookDue(otherOpLookedAt_, idle)) return;
  const auto now = Clock::now();
  auto key = [&](int r) { return storeBase_ + "op/" + std::to_string(r); };
  if (announcedSeq_.exchange(op.ctx.seq) != op.ctx.seq) {
    const WireHeader mine = messageHeader(op, SendSpec{-1, nullptr, 0, 0});
    try {
      store_.set(key(rank_), std::string(reinterpret_cast<const char*>(&mine), sizeof(mine)),
                 std::min(op.deadline, now + kPublishBudget), "announcing the op");
    } catch (const std::exception&) {
      // Best effort: a mismatch then fails at the timeout, as before.
    }
  }
  // A peer that aborted while this rank writes to it may never get its end
  // through (its own unsent bytes hold the FIN back): its error is in the store.
  if (store_.peek(storeBase_ + kAbortKey, std::min(op.deadline, Clock::now() + kLookupBudget))) {
    fail(op, -1, "another rank aborted the group", false, midMessage, false);
  }
  if (waitingOn.empty()) return;
  const int peer = waitingOn[otherOpTurn_.fetch_add(1) % waitingOn.size()];
  auto value = store_.peek(key(peer), std::min(op.deadline, Clock::now() + kLookupBudget));
  if (!value || value->size() != sizeof(WireHeader)) return;
  WireHeader h;
  std::memcpy(&h, value->data(), sizeof(h));
  if (h.magic != kWireMagic || h.seq != op.ctx.seq) return;
  const std::string err = headerMismatch(op, RecvSpec{peer, nullptr, h.bytes, h.step, {}}, h);
  if (!err.empty()) {
    fail(op, peer, err + " (the op the peer announced in the store)", false, midMessage, false);
  }
}

void TcpMesh::setAbandonHook(std::function<void(const OpInfo&)> hook) {
  std::lock_guard<std::mutex> lock(hookMu_);
  abandonHook_ = std::move(hook);
}

void TcpMesh::setAbortHook(std::function<void()> hook) {
  std::lock_guard<std::mutex> lock(abortHookMu_);
  abortHook_ = std::move(hook);
}

void TcpMesh::abortFromEngine(const std::string& reason) {
  {
    // Before the sockets go down: a frame written after them never arrives,
    // and a peer holding all of this rank's data would confirm the op that
    // fails here.
    std::lock_guard<std::mutex> lock(abortHookMu_);
    if (abortHook_ && !aborted_) abortHook_();
  }
  abort(reason);
}

void TcpMesh::abandon(const OpInfo& op, const std::vector<int>& midMessage) {
  if (op.kind == OpKind::kSend) return;  // point-to-point has its own numbering
  {
    std::lock_guard<std::mutex> lock(hookMu_);
    if (abandonHook_) abandonHook_(op);
  }
  abandonSeq(op.ctx.seq, midMessage);
}

void TcpMesh::abandonSeq(uint64_t seq, const std::vector<int>& midMessage) {
  // Once per op: fail() writes them, then the transport's abort() would again.
  uint64_t last = abandonedSeq_.load();
  do {
    if (seq <= last) return;
  } while (!abandonedSeq_.compare_exchange_weak(last, seq));
  OpInfo op;
  op.ctx.seq = seq;
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

void TcpMesh::abort(const std::string& reason) {
  {
    // The reason before the flag: a thread that sees aborted() reads it.
    std::lock_guard<std::mutex> lock(mu_);
    if (aborted_) return;
    abortReason_ = reason;
    aborted_ = true;
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

int TcpMesh::closedPeer(const std::vector<int>& peers) {
  std::vector<pollfd> pfds;
  for (int peer : peers) pfds.push_back({fds_[kCollective][peer], POLLIN, 0});
  if (pfds.empty() || poll(pfds.data(), pfds.size(), 0) <= 0) return -1;
  for (size_t i = 0; i < pfds.size(); ++i) {
    if (pfds[i].revents != 0) return peers[i];
  }
  return -1;
}

bool TcpMesh::hungUp(int peer) {
  char byte;
  const ssize_t r = ::recv(fds_[kCollective][peer], &byte, 1, MSG_PEEK | MSG_DONTWAIT);
  return r == 0 || (r < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR);
}

std::string TcpMesh::abortReason() const {
  std::lock_guard<std::mutex> lock(mu_);
  return abortReason_;
}

namespace {

// Reads and drops what the socket holds, without blocking; at most 64 MiB, so
// a peer still sending cannot hold the close up.
void discardUnread(int fd, std::vector<char>& sink) {
  for (size_t dropped = 0; dropped < (size_t{64} << 20);) {
    const ssize_t r = ::recv(fd, sink.data(), sink.size(), MSG_DONTWAIT);
    if (r > 0) {
      dropped += static_cast<size_t>(r);
    } else if (r < 0 && errno == EINTR) {
      continue;
    } else {
      return;  // drained (EAGAIN), at its end, or broken
    }
  }
}

}  // namespace

void TcpMesh::close() {
  if (closed_.exchange(true)) return;
  if (wakePipe_[1] >= 0) {
    char c = 0;
    (void)!::write(wakePipe_[1], &c, 1);
  }
  if (p2p_) {
    // The engine stays until the mesh goes: a send or receive posted later
    // (a backend kept past destroy_process_group, another thread) fails at
    // once, as do those still pending, instead of reaching a freed engine or
    // waiting forever.
    p2p_->stop();
    p2p_->abort(rankPrefix(rank_, size_) +
                " the process group was shut down (destroy_process_group)");
  }
  if (acceptThread_.joinable()) acceptThread_.join();
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<char> sink(aborted_ ? 0 : 64 << 10);
  for (auto& channel : fds_) {
    for (int& fd : channel) {
      if (fd < 0) continue;
      // Closing a socket that holds unread bytes (a message this rank never
      // received, a farewell) resets the connection, and the peer's kernel
      // then drops what it holds of this rank's last messages unread: a
      // send that completed here would fail there. Read them away first.
      if (!sink.empty()) discardUnread(fd, sink);
      ::close(fd);
      fd = -1;
    }
  }
  for (int* fd : {&listenFd_, &wakePipe_[0], &wakePipe_[1]}) {
    if (*fd >= 0) ::close(*fd);
    *fd = -1;
  }
}

std::string TcpMesh::listenAddress() const {
  return listenFd_ >= 0 ? formatAddress(bound_) : "";
}

}  // namespace tcp
}  // namespace ringreduce
