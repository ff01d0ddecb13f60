// What an algorithm sees: its rank, the world, the op's wire identity and the
// transport. No sockets, tensors or Python.
#pragma once

#include <c10/util/SmallVector.h>

#include <exception>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "transport/traffic.h"
#include "transport/transport.h"

namespace ringreduce {

// Which all-reduce runs (allreduceAuto): kAuto picks by size and transport
// (chooseAllreduce); the others force one, for benchmarks and tests
// (RINGREDUCE_ALLREDUCE).
enum class AllreduceAlgorithm : uint8_t { kAuto, kRing, kDirect, kTwoStep, kHierarchical };
// Its name in RINGREDUCE_ALLREDUCE: auto, ring, direct, two_step, hierarchical.
const char* allreduceName(AllreduceAlgorithm a);
// The algorithm called `name`; false (and *out unchanged) when none is.
bool allreduceFromName(const std::string& name, AllreduceAlgorithm* out);

struct Comm {
  Transport& transport;
  const OpInfo& op;
  int rank;
  int size;
  size_t segmentBytes;  // largest ring message (pipelining unit)
  // Where this rank's payload bytes are counted, on every path: exchange(),
  // count() and the point-to-point posts below are the only places that add
  // to it. Shared: a point-to-point completion may outlive the backend.
  std::shared_ptr<Traffic> traffic;
  AllreduceAlgorithm allreduce = AllreduceAlgorithm::kAuto;
  // The chain broadcast even where the shared one runs (testHooks().broadcastChain).
  bool broadcastChain = false;
  // A Comm over part of the group (the hierarchical all-reduce's rings across
  // hosts): rank i of this Comm is rank (*ranks)[i] of the group. Null: all.
  const std::vector<int>* ranks = nullptr;

  // The Comm over `members` (ranks of the group; this rank is members[index]).
  Comm subgroup(const std::vector<int>& members, int index) const {
    return Comm{transport, op, index, static_cast<int>(members.size()), segmentBytes, traffic,
                AllreduceAlgorithm::kAuto, false, &members};
  }

  // Every algorithm moves its data through here: the transport's exchange,
  // then the bytes counted (a failed exchange throws and counts nothing).
  // The specs' peers are this Comm's ranks before and after (the transport
  // sees group ranks in between), so specs built from them map once.
  void exchange(std::vector<SendSpec>& sends, std::vector<RecvSpec>& recvs) const {
    std::vector<int> local;  // the peers as given, on a sub-group
    if (ranks != nullptr) {
      for (auto& s : sends) local.push_back(std::exchange(s.peer, (*ranks)[s.peer]));
      for (auto& r : recvs) local.push_back(std::exchange(r.peer, (*ranks)[r.peer]));
    }
    // Consumers: the transport hands in place what it can; the rest is
    // handed from the receive buffers once the exchange is complete. Each
    // wrapper refers to its record (one pointer: no allocation); records
    // for a few receives live on the stack.
    struct Consumer {
      size_t recv;        // index in recvs
      size_t handed = 0;  // bytes the transport handed in place
      std::function<void(const char*, size_t, size_t)> inner;
    };
    c10::SmallVector<Consumer, 4> consumers;
    for (size_t i = 0; i < recvs.size(); ++i) {
      if (recvs[i].consume) consumers.push_back(Consumer{i, 0, std::move(recvs[i].consume)});
    }
    for (Consumer& k : consumers) {  // not moved from here on: the wrappers point in
      recvs[k.recv].consume = [c = &k](const char* src, size_t at, size_t n) {
        c->inner(src, at, n);
        c->handed = at + n;
      };
    }
    transport.exchange(op, sends, recvs);
    if (ranks != nullptr) {
      size_t i = 0;
      for (auto& s : sends) s.peer = local[i++];
      for (auto& r : recvs) r.peer = local[i++];
    }
    for (Consumer& k : consumers) {
      RecvSpec& r = recvs[k.recv];
      if (k.handed < r.bytes) {
        k.inner(static_cast<const char*>(r.data) + k.handed, k.handed, r.bytes - k.handed);
      }
    }
    size_t out = 0, in = 0;
    for (const auto& s : sends) out += s.bytes;
    for (const auto& r : recvs) in += r.bytes;
    count(out, in);
  }

  // Bytes an algorithm moved without exchange() (peers read them in shared
  // memory): counted as if sent and received, once the op's moves succeeded.
  void count(size_t sent, size_t received) const {
    if (traffic) {
      traffic->sent(sent);
      traffic->received(received);
    }
  }

  // Point-to-point (Transport::postSend/postRecv): the payload is counted once
  // the transfer completed, before `done` runs (a failed one counts nothing).
  void postSend(int peer, uint64_t tag, const void* data, size_t bytes, P2PCallback done) const {
    transport.postSend(op, peer, tag, data, bytes, counted(std::move(done), bytes, 0));
  }
  void postRecv(int peer, uint64_t tag, void* data, size_t bytes, P2PCallback done) const {
    transport.postRecv(op, peer, tag, data, bytes, counted(std::move(done), 0, bytes));
  }

  int left() const { return (rank + size - 1) % size; }
  int right() const { return (rank + 1) % size; }

  // One step: send to sendPeer while receiving from recvPeer (either may be -1).
  void sendRecv(int sendPeer, const void* sendData, size_t sendBytes, int recvPeer,
                void* recvData, size_t recvBytes, uint64_t step,
                std::function<void(size_t)> onProgress = {}) const {
    std::vector<SendSpec> sends;
    std::vector<RecvSpec> recvs;
    if (sendPeer >= 0) sends.push_back({sendPeer, sendData, sendBytes, step});
    if (recvPeer >= 0) recvs.push_back({recvPeer, recvData, recvBytes, step, std::move(onProgress)});
    exchange(sends, recvs);
  }

 private:
  P2PCallback counted(P2PCallback done, size_t sent, size_t received) const {
    return [done = std::move(done), t = traffic, sent, received](int source,
                                                                  std::exception_ptr err) {
      if (!err && t) {
        t->sent(sent);
        t->received(received);
      }
      done(source, std::move(err));
    };
  }
};

}  // namespace ringreduce
