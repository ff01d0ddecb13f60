// RoutedTransport: per-peer data paths (see routed_transport.h).
#include "transport/routed_transport.h"

#include <chrono>
#include <condition_variable>
#include <functional>
#include <mutex>
#include <thread>

#include "common/errors.h"
#include "common/thread_name.h"
#include "transport/mesh.h"

namespace ringreduce {
namespace {

using Clock = std::chrono::steady_clock;

// One long-lived helper thread that runs one job at a time for the caller,
// which waits for it (a thread per exchange would cost its start-up each time).
class Helper {
 public:
  ~Helper() { stop(); }

  // Ends the thread once it has run the job it was given, if any; a later
  // start() is refused. Not from the helper's own job.
  void stop() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    if (thread_.joinable()) thread_.join();
  }

  // False once stopped: the job is not run.
  bool start(std::function<void()> job) {
    std::lock_guard<std::mutex> lock(mu_);
    if (stop_) return false;
    if (!thread_.joinable()) {
      thread_ = std::thread([this] {
        nameThisThread("rr-route");
        loop();
      });
    }
    job_ = std::move(job);
    done_ = false;
    cv_.notify_all();
    return true;
  }

  void wait() {
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait(lock, [this] { return done_; });
  }

 private:
  void loop() {
    std::unique_lock<std::mutex> lock(mu_);
    while (true) {
      cv_.wait(lock, [this] { return stop_ || job_; });
      if (!job_) return;  // stopped; a job given before the stop still runs
      auto job = std::move(job_);
      job_ = nullptr;
      lock.unlock();
      job();
      lock.lock();
      done_ = true;
      cv_.notify_all();
    }
  }

  std::mutex mu_;
  std::condition_variable cv_;
  std::function<void()> job_;  // guarded by mu_
  bool done_ = true;           // guarded by mu_
  bool stop_ = false;          // guarded by mu_
  std::thread thread_;
};

class RoutedTransport : public Transport {
 public:
  RoutedTransport(std::unique_ptr<Transport> tcp, std::unique_ptr<Transport> shm)
      : tcp_(std::move(tcp)), shm_(std::move(shm)) {
    const Topology& t = tcp_->topology();
    const int rank = tcp_->mesh().rank();
    onHost_.assign(t.hostOf.size(), false);
    for (int r : t.hosts[t.hostOf[rank]]) onHost_[r] = r != rank;
    mixed_ = t.hosts.size() > 1;
  }

  ~RoutedTransport() override { close(); }

  std::string name() const override { return mixed_ ? "shm+tcp" : "shm"; }
  Mesh& mesh() override { return tcp_->mesh(); }
  const Topology& topology() const override { return tcp_->topology(); }
  SharedBuffers* sharedBuffers() override { return shm_->sharedBuffers(); }
  RingStoreUse ringStoreUse(bool reset) override { return shm_->ringStoreUse(reset); }

  void exchange(const OpInfo& op, std::vector<SendSpec>& sends,
                std::vector<RecvSpec>& recvs) override {
    bool viaShm = false, viaTcp = false;
    for (const auto& s : sends) (onHost_[s.peer] ? viaShm : viaTcp) = true;
    for (const auto& r : recvs) (onHost_[r.peer] ? viaShm : viaTcp) = true;
    if (!viaTcp) return shm_->exchange(op, sends, recvs);
    if (!viaShm) {
      shm_->announceOp(op);  // this host's peers may be waiting for this rank
      return tcp_->exchange(op, sends, recvs);
    }
    exchangeMixed(op, sends, recvs);
  }

  void postSend(const OpInfo& op, int peer, uint64_t tag, const void* data, size_t bytes,
                P2PCallback done) override {
    tcp_->postSend(op, peer, tag, data, bytes, std::move(done));
  }
  void postRecv(const OpInfo& op, int peer, uint64_t tag, void* data, size_t bytes,
                P2PCallback done) override {
    tcp_->postRecv(op, peer, tag, data, bytes, std::move(done));
  }

  // The segment's flag covers this host's peers; TCP's abort frames the others.
  // Both checks, and what abandonUnconfirmed() tells the peers, under one
  // lock: an abort on another thread (shutdown) lands before both checks of
  // an op (the op fails here and everywhere) or after both (its frames and
  // flag name the next op, so the op stands everywhere), never between them
  // (frames naming the next op to the other hosts while this rank failed this
  // one in its shared-memory check).
  void confirm(const OpInfo& op) override {
    std::lock_guard<std::mutex> lock(confirmMu_);
    if (mixed_) tcp_->confirm(op);
    shm_->confirm(op);
  }
  void abandonUnconfirmed() override {
    std::lock_guard<std::mutex> lock(confirmMu_);
    if (mixed_) tcp_->abandonUnconfirmed();
    shm_->abandonUnconfirmed();
  }
  // The other hosts' abort frames and the segment's flag first (one op, one
  // outcome), then the mesh's abort (outside the lock: it may run p2p
  // callbacks on this thread).
  void abort(const std::string& reason) override {
    abandonUnconfirmed();
    shm_->abort(reason);
  }
  std::string abortReason() const override { return tcp_->abortReason(); }
  // No op runs any more (the backend closes after they left): the helper
  // thread ends here, not when the backend object is freed.
  void close() override {
    helper_.stop();
    shm_->close();
    tcp_->close();
  }

 private:
  // Splits the exchange by path; the TCP part runs on the helper. A failure
  // on either side aborts the group, which ends the other side's wait at
  // once; the first failure (in time) is what this rank raises.
  void exchangeMixed(const OpInfo& op, std::vector<SendSpec>& sends,
                     std::vector<RecvSpec>& recvs) {
    std::vector<SendSpec> shmSends, tcpSends;
    std::vector<RecvSpec> shmRecvs, tcpRecvs;
    for (auto& s : sends) (onHost_[s.peer] ? shmSends : tcpSends).push_back(s);
    for (auto& r : recvs) (onHost_[r.peer] ? shmRecvs : tcpRecvs).push_back(std::move(r));
    // In place only once every send is complete, TCP's too: the copies fill
    // their buffers, and Comm::exchange hands them over afterwards.
    for (auto& r : shmRecvs) r.consume = nullptr;
    std::exception_ptr tcpError, shmError;
    Clock::time_point tcpAt, shmAt;
    // Records a failure (and when) and aborts the group, which ends the other
    // side's wait. Never throws (the helper's job must not, and the caller
    // must reach helper_.wait()).
    auto failed = [&](std::exception_ptr* error, Clock::time_point* at) noexcept {
      *error = std::current_exception();
      *at = Clock::now();
      try {
        std::string what = "a transfer failed";
        try {
          std::rethrow_exception(*error);
        } catch (const std::exception& err) {
          what = err.what();
        } catch (...) {
        }
        abort(op.ctx.message(what));
      } catch (...) {
        abort("a transfer failed");  // best effort: the other side must stop waiting
      }
    };
    const bool started = helper_.start([&] {
      try {
        tcp_->exchange(op, tcpSends, tcpRecvs);
      } catch (...) {
        failed(&tcpError, &tcpAt);
      }
    });
    if (!started) throwTransportError(unusable(op, "the group was shut down"));
    try {
      shm_->exchange(op, shmSends, shmRecvs);
    } catch (...) {
      failed(&shmError, &shmAt);
    }
    helper_.wait();
    if (tcpError && shmError) {
      // Raise the cause, not the other side's "no longer usable": the error
      // whose text starts with the reason the group was aborted for.
      const std::string reason = tcp_->abortReason();
      if (startsWith(tcpError, reason)) std::rethrow_exception(tcpError);
      if (startsWith(shmError, reason)) std::rethrow_exception(shmError);
    }
    if (tcpError && (!shmError || tcpAt < shmAt)) std::rethrow_exception(tcpError);
    if (shmError) std::rethrow_exception(shmError);
  }

  static bool startsWith(const std::exception_ptr& error, const std::string& prefix) {
    if (prefix.empty()) return false;
    try {
      std::rethrow_exception(error);
    } catch (const std::exception& err) {
      return std::string(err.what()).compare(0, prefix.size(), prefix) == 0;
    } catch (...) {
    }
    return false;
  }

  std::unique_ptr<Transport> tcp_;
  std::unique_ptr<Transport> shm_;  // declared after tcp_: destroyed first (it uses the mesh)
  std::vector<bool> onHost_;        // per rank: a peer on this host (shared memory)
  bool mixed_ = false;              // some peers are on other hosts
  std::mutex confirmMu_;            // confirm() against abandonUnconfirmed()
  Helper helper_;
};

}  // namespace

std::unique_ptr<Transport> makeRoutedTransport(std::unique_ptr<Transport> tcp,
                                               std::unique_ptr<Transport> shm) {
  return std::make_unique<RoutedTransport>(std::move(tcp), std::move(shm));
}

}  // namespace ringreduce
