// TcpTransport: the collective data path (exchange, confirm) over the
// mesh's connections.
//
// exchange() drives all of a step's sends and receives with one poll() loop on
// non-blocking sockets: every message is a WireHeader followed by its payload;
// sends go out with one sendmsg() of header+payload, receives read the header,
// check it against the op (a mismatch aborts instead of corrupting data), then
// read the payload straight into the caller's buffer.
#include "transport/tcp/tcp_transport.h"

#include <poll.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <thread>

#include "common/test_hooks.h"
#include "transport/tcp/p2p_engine.h"

namespace ringreduce {
namespace tcp {
namespace {

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

// Peers this rank stopped writing to in the middle of a message.
std::vector<int> midMessagePeers(const std::vector<SendState>& ss) {
  std::vector<int> peers;
  for (auto& s : ss) {
    if (s.done > 0 && s.done < s.total()) peers.push_back(s.spec->peer);
  }
  return peers;
}

// exchange(): moves what poll() said `peer`'s connection can take or give
// (`p`, its revents set); fails the op (TcpMesh::fail throws) on a broken
// send, a peer that shut its end while this rank still sends to it and
// receives nothing from it, or a receive that failed (an abort frame: after
// the peer's error is published).
void progressPeer(TcpMesh& mesh, const OpInfo& op, int peer, const pollfd& p,
                  std::vector<SendState>& ss, std::vector<RecvState>& rs) {
  std::string err;
  for (auto& s : ss) {
    if (s.spec->peer != peer) continue;
    bool sent;
    {
      // abandon() may run on another thread (a mixed exchange's other
      // half): it must see whether this message is half written.
      std::lock_guard<std::mutex> lock(mesh.sendMutex());
      sent = progressSend(p.fd, s, &err);
      mesh.setPartial(peer, s.done > 0 && s.done < s.total());
    }
    if (!sent) {
      mesh.fail(op, peer,
                "send failed after " + std::to_string(s.done) + " of " +
                    std::to_string(s.total()) + " bytes: " + err,
                false, midMessagePeers(ss));
    }
  }
  if ((p.revents & POLLRDHUP) != 0) {
    // A receive from the peer reads what it sent before its end, then the
    // end itself, and fails in its own words; without one, fail here.
    const bool receiving = std::any_of(rs.begin(), rs.end(), [&](const RecvState& r) {
      return r.spec->peer == peer && !r.finished();
    });
    const auto open = std::find_if(ss.begin(), ss.end(), [&](const SendState& x) {
      return x.spec->peer == peer && x.done < x.total();
    });
    if (!receiving && open != ss.end()) {
      mesh.fail(op, peer,
                "the peer shut its connection (it aborted or exited) after " +
                    std::to_string(open->done) + " of " + std::to_string(open->total()) +
                    " bytes were sent",
                false, midMessagePeers(ss));
    }
  }
  for (auto& r : rs) {
    if (r.spec->peer == peer && !progressRecv(p.fd, op, r, &err)) {
      if (r.headerDone == sizeof(WireHeader) &&
          r.header.kind == static_cast<uint8_t>(OpKind::kAbort)) {
        mesh.awaitPeerError();  // the peer publishes its error after the frame
      }
      mesh.fail(op, peer,
                err + " (received " + std::to_string(r.dataDone) + " of " +
                    std::to_string(r.spec->bytes) + " bytes)",
                false, midMessagePeers(ss));
    }
  }
}

}  // namespace

TcpTransport::~TcpTransport() = default;

int TcpTransport::pollWithSpin(std::vector<pollfd>& pfds, int timeoutMs) {
  using Phase = WaitPolicy::Phase;
  WaitPolicy& wait = mesh_->waitPolicy();
  if (const int64_t spin = wait.spinUs(); spin > 0) {
    const auto until = Clock::now() + std::chrono::microseconds(spin);
    do {
      int ready = poll(pfds.data(), pfds.size(), 0);
      if (ready != 0) {
        wait.noteWait(Phase::kSpun);
        return ready;
      }
    } while (Clock::now() < until);
  }
  if (const int64_t yield = wait.yieldUs(); yield > 0) {
    const auto until = Clock::now() + std::chrono::microseconds(yield);
    do {
      int ready = poll(pfds.data(), pfds.size(), 0);
      if (ready != 0) {
        wait.noteWait(Phase::kYielded);
        return ready;
      }
      wait.yield();
    } while (Clock::now() < until && wait.yieldUs() > 0);
  }
  wait.noteWait(Phase::kSlept);
  WaitPolicy::Sleep sleep(wait);
  return poll(pfds.data(), pfds.size(), timeoutMs);
}

void TcpTransport::exchange(const OpInfo& op, std::vector<SendSpec>& sends,
                            std::vector<RecvSpec>& recvs) {
  TcpMesh& mesh = *mesh_;
  if (mesh.aborted()) {
    throwTransportError(unusable(op, mesh.abortReason()));
  }
  std::vector<SendState> ss;
  std::vector<RecvState> rs;
  startProgress(op, sends, recvs, &ss, &rs);
  std::vector<pollfd> pfds;
  std::vector<int> peerOf;
  auto midMessage = [&ss] { return midMessagePeers(ss); };
  // Nothing moved since then; a wait that long looks for a peer's rejection
  // of the op (mesh.h), so the poll wakes at least that often.
  Clock::time_point movedAt = Clock::now(), lastPoll = movedAt;
  const int lookMs = static_cast<int>(ControlPlane::kLookAfter.count());
  while (true) {
    pfds.clear();
    peerOf.clear();
    auto watch = [&](int peer, short events) {
      int fd = mesh.collectiveFd(peer);
      for (auto& p : pfds) {
        if (p.fd == fd) { p.events |= events; return; }
      }
      pfds.push_back({fd, events, 0});
      peerOf.push_back(peer);
    };
    // POLLRDHUP: a peer that shut its end (it aborted, or exited) never reads
    // the rest; with its receive buffer full no POLLOUT would come either.
    for (auto& s : ss) if (s.done < s.total()) watch(s.spec->peer, POLLOUT | POLLRDHUP);
    for (auto& r : rs) if (!r.finished()) watch(r.spec->peer, POLLIN);
    if (pfds.empty()) {
      return;
    }
    int ms = millisUntil(op.deadline);
    // Spin and yield only when something moved since the last poll, not
    // again after each of a long wait's wake-ups.
    const bool fresh = movedAt == lastPoll;
    int ready = ms == 0 ? 0
                : fresh ? pollWithSpin(pfds, std::min(ms, lookMs))
                        : poll(pfds.data(), pfds.size(), std::min(ms, lookMs));
    if (mesh.aborted()) {
      throwTransportError(unusable(op, mesh.abortReason()));
    }
    lastPoll = Clock::now();
    if (ready > 0) movedAt = lastPoll;
    if (ready == 0) {
      if (millisUntil(op.deadline) > 0) {
        std::vector<int> waitingOn;
        for (auto& x : ss) if (x.done < x.total()) waitingOn.push_back(x.spec->peer);
        for (auto& x : rs) if (!x.finished()) waitingOn.push_back(x.spec->peer);
        mesh.lookWhileIdle(op, lastPoll - movedAt, true, waitingOn, midMessage());
        continue;
      }
      auto [peer, what] = timeoutReport(op, ss, rs);
      mesh.fail(op, peer, what, true, midMessage());
    }
    if (ready < 0 && errno != EINTR) {
      mesh.fail(op, -1, std::string("poll failed: ") + std::strerror(errno), false,
                midMessage());
    }
    for (size_t i = 0; i < pfds.size(); ++i) {
      if (pfds[i].revents != 0) progressPeer(mesh, op, peerOf[i], pfds[i], ss, rs);
    }
  }
}

void TcpTransport::confirm(const OpInfo& op) {
  TcpMesh& mesh = *mesh_;
  if (mesh.size() == 1) return;
  if (const int64_t ms = testHooks().tcpConfirmDelayMs.load(std::memory_order_relaxed)) {
    std::this_thread::sleep_for(std::chrono::milliseconds(ms));
  }
  std::lock_guard<std::mutex> lock(confirmMu_);
  confirmOpen(op);
  confirmed_ = op.ctx.seq;
}

void TcpTransport::confirmOpen(const OpInfo& op) {
  TcpMesh& mesh = *mesh_;
  // This rank told its peers it abandons this op or an earlier one (an abort
  // on another thread came before this check): it fails here too.
  const uint64_t framed = mesh.abandonedSeq();
  if (framed != 0 && framed <= op.ctx.seq) {
    const std::string reason = mesh.abortReason();
    throwTransportError(
        unusable(op, reason.empty() ? "this rank is aborting the group" : reason));
  }
  std::vector<pollfd> pfds;
  std::vector<int> peerOf;
  for (int peer = 0; peer < mesh.size(); ++peer) {
    if (peer == mesh.rank()) continue;
    pfds.push_back({mesh.collectiveFd(peer), POLLIN, 0});
    peerOf.push_back(peer);
  }
  if (poll(pfds.data(), pfds.size(), 0) <= 0) return;
  for (size_t i = 0; i < pfds.size(); ++i) {
    if ((pfds[i].revents & POLLIN) == 0) continue;
    WireHeader h{};
    ssize_t r = ::recv(pfds[i].fd, &h, sizeof(h), MSG_PEEK | MSG_DONTWAIT);
    if (r == static_cast<ssize_t>(sizeof(h)) && h.magic == kWireMagic &&
        h.kind == static_cast<uint8_t>(OpKind::kAbort) && h.seq <= op.ctx.seq) {
      // The frame names the first op the peer did not confirm: this one, or
      // an earlier one every rank rejected at the call (numbered, never
      // confirmed). The peer fails every op from it on.
      mesh.awaitPeerError();  // the peer publishes its error after the frame
      mesh.fail(op, peerOf[i],
                "the peer abandoned this op (it timed out or failed in it) after this "
                "rank's transfers had completed; the op fails on every rank",
                false);
    }
  }
}

void TcpTransport::postSend(const OpInfo& op, int peer, uint64_t tag, const void* data,
                            size_t bytes, P2PCallback done) {
  mesh_->p2p().postSend(op, peer, tag, data, bytes, std::move(done));
}

void TcpTransport::postRecv(const OpInfo& op, int peer, uint64_t tag, void* data,
                            size_t bytes, P2PCallback done) {
  mesh_->p2p().postRecv(op, peer, tag, data, bytes, std::move(done));
}

}  // namespace tcp

}  // namespace ringreduce
