// Memory every rank of a host maps, for algorithms in which ranks read each
// other's data in place instead of sending it (the two-step and hierarchical
// all-reduces). Only the shared-memory transport offers it
// (Transport::sharedBuffers(); null on TCP), and an algorithm over it never
// sees a segment, a futex or a socket. Its ranks are local: 0..size()-1 over
// the group's ranks on this host (all of the group's on one host).
//
// The unit is a round. Every rank runs the same rounds in the same order
// (rounds count on across ops, so the k-th round of an op is the same round
// number everywhere). In round g each rank owns a staging area of
// stagingBytes() (double-buffered: rounds g and g+1 use different areas) and
// two flags only it writes, "staged" and "reduced", which carry the round
// number: a flag left from an earlier round or op is never taken for this one.
//
// Waits observe the group's abort flag, the op's deadline and dead peers (the
// transport's spin/yield/sleep policy), and fail as Transport::exchange does:
// a DistBackendError naming rank, op#seq and the peer waited for, the group
// aborted. Not thread-safe: the backend's one op at a time drives it.
#pragma once

#include <cstddef>
#include <cstdint>

#include "transport/transport.h"

namespace ringreduce {

class SharedBuffers {
 public:
  virtual ~SharedBuffers() = default;

  // This rank's local index and how many ranks share the buffers; the rank
  // of the group that local index `local` is.
  virtual int rank() const = 0;
  virtual int size() const = 0;
  virtual int groupRank(int local) const = 0;

  // Bytes of each rank's staging area (a multiple of 64).
  virtual size_t stagingBytes() const = 0;

  // Starts this rank's next round of `op` and returns its number: waits until
  // no peer can still be reading this rank's area for it (every peer staged
  // the round before, so it finished the one that last used the area).
  virtual uint64_t beginRound(const OpInfo& op) = 0;

  // The stores of this rank's copies into its staging area (stage()) from now
  // until storesDone(): plain, or streaming (ring_stores.h) where they measured
  // faster for `op`'s kind and `bytes` (the rounds or op they cover), as the
  // rings choose theirs. Measured, the time until storesDone() is the sample:
  // it should cover the peers' reading of what was staged.
  virtual void chooseStores(const OpInfo& op, size_t bytes) = 0;
  // Copies n bytes from src to dst in this rank's staging area with the
  // chosen stores (plain without a choice). Visible to the peers once the
  // next publish*() is.
  virtual void stage(char* dst, const char* src, size_t n) = 0;
  // Whether the chosen stores stream (a staging area a rank builds a result
  // in, reading it back, is not for them).
  virtual bool streaming() const = 0;
  // Ends the choice (back to plain stores) and records its time when measured.
  virtual void storesDone() = 0;

  // Local rank `rank`'s staging area in `round` (every rank may read any area
  // between the flags that make it safe; only its owner writes it).
  virtual char* staging(int rank, uint64_t round) = 0;

  // This rank's area holds its `bytes` of step `step` (the round's index in
  // the op): stamps the op's header beside it and raises the staged flag.
  virtual void publishStaged(const OpInfo& op, uint64_t round, uint64_t step, size_t bytes) = 0;
  // Waits until every rank has staged `round`, and checks each one's stamp
  // against this op, step and byte count: a peer that runs another collective,
  // or the same one with other arguments, fails the op naming it. A peer that
  // sends this rank a message meanwhile runs another algorithm: the same.
  virtual void awaitStaged(const OpInfo& op, uint64_t round, uint64_t step, size_t bytes) = 0;

  // This rank wrote what the peers read back from its area in `round`.
  virtual void publishReduced(uint64_t round) = 0;
  // Waits until every rank has published `round` reduced.
  virtual void awaitReduced(const OpInfo& op, uint64_t round) = 0;
};

}  // namespace ringreduce
