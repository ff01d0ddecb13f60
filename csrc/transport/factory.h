// The one place a group's transport stack is built: the mesh (TCP: rendezvous,
// authentication, p2p, failures), the layout of the group's ranks on hosts,
// and a data path per peer (shared memory with the ranks on this host, TCP
// with the others), as gloo's device factory and NCCL's per-pair connection
// tables do. The backend sees only the Transport it returns.
#pragma once

#include <torch/csrc/distributed/c10d/Store.hpp>

#include <chrono>
#include <memory>

#include "transport/transport.h"

namespace ringreduce {

// Collective: every rank of the group calls it. Blocks until the group is
// connected (throws naming what is missing past `timeout`).
std::unique_ptr<Transport> connectGroup(const c10::intrusive_ptr<c10d::Store>& store, int rank,
                                        int size, std::chrono::milliseconds timeout);

}  // namespace ringreduce
