"""IPv6: groups whose ranks listen and connect over ::1, chosen explicitly or by
the family of the store's host, run every kind of traffic correctly."""
import os
import socket
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from _harness import World, backend_under_test


def _has_ipv6_loopback():
    try:
        with socket.socket(socket.AF_INET6) as s:
            s.bind(("::1", 0))
        return True
    except OSError:
        return False


pytestmark = [
    pytest.mark.skipif(backend_under_test() != "ringreduce", reason="ringreduce's transport"),
    pytest.mark.skipif(not _has_ipv6_loopback(), reason="no IPv6 loopback here"),
]
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def world(backend, tmp_path_factory):
    with World(3, tmp_path_factory.mktemp("ipv6"), backend=backend, init=False,
               pg_timeout_s=30) as w:
        yield w


def _traffic(ctx):
    """All-reduce, broadcast and a send/recv ring, against closed forms."""
    n, r = ctx.world_size, ctx.rank
    t = torch.full((10000,), float(r + 1))
    dist.all_reduce(t)
    b = torch.full((5,), 7.0) if r == 0 else torch.zeros(5)
    dist.broadcast(b, src=0)
    sent = dist.isend(torch.full((4,), float(r)), (r + 1) % n)
    got = torch.zeros(4)
    dist.recv(got, (r - 1) % n)
    sent.wait()
    backend = dist.group.WORLD._get_backend(CPU)
    return {"sum_ok": bool(torch.all(t == n * (n + 1) / 2)), "bcast_ok": bool(torch.all(b == 7)),
            "ring": got[0].item(), "listen": backend.listen_address(),
            "kind": backend.transport_kind()}


def _explicit_address(ctx):
    os.environ["RINGREDUCE_SOCKET_ADDR"] = "::1"
    os.environ["RINGREDUCE_SHM"] = "0"  # every byte over TCP
    try:
        dist.init_process_group(ctx.backend, store=ctx.new_store("v6explicit"), rank=ctx.rank,
                                world_size=ctx.world_size, timeout=ctx.pg_timeout)
        out = _traffic(ctx)
        dist.destroy_process_group()
        return out
    finally:
        del os.environ["RINGREDUCE_SOCKET_ADDR"], os.environ["RINGREDUCE_SHM"]


def _store_on_ipv6(ctx):
    """A TCPStore on ::1 and no socket variable: the ranks listen on ::1 too."""
    files = ctx.new_store("v6port")
    if ctx.rank == 0:
        store = dist.TCPStore("::1", 0, ctx.world_size, is_master=True,
                              timeout=timedelta(seconds=30), wait_for_workers=False)
        files.set("port", str(store.port))
    else:
        port = int(files.get("port").decode())
        store = dist.TCPStore("::1", port, ctx.world_size, is_master=False,
                              timeout=timedelta(seconds=30))
    os.environ["RINGREDUCE_SHM"] = "0"
    try:
        dist.init_process_group(ctx.backend, store=store, rank=ctx.rank,
                                world_size=ctx.world_size, timeout=ctx.pg_timeout)
        out = _traffic(ctx)
        dist.destroy_process_group()
        return out
    finally:
        del os.environ["RINGREDUCE_SHM"]


@pytest.mark.parametrize("how", [_explicit_address, _store_on_ipv6], ids=["explicit", "store"])
def test_a_group_over_ipv6_loopback(world, how):
    results = world.run(how, timeout=120)
    for r, res in enumerate(results):
        assert res["sum_ok"] and res["bcast_ok"], (r, res)
        assert res["ring"] == float((r - 1) % 3), (r, res)
        assert res["listen"].startswith("[::1]:"), (r, res)
        assert res["kind"] == "tcp", (r, res)


@pytest.mark.parametrize("form", ["[::1]:{}", "::1:{}"])
def test_connect_takes_both_ipv6_forms(form):
    from torch_ringreduce import _C

    with socket.socket(socket.AF_INET6) as server:
        server.bind(("::1", 0))
        server.listen(1)
        _C._testing.connect(form.format(server.getsockname()[1]), 2000)
        conn, peer = server.accept()
        conn.close()
        assert peer[0] == "::1"
