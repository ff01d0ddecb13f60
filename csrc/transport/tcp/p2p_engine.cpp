// P2PEngine: an event loop over the p2p sockets.
//
// Sends to one peer go out in post order (header + payload per message).
// Receives match incoming messages by (source, tag) in post order, MPI-style:
// the engine reads a message's header only when some posted receive could take
// that peer, and leaves a header with no matching receive waiting (no
// unbounded buffering). A receive whose size or dtype does not match fails
// alone and its payload is drained, so the connection stays usable. A broken
// connection or a half-transferred timeout is fatal for the whole transport.
#include "transport/tcp/p2p_engine.h"

#include <fcntl.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <unistd.h>

#include <c10/util/Logging.h>
#include <c10/util/ScopeExit.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "common/rescue.h"
#include "common/thread_name.h"
#include "common/wait_hook.h"
#include "transport/tcp/socket.h"

namespace ringreduce {
namespace tcp {
namespace {

thread_local bool tInFatal = false;  // this thread runs onFatal_ (stop() must not wait for it)

bool retryable() {
  return errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR;
}

}  // namespace

std::shared_ptr<P2PEngine> P2PEngine::start(
    int rank, int size, std::vector<int> fds, std::vector<std::string> addrs,
    std::function<void(const std::string&)> onFatal,
    std::function<std::string(const std::string&)> explain) {
  auto engine = std::make_shared<P2PEngine>(Private{}, rank, size, std::move(fds),
                                            std::move(addrs), std::move(onFatal),
                                            std::move(explain));
  std::lock_guard<std::mutex> lock(engine->mu_);
  engine->spawnLocked();
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

void P2PEngine::spawnLocked() {
  threads_.emplace_back([self = shared_from_this()] {
    nameThisThread("rr-p2p");
    blockingHook() = {[](void* engine, bool certain) {
                        static_cast<P2PEngine*>(engine)->beforeBlocking(certain);
                      },
                      self.get()};
    self->loop();
  });
  ++live_;
  // Started after stop() let the threads go: nobody will join it.
  if (detachNew_) {
    threads_.back().detach();
    threads_.pop_back();
  }
}

// Every thread owns the engine, and a thread leaves loop() only after stop()
// took it out of threads_: this runs once they are all gone (on the last of
// them, or on the thread that dropped the last reference).
P2PEngine::~P2PEngine() {
  for (int& fd : wakePipe_) {
    if (fd >= 0) ::close(fd);
  }
}

void P2PEngine::stop() {
  // From a callback on one of the threads, another may be in a callback
  // waiting for the Work this one is completing: joining would wait forever.
  // The threads own the engine and end once their callbacks return.
  const bool fromCallback = blockingHook().arg == this;
  std::vector<Completion> orphans;
  {
    std::lock_guard<std::mutex> lock(mu_);
    // A clean leave (nothing failed) tells each peer so, after its last whole
    // message: a receive from any source there then waits for the others
    // instead of failing the group at this connection's end. Not after part
    // of a message (the end mid-message is an error there), and best effort
    // (a full socket buffer: no farewell, the end is an error as before).
    if (failed_.empty() && !stopping_) {
      WireHeader bye{kWireMagic, static_cast<uint8_t>(OpKind::kLeave), 0, kNoReduceOp, 0,
                     kNoRoot, 0, 0, kUnchecked, 0, 0};
      for (int peer = 0; peer < size_; ++peer) {
        if (peer == rank_ || fds_[peer] < 0) continue;
        if (!sends_[peer].empty() && sends_[peer].front().done > 0) continue;
        (void)!::send(fds_[peer], &bye, sizeof(bye), MSG_NOSIGNAL | MSG_DONTWAIT);
      }
    }
    stopping_ = true;
    if (fromCallback) detachNew_ = true;
    // The pending ops fail through ready_, run by the threads on their way
    // out, one at a time, with another thread started for a callback that
    // blocks (beforeBlocking), as while running: run here in a row, a callback
    // that waits for a later one would wait forever.
    std::vector<Completion> done;
    failAll("the process group was shut down", done);
    for (auto& d : done) ready_.push_back(std::move(d));
    // No thread left, or none free and none could start: run them here.
    if (live_ == 0 || (!ready_.empty() && !ensureRunnerLocked("the failed ops"))) {
      orphans.assign(std::make_move_iterator(ready_.begin()),
                     std::make_move_iterator(ready_.end()));
      ready_.clear();
    }
  }
  turnCv_.notify_all();
  wake();
  if (fromCallback && !tInFatal) {
    // The threads are let go below, and the owner goes once this returns:
    // an onFatal_ still running on another thread (the mesh's abort, bounded
    // by its store budget and the confirm lock) finishes first. Bounded
    // anyway: never a hang.
    std::unique_lock<std::mutex> lock(mu_);
    fatalCv_.wait_for(lock, std::chrono::seconds(10), [this] { return fatalInFlight_ == 0; });
  }
  for (auto& [cb, args] : orphans) cb(args.first, args.second);
  // Joined until none is left: one blocked in a callback may start another.
  while (true) {
    std::vector<std::thread> threads;
    {
      std::lock_guard<std::mutex> lock(mu_);
      threads.swap(threads_);
    }
    if (threads.empty()) break;
    for (auto& t : threads) {
      if (fromCallback) {
        t.detach();
      } else {
        t.join();
      }
    }
  }
  // The watcher ends with the last thread (it may start threads for the
  // failures' callbacks until then); it only ever waits for mu_.
  std::thread watcher;
  {
    std::lock_guard<std::mutex> lock(mu_);
    watcher.swap(watcher_);
  }
  watchCv_.notify_all();
  if (watcher.joinable()) {
    if (fromCallback) {
      watcher.detach();
    } else {
      watcher.join();
    }
  }
}

void P2PEngine::wake() {
  char c = 0;
  if (wakePipe_[1] >= 0) (void)!::write(wakePipe_[1], &c, 1);
}

void P2PEngine::postSend(const OpInfo& op, int peer, uint64_t tag, const void* data,
                         size_t bytes, P2PCallback done) {
  std::string failed;
  {
    std::lock_guard<std::mutex> lock(mu_);
    failed = failed_;
    if (failed.empty()) {
      WireHeader h{kWireMagic, static_cast<uint8_t>(OpKind::kSend), op.dtype, kNoReduceOp, 0,
                   kNoRoot, 0, sendSeq_[peer]++, kUnchecked, tag, bytes};
      sends_[peer].push_back({op, h, static_cast<const char*>(data), 0, std::move(done)});
      if (inCallbacks_ >= live_) armWatcherLocked();
    }
  }
  if (!failed.empty()) {
    done(peer, transportError(unusable(op, failed)));
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
      if (inCallbacks_ >= live_) armWatcherLocked();  // posted from a callback, every thread in one
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
    // The threads run them (see stop()); after stop() none may be left.
    if (live_ > 0 && (done.empty() || ensureRunnerLocked("the failed ops"))) {
      for (auto& d : done) ready_.push_back(std::move(d));
      done.clear();
    }
  }
  turnCv_.notify_all();
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

std::atomic<int64_t>& testFailSendTag() {
  static std::atomic<int64_t> tag{-1};
  return tag;
}

void P2PEngine::writeTo(int peer, std::vector<Completion>& done) {
  auto& queue = sends_[peer];
  while (!queue.empty()) {
    Send& s = queue.front();
    if (s.done == 0 && static_cast<int64_t>(s.header.step) ==
                           testFailSendTag().load(std::memory_order_relaxed)) {
      fatal(s.op.ctx.message("send to rank " + std::to_string(peer) +
                             " failed: injected (testing)"),
            done);
      return;
    }
    size_t total = sizeof(WireHeader) + s.header.bytes;
    iovec iov[2];
    int n = 0;
    if (s.done < sizeof(WireHeader)) {
      iov[n++] = {reinterpret_cast<char*>(&s.header) + s.done, sizeof(WireHeader) - s.done};
      iov[n++] = {const_cast<char*>(s.data), s.header.bytes};
    } else {
      iov[n++] = {const_cast<char*>(s.data) + (s.done - sizeof(WireHeader)), total - s.done};
    }
    msghdr msg{};
    msg.msg_iov = iov;
    msg.msg_iovlen = n;
    ssize_t r = total == s.done ? 0 : sendmsg(fds_[peer], &msg, MSG_NOSIGNAL | MSG_DONTWAIT);
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
                                         " timed out after sending " +
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
      fatal(it->op.ctx.message("recv timed out in the middle of a message"), done);
      return;
    } else {
      std::string from = it->peer < 0 ? "any rank" : "rank " + std::to_string(it->peer);
      done.push_back({std::move(it->cb), {it->peer, transportError(it->op.ctx.message(
                                                        "timed out waiting for a message from " +
                                                        from + " with tag " +
                                                        std::to_string(it->tag)))}});
      it = recvs_.erase(it);
    }
  }
}

void P2PEngine::drain(std::string& fatalReason, std::vector<Completion>& held) {
  if (!fatalReason.empty()) {
    // onFatal_ first: it publishes the group's first error and aborts the
    // mesh before a failed op's waiter (woken below) can destroy the group:
    // the peers then name this error instead of a reset connection.
    bool stopping;
    {
      std::lock_guard<std::mutex> lock(mu_);
      stopping = stopping_;  // a callback may have stopped the engine: the owner may be gone
      enterCallbacksLocked();  // onFatal_ fails the transport's ops: callbacks run here
      if (!stopping) ++fatalInFlight_;
    }
    if (onFatal_ && !stopping) {
      tInFatal = true;
      auto reset = c10::make_scope_exit([] { tInFatal = false; });
      onFatal_(fatalReason);
    }
    fatalReason.clear();
    std::lock_guard<std::mutex> lock(mu_);
    if (!stopping && --fatalInFlight_ == 0) fatalCv_.notify_all();
    --inCallbacks_;
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
      enterCallbacksLocked();
    }
    c.first(c.second.first, c.second.second);
    std::lock_guard<std::mutex> lock(mu_);
    --inCallbacks_;
  }
}

void P2PEngine::enterCallbacksLocked() {
  if (++inCallbacks_ == live_) busySince_ = Clock::now();
  // A thread that found completions before it polled (a receive matched to a
  // message read aside) runs them without having taken the turn: a thread
  // waiting for it polls meanwhile. Without this wake-up it slept on, and a
  // callback waiting for another receive waited for good (nobody polled, and
  // the deadlines are checked by the poller).
  if (!polling_ && waiting_ > 0) turnCv_.notify_one();
  if (inCallbacks_ >= live_ && pendingLocked()) armWatcherLocked();
}

bool P2PEngine::pendingLocked() const {
  if (!ready_.empty() || !recvs_.empty()) return true;
  return std::any_of(sends_.begin(), sends_.end(), [](const auto& q) { return !q.empty(); });
}

void P2PEngine::armWatcherLocked() {
  if (watchArmed_ || watcherFailed_ || (stopping_ && live_ == 0)) return;
  watchArmed_ = true;
  if (watcherStarted_) {
    watchCv_.notify_one();
    return;
  }
  try {
    watcher_ = std::thread([self = shared_from_this()] { self->watch(); });
    watcherStarted_ = true;
    // Started after stop() let the threads go: nobody will join it.
    if (detachNew_) watcher_.detach();
  } catch (const std::exception& err) {
    watcherFailed_ = true;
    watchArmed_ = false;
    LOG(WARNING) << rankPrefix(rank_, size_) << " could not start the p2p watcher ("
                 << err.what() << "); a callback blocked in Future.wait() may stall p2p ops";
  }
}

void P2PEngine::watch() {
  nameThisThread("rr-p2p-watch");
  std::unique_lock<std::mutex> lock(mu_);
  // It stays while stopping: the pending ops' failures wait in ready_ for the
  // engine's threads, whose callbacks may block as before.
  const auto gone = [this] { return stopping_ && live_ == 0; };
  while (true) {
    watchCv_.wait(lock, [&] { return watchArmed_ || gone(); });
    // Not woken early by progress: one look per kRescueAfter at most.
    watchCv_.wait_for(lock, kRescueAfter, gone);
    if (gone()) return;
    if (inCallbacks_ < live_ || !pendingLocked()) {
      watchArmed_ = false;  // a thread is free, or nothing waits: armed again when not
      continue;
    }
    // Past the first few, a rescue waits for a longer stall (common/rescue.h):
    // callbacks that are only slow return within it and end the stall.
    if (Clock::now() - busySince_ < rescueStall(rescues_)) continue;  // look again
    // Every thread has sat in one callback that long with ops pending:
    // blocked (in a wait without a hook, or a late-taken Future's callback)
    // or slow. Another thread runs what is ready and polls meanwhile.
    if (++rescues_ == kFastRescues + 1) {
      LOG(WARNING) << rankPrefix(rank_, size_) << " p2p callbacks have held every engine "
                   << "thread " << kFastRescues + 1 << " times (blocked, e.g. in "
                   << "Future.wait(), or slow); each further thread starts after a longer stall";
    }
    ensureRunnerLocked("callbacks that do not return");
  }
}

void P2PEngine::beforeBlocking(bool certain) {
  std::lock_guard<std::mutex> lock(mu_);
  // Callbacks that only may block (a taken Future's: torch's Future::wait()
  // has no hook) get one spare thread at most: no thread per completion
  // (Python callbacks waiting for the GIL all count as in callbacks). Deeper
  // levels of such waits are the watcher's (watch()).
  if (!certain && live_ >= 2) return;
  // Also while stopping: the failures of the pending ops wait in ready_ for
  // a thread that is not blocked.
  ensureRunnerLocked(certain ? "a callback that waits" : "callbacks that may wait");
}

bool P2PEngine::ensureRunnerLocked(const char* why) {
  if (inCallbacks_ < live_) {
    // A thread waiting for its turn, or the one polling, runs what is ready.
    if (!ready_.empty()) {
      turnCv_.notify_all();
      wake();
    }
    return true;
  }
  try {
    spawnLocked();
    return true;
  } catch (const std::exception& err) {
    LOG(WARNING) << rankPrefix(rank_, size_) << " could not start another p2p thread for "
                 << why << " (" << err.what() << "); the wait may time out";
    return false;
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
      std::unique_lock<std::mutex> lock(mu_);
      // One thread polls at a time; another started for a callback that
      // blocked waits here for its turn, or runs what is ready meanwhile.
      ++waiting_;
      turnCv_.wait(lock, [this] { return !polling_ || stopping_ || !ready_.empty(); });
      --waiting_;
      if (stopping_) {
        failAll("the process group was shut down", done);
        collect();
        // Leaves only with nothing ready, counted out in the same hold of the
        // lock: a callback that blocks must not count on a thread that is
        // already on its way out (beforeBlocking).
        if (ready_.empty() && fatalReason.empty()) {
          if (--live_ == 0) {
            watchCv_.notify_all();  // the watcher ends with the last thread
          } else if (inCallbacks_ >= live_) {
            busySince_ = Clock::now();  // the rest are all in callbacks
          }
          return;
        }
        continue;
      }
      if (!ready_.empty()) continue;
      pfds.clear();
      peers.clear();
      matchBuffered(done);
      failForLeftLocked(done);
      for (int peer = 0; peer < size_; ++peer) {
        if (peer == rank_ || left_[peer]) continue;
        Incoming& in = incoming_[peer];
        // A message being read aside is finished there first (a receive
        // posted meanwhile takes it from buffered_): matched now, its first
        // bytes would stay in `aside`.
        if (in.headerDone == sizeof(WireHeader) && !in.matched && !in.draining &&
            !in.buffering) {
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
      if (earliest != Clock::time_point::max()) timeoutMs = millisUntil(earliest) + 1;
      collect();
      if (!ready_.empty() || !fatalReason.empty()) continue;  // run those first
      polling_ = true;
    }
    pfds.push_back({wakePipe_[0], POLLIN, 0});
    poll(pfds.data(), pfds.size(), timeoutMs);
    if (pfds.back().revents != 0) {
      char buf[64];
      while (::read(wakePipe_[0], buf, sizeof(buf)) > 0) {
      }
    }
    bool handOff;
    {
      std::lock_guard<std::mutex> lock(mu_);
      polling_ = false;
      for (size_t i = 0; i + 1 < pfds.size() && failed_.empty() && !stopping_; ++i) {
        if (pfds[i].revents == 0) continue;
        if (!sends_[peers[i]].empty()) writeTo(peers[i], done);
        if (wantsRead(peers[i])) readFrom(peers[i], done);
      }
      if (failed_.empty() && !stopping_) expire(done);
      collect();
      // Another thread polls while this one runs completions (a callback may
      // block); with none to run, this one polls again without a wake-up.
      handOff = waiting_ > 0 && (!ready_.empty() || !fatalReason.empty());
    }
    // Every waiter: one that finds completions ready runs them and does not
    // poll, and the next must not be left asleep.
    if (handOff) turnCv_.notify_all();
  }
}

}  // namespace tcp
}  // namespace ringreduce
