// The TCP data path: exchange() drives a step's sends and receives over the
// mesh's collective connections (tcp_mesh.h) with one poll() loop;
// point-to-point goes to the mesh's P2PEngine. It owns no connection: the
// mesh does, and outlives it.
#pragma once

#include <poll.h>

#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "transport/tcp/tcp_mesh.h"
#include "transport/transport.h"

namespace ringreduce {
namespace tcp {

class TcpTransport : public Transport {
 public:
  TcpTransport(std::shared_ptr<TcpMesh> mesh, Topology topology)
      : mesh_(std::move(mesh)), topology_(std::move(topology)) {}
  ~TcpTransport() override;

  void exchange(const OpInfo& op, std::vector<SendSpec>& sends,
                std::vector<RecvSpec>& recvs) override;
  void postSend(const OpInfo& op, int peer, uint64_t tag, const void* data, size_t bytes,
                P2PCallback done) override;
  void postRecv(const OpInfo& op, int peer, uint64_t tag, void* data, size_t bytes,
                P2PCallback done) override;
  void confirm(const OpInfo& op) override;
  // Writes abort frames for the first op this rank has not confirmed, then
  // aborts the mesh. Under confirmMu_, as confirm() is: an abort from another
  // thread lands before this rank's check of an op (which then fails here and
  // at its peers) or after it (the op stands everywhere).
  void abort(const std::string& reason) override {
    abandonUnconfirmed();
    mesh_->abort(reason);
  }
  // The frames alone (a routed transport's abort, before its segment's flag).
  void abandonUnconfirmed() override {
    std::lock_guard<std::mutex> lock(confirmMu_);
    mesh_->abandonSeq(confirmed_ + 1);
  }
  std::string abortReason() const override { return mesh_->abortReason(); }
  std::string name() const override { return "tcp"; }
  void close() override { mesh_->close(); }
  Mesh& mesh() override { return *mesh_; }
  const Topology& topology() const override { return topology_; }

 private:
  // Busy-polls, then polls yielding the core, then sleeps in poll(), each for
  // as long as the mesh's wait policy allows (transport/wait_policy.h).
  int pollWithSpin(std::vector<pollfd>& pfds, int timeoutMs);
  // confirm()'s check, under confirmMu_: fails the op if a peer abandoned it.
  void confirmOpen(const OpInfo& op);

  std::shared_ptr<TcpMesh> mesh_;
  const Topology topology_;
  std::mutex confirmMu_;
  uint64_t confirmed_ = 0;  // guarded by confirmMu_: the last op confirm() passed
};

}  // namespace tcp
}  // namespace ringreduce
