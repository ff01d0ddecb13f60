// P2PEngine: an event loop over the p2p sockets.
//
// Sends to one peer go out in post order (header + payload per message).
// Receives match incoming messages by (source, tag) in post order, MPI-style:
// the engine reads a message's header only when some posted receive could take
// that peer, and leaves a header with no matching receive waiting (no
// unbounded buffering). A receive whose size or dtype does not match fails
// alone and its payload is drained, so the connection stays usable. A broken
// connection or a half-transferred timeout is fatal for the whole transport.
//
// This file: the engine's life (start, stop, fatal errors), posting and the
// poll loop. The socket side (reads, matching, writes, deadlines) is in
// p2p_wire.cpp.
#include "transport/tcp/p2p_engine.h"

#include <fcntl.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "common/thread_name.h"
#include "transport/tcp/socket.h"

namespace ringreduce {
namespace tcp {
namespace {

// The engine whose thread this is (stop() there must not join itself).
thread_local const P2PEngine* tEngine = nullptr;

}  // namespace

std::shared_ptr<P2PEngine> P2PEngine::start(
    int rank, int size, std::vector<int> fds, std::vector<std::string> addrs,
    std::function<void(const std::string&)> onFatal,
    std::function<std::string(const std::string&)> explain) {
  auto engine = std::make_shared<P2PEngine>(Private{}, rank, size, std::move(fds),
                                            std::move(addrs), std::move(onFatal),
                                            std::move(explain));
  std::lock_guard<std::mutex> lock(engine->mu_);
  engine->thread_ = std::thread([self = engine] {
    nameThisThread("rr-p2p");
    tEngine = self.get();
    self->loop();
  });
  return engine;
}

P2PEngine::P2PEngine(Private, int rank, int size, std::vector<int> fds,
                     std::vector<std::string> addrs,
                     std::function<void(const std::string&)> onFatal,
                     std::function<std::string(const std::string&)> explain)
    : rank_(rank),
      size_(size),
      fds_(std::move(fds)),
      addrs_(std::move(addrs)),
      sends_(size),
      incoming_(size),
      buffered_(size),
      sendSeq_(size, 0),
      left_(size, 0),
      onFatal_(std::move(onFatal)),
      explain_(std::move(explain)) {
  TORCH_CHECK(pipe2(wakePipe_, O_CLOEXEC | O_NONBLOCK) == 0, rankPrefix(rank, size),
              " pipe2 failed: ", std::strerror(errno));
}

// The thread owns the engine and leaves loop() only once stopping: this runs
// once it is gone (on it, or on the thread that dropped the last reference).
P2PEngine::~P2PEngine() {
  for (int& fd : wakePipe_) {
    if (fd >= 0) ::close(fd);
  }
}

void P2PEngine::stop() {
  std::thread thread;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (failed_.empty() && !stopping_) sayFarewellLocked();
    stopping_ = true;
    // The pending ops fail on the thread, on its way out (loop()).
    thread.swap(thread_);
  }
  wake();
  if (!thread.joinable()) return;  // stopped before
  if (tEngine == this) {
    thread.detach();  // called from a completion or onFatal_: it ends after it
  } else {
    thread.join();
  }
}

void P2PEngine::sayFarewellLocked() {
  // A clean leave (nothing failed) tells each peer so, after its last whole
  // message: a receive from any source there then waits for the others
  // instead of failing the group at this connection's end. Not after part
  // of a message (the end mid-message is an error there), and best effort
  // (a full socket buffer: no farewell, the end is an error as before).
  WireHeader bye{kWireMagic, static_cast<uint8_t>(OpKind::kLeave), 0, kNoReduceOp, 0,
                 kNoRoot, 0, 0, kUnchecked, 0, 0};
  for (int peer = 0; peer < size_; ++peer) {
    if (peer == rank_ || fds_[peer] < 0) continue;
    if (!sends_[peer].empty() && sends_[peer].front().done > 0) continue;
    (void)!::send(fds_[peer], &bye, sizeof(bye), MSG_NOSIGNAL | MSG_DONTWAIT);
  }
}

void P2PEngine::wake() {
  char c = 0;
  if (wakePipe_[1] >= 0) (void)!::write(wakePipe_[1], &c, 1);
}

void P2PEngine::postSend(const OpInfo& op, int peer, uint64_t tag, const void* data,
                         size_t bytes, P2PCallback done) {
  std::string failed;
  bool sent = false;
  {
    std::lock_guard<std::mutex> lock(mu_);
    failed = failed_;
    if (failed.empty()) {
      WireHeader h{kWireMagic, static_cast<uint8_t>(OpKind::kSend), op.dtype, kNoReduceOp, 0,
                   kNoRoot, 0, sendSeq_[peer]++, kUnchecked, tag, bytes};
      sends_[peer].push_back({op, h, static_cast<const char*>(data), 0, std::move(done)});
      // Nothing ahead of it to that peer: the posting thread writes it now
      // (an inline run: a small message never waits for the thread), the
      // thread writes the rest, if any.
      if (sends_[peer].size() == 1 && !stopping_ && !left_[peer] && sendNowLocked(peer)) {
        done = std::move(sends_[peer].front().cb);
        sends_[peer].pop_front();
        sent = true;
      }
    }
  }
  if (!failed.empty()) {
    done(peer, transportError(unusable(op, failed)));
    return;
  }
  if (sent) {
    done(peer, nullptr);
    return;
  }
  wake();
}

void P2PEngine::postRecv(const OpInfo& op, int peer, uint64_t tag, void* data, size_t bytes,
                         P2PCallback done) {
  std::string failed;
  {
    std::lock_guard<std::mutex> lock(mu_);
    failed = failed_;
    if (failed.empty()) {
      recvs_.push_back({op, peer, tag, static_cast<char*>(data), bytes, std::move(done), false});
    }
  }
  if (!failed.empty()) {
    done(peer, transportError(unusable(op, failed)));
    return;
  }
  wake();
}

void P2PEngine::abort(const std::string& reason) {
  std::vector<Completion> done;
  {
    std::lock_guard<std::mutex> lock(mu_);
    failAll(reason, done);
    // The thread runs them, unless it is gone (after stop()).
    if (thread_.joinable()) {
      for (auto& d : done) ready_.push_back(std::move(d));
      done.clear();
    }
  }
  wake();
  for (auto& [cb, args] : done) cb(args.first, args.second);
}

void P2PEngine::failAll(const std::string& reason, std::vector<Completion>& done) {
  if (failed_.empty()) failed_ = reason;
  for (int peer = 0; peer < size_; ++peer) {
    for (auto& s : sends_[peer]) {
      done.push_back({std::move(s.cb), {peer, transportError(unusable(s.op, reason))}});
    }
    sends_[peer].clear();
    incoming_[peer] = Incoming{};
    buffered_[peer].clear();
  }
  for (auto& r : recvs_) {
    done.push_back({std::move(r.cb), {r.peer, transportError(unusable(r.op, reason))}});
  }
  recvs_.clear();
}

void P2PEngine::fatal(const std::string& reason, std::vector<Completion>& done) {
  if (!failed_.empty()) return;  // already failed: that error stands
  // Runs under mu_: the lookup is bounded (a fraction of a second) and happens
  // once, on the way to failing everything.
  const std::string full = explain_ ? reason + explain_(reason) : reason;
  if (fatal_.empty()) fatal_ = full;
  failAll(full, done);
}

void P2PEngine::drain(std::string& fatalReason, std::vector<Completion>& held) {
  if (!fatalReason.empty()) {
    // onFatal_ first: it publishes the group's first error and aborts the
    // mesh before a failed op's waiter (woken below) can destroy the group:
    // the peers then name this error instead of a reset connection.
    bool stopping;
    {
      std::lock_guard<std::mutex> lock(mu_);
      stopping = stopping_;  // the owner may be gone
    }
    if (onFatal_ && !stopping) onFatal_(fatalReason);
    fatalReason.clear();
    std::lock_guard<std::mutex> lock(mu_);
    for (auto& c : held) ready_.push_back(std::move(c));
    held.clear();
  }
  while (true) {
    Completion c;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (ready_.empty()) break;
      c = std::move(ready_.front());
      ready_.pop_front();
    }
    c.first(c.second.first, c.second.second);
  }
}

void P2PEngine::loop() {
  std::vector<pollfd> pfds;
  std::vector<int> peers;
  std::vector<Completion> done;
  std::string fatalReason;
  std::vector<Completion> held;  // a fatal error's failures: run after onFatal_
  const auto collect = [&] {  // mu_ held
    if (fatalReason.empty()) std::swap(fatalReason, fatal_);
    for (auto& d : done) {
      if (fatalReason.empty()) {
        ready_.push_back(std::move(d));
      } else {
        held.push_back(std::move(d));
      }
    }
    done.clear();
  };
  while (true) {
    drain(fatalReason, held);
    int timeoutMs = -1;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (stopping_) {
        failAll("the process group was shut down", done);
        collect();
        if (ready_.empty() && fatalReason.empty()) return;  // leaves with nothing to run
        continue;
      }
      timeoutMs = pollSetLocked(pfds, peers, done);
      collect();
      if (!ready_.empty() || !fatalReason.empty()) continue;  // run those first
    }
    pfds.push_back({wakePipe_[0], POLLIN, 0});
    poll(pfds.data(), pfds.size(), timeoutMs);
    if (pfds.back().revents != 0) {
      char buf[64];
      while (::read(wakePipe_[0], buf, sizeof(buf)) > 0) {
      }
    }
    std::lock_guard<std::mutex> lock(mu_);
    for (size_t i = 0; i + 1 < pfds.size() && failed_.empty() && !stopping_; ++i) {
      if (pfds[i].revents == 0) continue;
      if (!sends_[peers[i]].empty()) writeTo(peers[i], done);
      if (wantsRead(peers[i])) readFrom(peers[i], done);
    }
    if (failed_.empty() && !stopping_) expire(done);
    collect();
  }
}

int P2PEngine::pollSetLocked(std::vector<pollfd>& pfds, std::vector<int>& peers,
                             std::vector<Completion>& done) {
  pfds.clear();
  peers.clear();
  matchBuffered(done);
  failForLeftLocked(done);
  for (int peer = 0; peer < size_; ++peer) {
    if (peer == rank_ || left_[peer]) continue;
    Incoming& in = incoming_[peer];
    // A message being read aside is finished there first (a receive posted
    // meanwhile takes it from buffered_): matched now, its first bytes would
    // stay in `aside`.
    if (in.headerDone == sizeof(WireHeader) && !in.matched && !in.draining && !in.buffering) {
      matchHeader(peer, done);
    }
    short events = (sends_[peer].empty() ? 0 : POLLOUT) | (wantsRead(peer) ? POLLIN : 0);
    if (events != 0) {
      pfds.push_back({fds_[peer], events, 0});
      peers.push_back(peer);
    }
  }
  auto earliest = Clock::time_point::max();
  for (auto& q : sends_) if (!q.empty()) earliest = std::min(earliest, q.front().op.deadline);
  for (auto& r : recvs_) earliest = std::min(earliest, r.op.deadline);
  return earliest == Clock::time_point::max() ? -1 : millisUntil(earliest) + 1;
}

}  // namespace tcp
}  // namespace ringreduce
