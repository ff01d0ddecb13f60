// A transport that routes each peer's transfers to the data path chosen for
// that peer: shared memory for the ranks on this host, TCP for the others.
// An exchange whose peers all use one path goes straight to it; one that
// mixes them (a ring step that receives from this host and sends to the next)
// drives the TCP part on a helper thread while this thread drives the shared-
// memory part, so both progress at once and neither waits on the other.
// Point-to-point always goes over TCP; failures and abort reach both paths.
#pragma once

#include <memory>

#include "transport/transport.h"

namespace ringreduce {

// `tcp`: the mesh's own TCP transport (every peer); `shm`: the shared-memory
// transport of this rank's host (its peers only).
std::unique_ptr<Transport> makeRoutedTransport(std::unique_ptr<Transport> tcp,
                                               std::unique_ptr<Transport> shm);

}  // namespace ringreduce
