// The point-to-point layer the algorithms run on. Algorithms hand it lists of
// sends and receives addressed by peer rank; an implementation (TCP in tcp/,
// shared memory over TCP in shm/) moves the bytes. A composite transport can route each
// peer's transfers to a different implementation, because nothing here names
// a socket. What goes on the wire (headers, their checks, progress records) is
// the implementations' own business: transport/wire.h, included only by them.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "common/errors.h"

namespace ringreduce {

enum class OpKind : uint8_t {
  kAllreduce = 1,
  kBroadcast,
  kReduce,
  kAllgather,
  kGather,
  kScatter,
  kReduceScatter,
  kAlltoall,
  kBarrier,
  kSend,   // point-to-point (send/recv/recvAnysource)
  kAbort,  // written after a failing rank's last whole message: "I abandoned op #seq"
  kSparseAllreduce,  // allreduce of COO tensors (metadata, indices, values gathered)
  kLeave,  // p2p: the sender left the group cleanly (destroy_process_group); nothing follows
};

const char* opKindName(OpKind kind);

constexpr uint8_t kNoReduceOp = 0xff;
constexpr uint64_t kUnchecked = ~uint64_t{0};
constexpr int32_t kNoRoot = -1;
// The step of an acknowledgement: a payload-less message a receiver sends back
// once it has checked the op's headers, so a rank whose part of an op is only
// sending (a broadcast's root, gather's non-roots, scatter's root) learns in the
// same op whether its peers ran the same op.
constexpr uint64_t kAckStep = ~uint64_t{0} - 1;

// What every message of one op agrees on; the transport stamps it on sends and
// checks it on receives.
struct OpInfo {
  OpContext ctx;  // for error messages
  OpKind kind = OpKind::kBarrier;
  uint8_t dtype = 0;
  uint8_t reduceOp = kNoReduceOp;
  int32_t root = kNoRoot;
  uint64_t total = kUnchecked;
  std::chrono::milliseconds timeout{0};  // the deadline's distance from the op's start
  std::chrono::steady_clock::time_point deadline;
};

// "<op prefix>: the group is no longer usable (<tensor>); first error: <cause>"
std::string unusable(const OpInfo& op, const std::string& cause);

struct SendSpec {
  int peer;
  const void* data;
  size_t bytes;
  uint64_t step;
};

struct RecvSpec {
  int peer;
  void* data;
  size_t bytes;  // exactly this many bytes are expected (checked against the header)
  uint64_t step;
  // Called as payload arrives with the number of bytes received so far, so a
  // reduction can overlap with the rest of the transfer. May be empty.
  std::function<void(size_t)> onProgress;
  // Optional: the payload handed over in place instead of copied to `data`,
  // as consume(src, offset, bytes) for consecutive ranges that cover it once,
  // in order, at any byte boundary; src is valid only during the call. A
  // transport may call it only once every send of the same exchange() is
  // complete (so it may overwrite what those sends read), and may instead
  // copy some or all of the payload to `data` (then a whole buffer of
  // `bytes`): Comm::exchange hands that part over after exchange() returns.
  std::function<void(const char* src, size_t offset, size_t bytes)> consume;
};

// Completion of a point-to-point operation: sourceRank is the sender for
// receives; error is null on success.
using P2PCallback = std::function<void(int sourceRank, std::exception_ptr error)>;

class Mesh;
class SharedBuffers;

// Where the group's ranks run. hosts[h] lists the ranks on host h in
// ascending order; hosts are ordered by their lowest rank. Every rank holds
// the same table (built from what every rank published in the store), so
// every rank makes the same choices from it.
struct Topology {
  std::vector<std::vector<int>> hosts;
  std::vector<int> hostOf;      // per rank: its host's index
  std::vector<int> localIndex;  // per rank: its index among its host's ranks

  // One host per rank, all on host 0: what a group of one or an unknown layout has.
  static Topology singleHost(int size);
  // Every host runs the same number of ranks.
  bool uniform() const;
};

class Transport {
 public:
  virtual ~Transport() = default;

  // What carries this group's collectives: "tcp", "shm", "shm+tcp" (what
  // transport_kind() reports; the backend asks, never compares pointers).
  virtual std::string name() const = 0;

  // The group's control plane: store, failure spreading, abort (mesh.h).
  virtual Mesh& mesh() = 0;
  // Which host each rank runs on (one host when the transport cannot tell).
  virtual const Topology& topology() const = 0;

  // Progresses all sends and receives concurrently (a ring step sends right
  // while it receives left) until every one is complete. At most one send and
  // one receive per peer. On timeout, a lost peer or a header that does not
  // match, the transport aborts (so neighbours fail fast too) and this throws a
  // DistBackendError naming rank, op#seq, peer and bytes done/expected.
  virtual void exchange(const OpInfo& op, std::vector<SendSpec>& sends,
                        std::vector<RecvSpec>& recvs) = 0;

  // Point-to-point, independent of the collective order. Messages between two
  // ranks are matched in order per (peer, tag); peer -1 receives from anyone.
  // The callback runs on a transport thread.
  virtual void postSend(const OpInfo& op, int peer, uint64_t tag, const void* data,
                        size_t bytes, P2PCallback done) = 0;
  virtual void postRecv(const OpInfo& op, int peer, uint64_t tag, void* data, size_t bytes,
                        P2PCallback done) = 0;

  // Makes `op` visible to the waits of peers that share this path, before an
  // exchange that does not use it: a rank of a multi-host group whose op
  // moves data over TCP alone still writes its shared-memory slot, or a peer
  // on its host waiting for it could not tell that it runs another op.
  virtual void announceOp(const OpInfo& op) { (void)op; }

  // Called after an op's transfers all completed, before its Work succeeds:
  // throws (as exchange() does) if a peer abandoned the op meanwhile (it timed
  // out or failed), so that one op never has two outcomes. Cheap: a flag or
  // one poll() over the peers' connections.
  virtual void confirm(const OpInfo& op) { (void)op; }

  // Makes every pending and later transfer fail with `reason` and closes the
  // connections so peers notice at once. Safe from any thread; idempotent.
  virtual void abort(const std::string& reason) = 0;
  // Tells the peers this rank abandons the first op it has not confirmed,
  // without aborting yet (TCP: abort frames; shared memory: the segment's
  // flag; abort() does it too).
  virtual void abandonUnconfirmed() {}
  // Empty when healthy, else why the transport was aborted.
  virtual std::string abortReason() const = 0;
  // Stops threads and closes sockets. Idempotent; called by the destructor too.
  virtual void close() = 0;

  // How this rank wrote its shared-memory rings (transport/shm/ring_stores.h),
  // for a benchmark to print beside its table: `mode` "measured" (each
  // producer times both kinds of store), "plain" or "streaming" (forced, or
  // plain because the ranks do not fit the cores), empty without rings; and
  // per kind of op and size class (the op's largest message, a power of two
  // and up) how many ops took each kind. `reset` zeroes the counts after
  // reading them. Cheap: the counts are kept per op of 16 KiB and more.
  struct RingStoreUse {
    struct Row {
      OpKind kind;
      size_t sizeClass;  // bytes: the largest message is in [sizeClass, 2 sizeClass)
      uint64_t plain = 0;
      uint64_t streaming = 0;
    };
    std::string mode;
    std::vector<Row> rows;  // by kind, then size
    // The same for the staging areas (SharedBuffers::chooseStores), by the
    // bytes each choice covered: two-step rounds.
    std::vector<Row> staging;
  };
  virtual RingStoreUse ringStoreUse(bool reset) {
    (void)reset;
    return {};
  }

  // Memory every rank of this rank's host maps, for algorithms that read
  // peers' data in place (transport/shared_buffers.h); null where there is
  // none (TCP, a rank alone on its host). Owned by the transport, valid until
  // close().
  virtual SharedBuffers* sharedBuffers() { return nullptr; }
};

}  // namespace ringreduce
