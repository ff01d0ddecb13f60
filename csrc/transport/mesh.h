// The group's control plane, apart from any data path: the rendezvous through
// the store, authentication, failure detection and abort, and the first error
// published in the group. TcpMesh (tcp/tcp_mesh.h) implements it (its connections
// are how failures travel even when the data goes through shared memory); the
// backend and every other data path (shm/) reach it only through here: a data
// path's ops through ControlPlane, the backend and set-up through Mesh.
#pragma once

#include <chrono>
#include <functional>
#include <string>
#include <vector>

#include "transport/store_calls.h"
#include "transport/transport.h"
#include "transport/wait_policy.h"

namespace ringreduce {

// What a data path's waits see of the control plane while an op runs:
// failing the op, watching the peers it waits for, whether the group was
// aborted, and how to spend idle time. The shared-memory waits reach the
// control plane only through this; the transport itself and its set-up hold
// the Mesh.
class ControlPlane {
 public:
  virtual ~ControlPlane() = default;

  // Fails `op` as a failed transfer would: aborts the group, publishes the
  // error (the first one is named in every rank's message) and throws a
  // DistBackendError naming rank, op, peer (a rank of the whole group, or -1)
  // and `what`. A timeout also follows, through the store, whom the ranks wait
  // for.
  [[noreturn]] virtual void failOp(const OpInfo& op, int peer, const std::string& what) = 0;
  [[noreturn]] virtual void failTimeout(const OpInfo& op, int peer, const std::string& what) = 0;
  // A peer is known to have aborted: waits, briefly and best effort, until its
  // error is in the store, so that failOp() can name it.
  virtual void awaitPeerError() = 0;
  // The first of `peers` known to be gone (its connection closed: it exited
  // or aborted), or -1. Never blocks.
  virtual int closedPeer(const std::vector<int>& peers) = 0;

  // Called by a collective's wait while nothing moves; fails the op (failOp)
  // when a peer will never run it as this rank does:
  // - a rank rejected this op at the call (a bad argument; Mesh::
  //   publishRejected) and published why;
  // - with `acrossHosts`: a peer runs another op under this number. Headers
  //   cannot tell ops apart in which no rank reads another's message (a
  //   gather two ranks each think they are the root of; broadcasts in which
  //   every rank is the root and the connections fill). So the op says in the
  //   store which op it is (its messages' header, once per op) and reads what
  //   one of `waitingOn` (peers it waits for over TCP, the next in turn; may
  //   be empty) announced there: a peer whose op differs (headerMismatch)
  //   fails it. This also fails the op when a rank published the group's
  //   first error (an aborted peer whose socket still holds unsent bytes
  //   cannot get its FIN to this rank). `midMessage`: the peers this rank
  //   stopped writing to in the middle of a message.
  // Cheap unless due: each of the two looks (one store call) only for
  // collectives idle kLookAfter or more, then every 100 ms while the wait is
  // young, every quarter of the wait later (at most 2 s apart), per group.
  virtual void lookWhileIdle(const OpInfo& op, std::chrono::steady_clock::duration idle,
                             bool acrossHosts, const std::vector<int>& waitingOn = {},
                             const std::vector<int>& midMessage = {}) = 0;
  static constexpr std::chrono::milliseconds kLookAfter{100};

  // Whether the group was aborted, and why (empty when healthy).
  virtual bool aborted() const = 0;
  virtual std::string abortReason() const = 0;

  // How a waiting rank spends its idle time (shared by every data path).
  virtual WaitPolicy& waitPolicy() = 0;
};

// The whole control plane, as the backend, the transports and their set-up
// see it: the rendezvous store, abort and its hooks, what the backend
// publishes and reads, and the connections' diagnostics.
class Mesh : public ControlPlane {
 public:
  virtual int rank() const = 0;
  virtual int size() const = 0;

  // The store, with deadlines, and this group's key for `name` (the keys of a
  // re-created group differ).
  virtual StoreCalls& store() = 0;
  virtual std::string storeKey(const std::string& name) const = 0;
  // Whether the peer's connection has ended (closedPeer also reports one that
  // merely has data waiting, which a peer that finished set-up first may send).
  virtual bool hungUp(int peer) = 0;

  virtual void abort(const std::string& reason) = 0;
  // Called first when this rank fails a collective (failOp, failTimeout),
  // before the error is looked up or published (which may take a second): a
  // data path tells its peers the op is abandoned, so none of them confirms
  // it meanwhile (shared memory raises its segment's abort flag). One hook; an
  // empty one removes it (its owner's destructor).
  virtual void setAbandonHook(std::function<void(const OpInfo&)> hook) = 0;
  // Runs before an abort the mesh starts itself (a broken point-to-point
  // connection), ahead of its sockets' shutdown: the group's transport
  // abandons its first unconfirmed op there (abandonUnconfirmed), as its own
  // abort() does, so no peer confirms an op this rank then fails. nullptr
  // removes it; a call in progress finishes first.
  virtual void setAbortHook(std::function<void()> hook) = 0;
  // What made this rank fail its first failed collective (failOp,
  // failTimeout), set once: a timeout here, a failure here (a connection, a
  // check), or another rank's error (the group's first published error was
  // not this rank's). kNone until then, and for aborts no op failed in.
  enum class Failure { kNone, kTimeout, kLocal, kRemote };
  virtual Failure failure() const = 0;

  // A collective this rank rejected at the call (a bad argument) still takes
  // its sequence number: this says so in the store (best effort, never
  // throws), and a peer waiting in that op finds it (lookWhileIdle) and fails
  // the op naming this rank's error instead of waiting for the timeout. When
  // every rank rejected the op alike, no rank waits in it and the group stays
  // usable.
  virtual void publishRejected(uint64_t seq, const std::string& message) = 0;

  // "ip:port" this rank accepts connections on (empty for a group of one),
  // and the connections it refused (the last few, and how many in all).
  virtual std::string listenAddress() const = 0;
  virtual std::vector<std::string> refusedConnections() const = 0;
  virtual uint64_t refusedCount() const = 0;
};

// Waits for the store key `key`, watching the mesh meanwhile: a peer in
// `peers` that is gone makes this give up at once. Returns "" when the key
// appeared, else why not (`missing` at the deadline). `what` names the wait.
std::string awaitKeyWatching(Mesh& mesh, const std::string& key, const std::vector<int>& peers,
                             std::chrono::steady_clock::time_point deadline,
                             const std::string& what, const std::string& missing);

}  // namespace ringreduce
