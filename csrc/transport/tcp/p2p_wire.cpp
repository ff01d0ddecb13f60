// P2PEngine's socket side, all with mu_ held on the polling thread: which
// peers to read, a header matched to a posted receive (or read aside, or
// drained after a mismatch), payloads read and written without blocking, and
// the ops whose deadline passed.
#include "transport/tcp/p2p_engine.h"

#include <sys/socket.h>
#include <sys/uio.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "common/test_hooks.h"
#include "transport/tcp/socket.h"  // Clock

namespace ringreduce {
namespace tcp {
namespace {

bool retryable() {
  return errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR;
}

}  // namespace

bool P2PEngine::wantsRead(int peer) const {
  if (left_[peer]) return false;
  const Incoming& in = incoming_[peer];
  if (in.headerDone == sizeof(WireHeader)) return in.matched || in.draining || in.buffering;
  if (in.headerDone > 0) return true;
  for (const auto& r : recvs_) {
    if (!r.claimed && (r.peer == peer || r.peer == -1)) return true;
  }
  return false;
}

void P2PEngine::matchHeader(int peer, std::vector<Completion>& done) {
  Incoming& in = incoming_[peer];
  const WireHeader& h = in.header;
  if (h.magic == kWireMagic && h.kind == static_cast<uint8_t>(OpKind::kLeave)) {
    left_[peer] = 1;
    in = Incoming{};
    matchBuffered(done);  // what it sent before leaving is still received
    failForLeftLocked(done);
    return;
  }
  if (h.magic != kWireMagic || h.kind != static_cast<uint8_t>(OpKind::kSend)) {
    fatal(rankPrefix(rank_, size_) + " protocol error on the p2p connection from rank " +
              std::to_string(peer) + " (" + addrs_[peer] + "): bad message header",
          done);
    return;
  }
  // A receive takes an earlier message of its tag read aside first.
  matchBuffered(done);
  bool someoneWaits = false;
  for (auto it = recvs_.begin(); it != recvs_.end(); ++it) {
    // A claimed receive already takes another peer's message (any-source
    // receives match whichever header arrives first, and only that one).
    if (it->claimed || (it->peer != peer && it->peer != -1)) continue;
    someoneWaits = true;
    if (it->tag != h.step) continue;
    const std::string what = disagreement(*it, h);
    if (!what.empty()) {
      done.push_back({std::move(it->cb),
                      {peer, transportError(it->op.ctx.message(
                                 "from rank " + std::to_string(peer) + " tag " +
                                 std::to_string(h.step) + ": " + what))}});
      recvs_.erase(it);
      in.draining = true;
    } else {
      it->claimed = true;
      in.match = it;
      in.matched = true;
    }
    return;
  }
  if (someoneWaits) {
    try {
      in.aside.resize(h.bytes);
    } catch (const std::exception& err) {  // bad_alloc: on this thread it would terminate
      fatal(rankPrefix(rank_, size_) + " cannot read aside a message of " +
                std::to_string(h.bytes) + " bytes from rank " + std::to_string(peer) +
                " (send tag " + std::to_string(h.step) + ", no receive posted for it yet) " +
                "while a receive for another tag from that rank waits: " + err.what() +
                "; post the receive for that tag first",
            done);
      return;
    }
    in.buffering = true;
  }
}

std::string P2PEngine::disagreement(const Recv& r, const WireHeader& h) {
  if (h.bytes != r.bytes) {
    return "byte count mismatch: got " + std::to_string(h.bytes) + ", expected " +
           std::to_string(r.bytes);
  }
  if (h.dtype != r.op.dtype) {
    return "dtype mismatch: the sender sent " + dtypeName(static_cast<c10::ScalarType>(h.dtype));
  }
  return "";
}

void P2PEngine::matchBuffered(std::vector<Completion>& done) {
  for (auto it = recvs_.begin(); it != recvs_.end();) {
    bool taken = false;
    for (int peer = 0; peer < size_ && !it->claimed && !taken; ++peer) {
      if (it->peer != peer && it->peer != -1) continue;
      auto& queue = buffered_[peer];
      auto msg = std::find_if(queue.begin(), queue.end(),
                              [&](const Buffered& b) { return b.header.step == it->tag; });
      if (msg == queue.end()) continue;
      const std::string what = disagreement(*it, msg->header);
      if (what.empty()) {
        std::memcpy(it->data, msg->payload.data(), msg->payload.size());
        done.push_back({std::move(it->cb), {peer, nullptr}});
      } else {
        done.push_back({std::move(it->cb),
                        {peer, transportError(it->op.ctx.message(
                                   "from rank " + std::to_string(peer) + " tag " +
                                   std::to_string(it->tag) + ": " + what))}});
      }
      queue.erase(msg);
      taken = true;
    }
    it = taken ? recvs_.erase(it) : std::next(it);
  }
}

void P2PEngine::failForLeftLocked(std::vector<Completion>& done) {
  int remaining = 0;  // peers still in the group
  for (int peer = 0; peer < size_; ++peer) remaining += peer != rank_ && !left_[peer];
  if (remaining == size_ - 1) return;
  const std::string left = " left the group (destroy_process_group)";
  for (auto it = recvs_.begin(); it != recvs_.end();) {
    const bool gone = it->peer >= 0 ? left_[it->peer] != 0 : remaining == 0;
    if (it->claimed || !gone) {
      ++it;
      continue;
    }
    const std::string who = it->peer >= 0 ? "rank " + std::to_string(it->peer) + left
                                          : "every other rank" + left;
    done.push_back({std::move(it->cb),
                    {it->peer, transportError(it->op.ctx.message(
                                   who + " before sending a message for this receive"))}});
    it = recvs_.erase(it);
  }
  for (int peer = 0; peer < size_; ++peer) {
    if (!left_[peer]) continue;
    for (auto& send : sends_[peer]) {
      done.push_back({std::move(send.cb),
                      {peer, transportError(send.op.ctx.message(
                                 "rank " + std::to_string(peer) + left +
                                 " before this message was sent"))}});
    }
    sends_[peer].clear();
  }
}

void P2PEngine::readFrom(int peer, std::vector<Completion>& done) {
  Incoming& in = incoming_[peer];
  char scratch[64 * 1024];
  while (!left_[peer]) {
    bool inHeader = in.headerDone < sizeof(WireHeader);
    if (!inHeader && !in.matched && !in.draining && !in.buffering) {
      return;  // waiting for a matching recv
    }
    size_t remaining = inHeader ? sizeof(WireHeader) - in.headerDone : in.header.bytes - in.dataDone;
    if (!inHeader && remaining == 0) {
      if (in.matched) {
        done.push_back({std::move(in.match->cb), {peer, nullptr}});
        recvs_.erase(in.match);
      } else if (in.buffering) {
        buffered_[peer].push_back({in.header, std::move(in.aside)});
      }
      in = Incoming{};
      if (!wantsRead(peer)) return;
      continue;
    }
    char* dst = inHeader ? reinterpret_cast<char*>(&in.header) + in.headerDone
                : in.matched ? in.match->data + in.dataDone
                : in.buffering ? in.aside.data() + in.dataDone
                : scratch;
    size_t want = in.draining ? std::min(remaining, sizeof(scratch)) : remaining;
    ssize_t r = ::recv(fds_[peer], dst, want, MSG_DONTWAIT);
    if (r == 0 || (r < 0 && !retryable())) {
      std::string why = r == 0 ? "connection closed by the peer (it exited or aborted)"
                               : std::strerror(errno);
      fatal(rankPrefix(rank_, size_) + " p2p connection with rank " + std::to_string(peer) +
                " (" + addrs_[peer] + "): " + why,
            done);
      return;
    }
    if (r < 0) return;
    if (inHeader) {
      in.headerDone += static_cast<size_t>(r);
      if (in.headerDone == sizeof(WireHeader)) matchHeader(peer, done);
    } else {
      in.dataDone += static_cast<size_t>(r);
    }
  }
}

ssize_t P2PEngine::sendMore(int peer, const Send& s) {
  const size_t total = sizeof(WireHeader) + s.header.bytes;
  if (s.done == total) return 0;
  iovec iov[2];
  int n = 0;
  if (s.done < sizeof(WireHeader)) {
    iov[n++] = {const_cast<char*>(reinterpret_cast<const char*>(&s.header)) + s.done,
                sizeof(WireHeader) - s.done};
    iov[n++] = {const_cast<char*>(s.data), s.header.bytes};
  } else {
    iov[n++] = {const_cast<char*>(s.data) + (s.done - sizeof(WireHeader)), total - s.done};
  }
  msghdr msg{};
  msg.msg_iov = iov;
  msg.msg_iovlen = n;
  return sendmsg(fds_[peer], &msg, MSG_NOSIGNAL | MSG_DONTWAIT);
}

bool P2PEngine::sendNowLocked(int peer) {
  Send& s = sends_[peer].front();
  if (testHooks().tcpFailSendTag.load(std::memory_order_relaxed) >= 0) return false;
  const ssize_t r = sendMore(peer, s);
  if (r <= 0) return false;  // the socket is full, or an error the thread reports
  s.done += static_cast<size_t>(r);
  return s.done == sizeof(WireHeader) + s.header.bytes;
}

void P2PEngine::writeTo(int peer, std::vector<Completion>& done) {
  auto& queue = sends_[peer];
  while (!queue.empty()) {
    Send& s = queue.front();
    if (s.done == 0 && static_cast<int64_t>(s.header.step) ==
                           testHooks().tcpFailSendTag.load(std::memory_order_relaxed)) {
      fatal(s.op.ctx.message("send to rank " + std::to_string(peer) +
                             " failed: injected (testing)"),
            done);
      return;
    }
    const size_t total = sizeof(WireHeader) + s.header.bytes;
    const ssize_t r = sendMore(peer, s);
    if (r < 0) {
      if (retryable()) return;
      fatal(s.op.ctx.message("send to rank " + std::to_string(peer) + " (" + addrs_[peer] +
                             ") failed: " + std::strerror(errno)),
            done);
      return;
    }
    s.done += static_cast<size_t>(r);
    if (s.done < total) return;
    done.push_back({std::move(s.cb), {peer, nullptr}});
    queue.pop_front();
  }
}

void P2PEngine::expire(std::vector<Completion>& done) {
  const auto now = Clock::now();
  for (int peer = 0; peer < size_; ++peer) {
    auto& queue = sends_[peer];
    if (!queue.empty() && queue.front().op.deadline <= now) {
      fatal(queue.front().op.ctx.message("send to rank " + std::to_string(peer) +
                                         ": Timed out after sending " +
                                         std::to_string(queue.front().done) + " of " +
                                         std::to_string(sizeof(WireHeader) +
                                                        queue.front().header.bytes) +
                                         " bytes (with header)"),
            done);
      return;
    }
  }
  for (auto it = recvs_.begin(); it != recvs_.end();) {
    const bool inFlight = it->claimed;
    if (it->op.deadline > now) {
      ++it;
    } else if (inFlight) {
      fatal(it->op.ctx.message("recv: Timed out in the middle of a message"), done);
      return;
    } else {
      std::string from = it->peer < 0 ? "any rank" : "rank " + std::to_string(it->peer);
      done.push_back({std::move(it->cb), {it->peer, transportError(it->op.ctx.message(
                                                        "Timed out waiting for a message from " +
                                                        from + " with tag " +
                                                        std::to_string(it->tag)))}});
      it = recvs_.erase(it);
    }
  }
}
}  // namespace tcp
}  // namespace ringreduce
