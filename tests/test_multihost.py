"""Two 'hosts' on one machine: network namespaces joined by a veth pair, one
rank in each. Checks that ranks find each other through the store's host
(MASTER_ADDR route) or RINGREDUCE_SOCKET_IFNAME, and that collectives are
correct across the link. Needs root (ip netns); skipped otherwise."""
import json
import os
import socket
import subprocess
import sys
import uuid

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
SUBNET = "10.213.47"  # inside the sandbox only: two namespaces made by this test


def _ip(*args, check=True):
    return subprocess.run(["ip", *args], check=check, capture_output=True, text=True)


@pytest.fixture(scope="module")
def two_hosts():
    tag = uuid.uuid4().hex[:6]
    names = [f"rr{tag}a", f"rr{tag}b"]
    links = [f"rv{tag}a", f"rv{tag}b"]
    try:
        _ip("netns", "add", names[0])
    except (subprocess.CalledProcessError, FileNotFoundError) as err:
        pytest.skip(f"network namespaces unavailable (needs root and iproute2): {err}")
    try:
        _ip("netns", "add", names[1])
        _ip("link", "add", links[0], "type", "veth", "peer", "name", links[1])
        for i in range(2):
            _ip("link", "set", links[i], "netns", names[i])
            _ip("-n", names[i], "addr", "add", f"{SUBNET}.{i + 1}/24", "dev", links[i])
            _ip("-n", names[i], "link", "set", links[i], "up")
            _ip("-n", names[i], "link", "set", "lo", "up")
        yield names, links
    finally:
        for name in names:
            _ip("netns", "del", name, check=False)


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_ranks(names, extra_env):
    master, port = f"{SUBNET}.1", str(_free_port())
    procs = []
    for rank, name in enumerate(names):
        env = dict(os.environ, PYTHONPATH=REPO, **extra_env[rank])
        cmd = ["ip", "netns", "exec", name, sys.executable,
               os.path.join(HERE, "_multihost_rank.py"), str(rank), "2", master, port]
        procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True))
    results = []
    for rank, proc in enumerate(procs):
        try:
            out, err = proc.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            for p in procs:
                p.kill()
            pytest.fail(f"rank {rank} hung across namespaces")
        assert proc.returncode == 0, f"rank {rank} failed:\n{err[-3000:]}"
        results.append(json.loads(out.strip().splitlines()[-1]))
    return results


@pytest.mark.parametrize("how", ["route_to_store", "ifname"])
def test_collectives_across_two_hosts(two_hosts, how):
    names, links = two_hosts
    env = [{}, {}] if how == "route_to_store" else [
        {"RINGREDUCE_SOCKET_IFNAME": links[0]}, {"RINGREDUCE_SOCKET_IFNAME": links[1]}]
    results = _run_ranks(names, env)
    for rank, res in enumerate(results):
        assert res["listen"].startswith(f"{SUBNET}.{rank + 1}:"), res
        assert res["allreduce_ok"] and res["broadcast_ok"], res
        assert res["allgather"] == [[0, 0, 0], [1, 1, 1]], res
