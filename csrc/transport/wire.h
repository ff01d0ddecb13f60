// The wire format every transport speaks: the header sent before each
// message, its checks against the receiving op, and the progress records of
// one exchange. Used only inside the transports (tcp/, shm/); the algorithms
// and the backend see transport.h alone.
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "transport/transport.h"

namespace ringreduce {

// Sent before every message. The receiver checks every field against what its
// own op expects, so collectives that differ across ranks fail loudly instead
// of corrupting data or hanging.
struct WireHeader {
  uint32_t magic;
  uint8_t kind;      // OpKind
  uint8_t dtype;     // c10::ScalarType
  uint8_t reduceOp;  // c10d::ReduceOp::RedOpType, kNoReduceOp when none
  uint8_t reserved;
  int32_t root;      // the op's root rank (broadcast, reduce, gather, scatter), kNoRoot if none
  uint32_t reserved2;
  uint64_t seq;      // collective sequence number (p2p: per-pair message index)
  uint64_t total;    // op-wide element count both sides must agree on, kUnchecked if none
  uint64_t step;     // ring step / chunk index (p2p: the tag); kAckStep for an acknowledgement
  uint64_t bytes;    // payload bytes that follow
};
static_assert(sizeof(WireHeader) == 48, "WireHeader must stay 48 bytes");

constexpr uint32_t kWireMagic = 0x52524431;  // "RRD1"

// Human text for the first field of a received header that differs from what
// this op and receive expect; empty when it matches.
std::string headerMismatch(const OpInfo& op, const RecvSpec& spec, const WireHeader& h);

// How far one message of an exchange has got (a transport's bookkeeping).
struct SendProgress {
  const SendSpec* spec;
  WireHeader header;  // what this op stamps on the message (messageHeader)
  size_t done = 0;    // bytes of header + payload handed over
  size_t total() const { return sizeof(WireHeader) + spec->bytes; }
};

struct RecvProgress {
  RecvSpec* spec;
  WireHeader header{};
  size_t headerDone = 0;
  size_t dataDone = 0;
  size_t handed = 0;  // payload bytes given to spec->consume (the rest are in data)
  bool finished() const { return headerDone == sizeof(WireHeader) && dataDone == spec->bytes; }
};

// The header `op` stamps on the message of `send`.
WireHeader messageHeader(const OpInfo& op, const SendSpec& send);

// Fresh progress records for one exchange's sends (headers stamped) and receives.
void startProgress(const OpInfo& op, std::vector<SendSpec>& sends, std::vector<RecvSpec>& recvs,
                   std::vector<SendProgress>* sendProgress,
                   std::vector<RecvProgress>* recvProgress);

// When `op` timed out: the first transfer still open, as (peer, "timed out
// after ... ms waiting to receive: got X of Y bytes ..."); peer -1 if none.
std::pair<int, std::string> timeoutReport(const OpInfo& op, const std::vector<SendProgress>& sends,
                                          const std::vector<RecvProgress>& recvs);

}  // namespace ringreduce
