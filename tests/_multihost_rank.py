"""One rank of the two-host test (tests/test_multihost.py), run inside a
network namespace. Prints one JSON line: this rank's listen address and the
collective results, checked by the test against closed forms."""
import json
import sys
from datetime import timedelta

import torch
import torch.distributed as dist


def main():
    rank, world, master, port = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
    dist.init_process_group(
        "ringreduce",
        init_method=f"tcp://{master}:{port}",
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=60),
    )
    backend = dist.group.WORLD._get_backend(torch.device("cpu"))
    t = torch.arange(100_003, dtype=torch.float64) * (rank + 1)
    dist.all_reduce(t)
    b = torch.full((1000,), float(rank))
    dist.broadcast(b, src=1)
    gathered = [torch.zeros(3, dtype=torch.int64) for _ in range(world)]
    dist.all_gather(gathered, torch.full((3,), rank, dtype=torch.int64))
    print(json.dumps({
        "rank": rank,
        "listen": backend.listen_address(),
        "allreduce_ok": bool(torch.equal(
            t, torch.arange(100_003, dtype=torch.float64) * sum(range(1, world + 1)))),
        "broadcast_ok": bool((b == 1).all()),
        "allgather": [g.tolist() for g in gathered],
    }), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
