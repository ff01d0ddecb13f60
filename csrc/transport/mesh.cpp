// Mesh helpers shared by every data path's set-up (see mesh.h).
#include "transport/mesh.h"

namespace ringreduce {

std::string awaitKeyWatching(Mesh& mesh, const std::string& key, const std::vector<int>& peers,
                             std::chrono::steady_clock::time_point deadline,
                             const std::string& what, const std::string& missing) {
  // One store call for the whole wait (a slow store is no error before the
  // deadline); the mesh is looked at every 100 ms meanwhile.
  int gone = -1;
  // A peer that already finished the set-up may send its first collective's
  // data: only a connection that ended counts.
  auto peerGone = [&] {
    gone = mesh.closedPeer(peers);
    if (gone >= 0 && !mesh.hungUp(gone)) gone = -1;
    return gone >= 0;
  };
  if (mesh.store().waitForUnless(key, deadline, what, peerGone, std::chrono::milliseconds(100))) {
    return "";
  }
  if (gone >= 0) {
    return "rank " + std::to_string(gone) + " left during the set-up (it died or failed)";
  }
  return missing;
}

}  // namespace ringreduce
