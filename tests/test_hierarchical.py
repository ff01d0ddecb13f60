"""Groups spread over several "hosts" (network namespaces joined by a bridge,
scripts/benchmarks/_netns.py): shared memory among each host's ranks, TCP between hosts,
the hierarchical all-reduce where every host runs as many ranks. Every
collective is checked against gloo or an fp64 closed form, all-reduce results
bitwise across ranks (tests/_hosts_rank.py). Needs root; skipped otherwise."""
import json
import os
import socket
import subprocess
import sys

import pytest

from scripts.benchmarks import _netns

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_layout(layout, mode="cases", timeout=240, extra_env=None, shape=None):
    """Runs one rank per entry of `layout` (the host of each rank), with
    `extra_env` added to each rank's environment, after `shape(hosts)`; returns
    each rank's JSON report."""
    try:
        hosts = _netns.Hosts(max(layout) + 1)
        hosts.__enter__()
    except _netns.Unavailable as err:
        pytest.skip(str(err))
    try:
        if shape is not None:
            shape(hosts)
        port = str(_free_port())
        procs = []
        for rank, host in enumerate(layout):
            env = dict(os.environ, PYTHONPATH=REPO, RANK=str(rank), WORLD_SIZE=str(len(layout)),
                       LOCAL_RANK="0", MASTER_PORT=port, OMP_NUM_THREADS="1",
                       HOSTS_LAYOUT=",".join(map(str, layout)), **hosts.env(host),
                       **(extra_env or {}))
            cmd = hosts.exec(host, [sys.executable, os.path.join(HERE, "_hosts_rank.py"), mode])
            procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE,
                                          stderr=subprocess.PIPE, text=True))
        reports = []
        for rank, proc in enumerate(procs):
            try:
                out, err = proc.communicate(timeout=timeout)
            except subprocess.TimeoutExpired:
                for p in procs:
                    p.kill()
                pytest.fail(f"rank {rank} hung (layout {layout}, {mode})")
            lines = out.strip().splitlines()
            if mode == "fault" and rank == len(layout) - 1:
                reports.append(None)  # it killed itself
                continue
            assert proc.returncode == 0 and lines, f"rank {rank} failed:\n{err[-4000:]}"
            reports.append(json.loads(lines[-1]))
        return reports
    finally:
        hosts.__exit__()


def expected_kind(layout, rank):
    return "shm+tcp" if layout.count(layout[rank]) > 1 else "tcp"


@pytest.mark.parametrize("layout", [
    pytest.param([0, 0, 1, 1], id="2hosts-x2"),
    pytest.param([0, 1, 2, 0, 1, 2], id="3hosts-x2-interleaved"),
    pytest.param([0, 0, 1], id="uneven-2+1"),
])
def test_collectives_across_hosts(layout):
    reports = run_layout(layout)
    failures = [f for r in reports for f in r["failures"]]
    assert not failures, "\n".join(failures[:20])
    for rank, r in enumerate(reports):
        assert r["kind"] == expected_kind(layout, rank), (rank, r["kind"])


@pytest.mark.parametrize("layout", [
    pytest.param([0, 0, 1, 1], id="hierarchical-2x2"),
    pytest.param([0, 0, 1], id="mixed-exchanges-2+1"),  # the flat ring: shm and TCP at once
])
def test_rank_death_on_other_host_fails_everyone_fast(layout):
    reports = run_layout(layout, mode="fault")
    for rank, r in enumerate(reports[:-1]):
        assert r["raised"], f"rank {rank} completed an all-reduce without the last rank"
        assert r["seconds"] < 20, f"rank {rank} took {r['seconds']:.1f} s to notice"
        assert "rank" in r["raised"] and "allreduce" in r["raised"].lower(), r["raised"]


def test_root_disagreement_across_hosts_fails_fast():
    """Broadcasts whose ranks name different roots, two hosts of two ranks.
    A rank whose op moved data on one path only announced it on that path
    alone: rank 0 (root 0, sending on its host) never wrote its op in the
    store that rank 3 (root 3, writing to rank 0 over TCP) reads, and a rank
    whose op ran on TCP alone left its shared-memory slot stale. Every rank
    waited out the timeout; now each op is announced on both paths."""
    reports = run_layout([0, 0, 1, 1], mode="mismatch", timeout=200)
    for rank, r in enumerate(reports):
        for name, case in r["cases"].items():
            assert case["raised"], f"rank {rank}, {name}: the broadcast returned"
            assert case["seconds"] < 5, (
                f"rank {rank}, {name}: raised after {case['seconds']:.1f} s: {case['raised']}")
            assert "root mismatch" in case["raised"], (rank, name, case["raised"])


def test_destroy_joins_the_routed_transports_helper():
    """The thread that drives a mixed exchange's TCP part (`rr-route`) ended
    only when the backend object was freed, after destroy_process_group for
    as long as something (DDP) held the group."""
    layout = [0, 0, 1, 1]
    for rank, r in enumerate(run_layout(layout, mode="threads")):
        assert r["sum_ok"], f"rank {rank}: wrong all-reduce result"
        assert "rr-route" in r["during"], f"rank {rank}: {r['during']}"
        assert r["after"] == [], f"rank {rank}: still running after destroy: {r['after']}"


def test_an_op_confirmed_as_the_group_is_destroyed_has_one_outcome(tmp_path):
    """A rank on two paths checks an op on both (TCP's abort frames, then the
    segment's flag) before its Work succeeds. A destroy_process_group on
    another thread between the two checks sent the other hosts abort frames
    naming the next op, then failed this one in the shared-memory check: the
    rank on the other host, checking after the abort, completed the op the
    destroying rank failed.

    Layout [0, 0, 1], flat ring of 1 MiB blocks, host 0's link slowed so rank
    2 finishes last. Rank 0 sleeps 5 s in its shared-memory check and is
    destroyed once rank 1 finished; ranks 0 and 2 must agree (both complete,
    or, when rank 0 was still sending and not yet checking, both fail)."""
    def slow_host0(hosts):
        try:
            subprocess.run(["ip", "netns", "exec", hosts.names[0], "tc", "qdisc", "add", "dev",
                            hosts.links[0], "root", "tbf", "rate", "8mbit", "burst", "32kb",
                            "latency", "2000ms"], check=True, capture_output=True)
        except (subprocess.CalledProcessError, FileNotFoundError) as err:
            pytest.skip(f"tc unavailable: {err}")

    reports = run_layout([0, 0, 1], mode="confirm", timeout=120, shape=slow_host0,
                         extra_env={"RR_TEST_FLAG": str(tmp_path / "rank1-done"),
                              "RINGREDUCE_ALLREDUCE": "ring",
                              "RINGREDUCE_SEGMENT_BYTES": str(1 << 20)})
    assert reports[1]["outcome"] == "returned", reports
    assert reports[0]["outcome"] == reports[2]["outcome"], (
        f"one op, two outcomes: {reports}")


def test_choice_of_algorithm_on_several_hosts():
    from torch_ringreduce import _C
    # Multi-host with shared memory: direct while small, then hierarchical.
    assert _C._choose_allreduce(16 << 10, 4, True, "auto", 2) == "direct"
    assert _C._choose_allreduce((16 << 10) + 4, 4, True, "auto", 2) == "hierarchical"
    assert _C._choose_allreduce(64 << 20, 6, True, "auto", 3) == "hierarchical"
    # Without shared memory (or uneven hosts, which the backend passes as no
    # shared memory): the TCP choice.
    assert _C._choose_allreduce(64 << 20, 3, False, "auto", 2) == "ring"
    # A forced algorithm that cannot run falls back to auto.
    assert _C._choose_allreduce(64 << 20, 4, True, "two_step", 2) == "hierarchical"
    assert _C._choose_allreduce(64 << 20, 4, True, "hierarchical", 1) == "two_step"
    assert _C._choose_allreduce(64 << 20, 4, True, "ring", 2) == "ring"


def test_bench_hosts_runs_the_harness_on_namespace_hosts(tmp_path):
    out = tmp_path / "hosts.json"
    done = subprocess.run(
        [sys.executable, "-m", "scripts.benchmarks.bench_hosts", "--hosts", "2",
         "--per-host", "2", "--", "--ops", "allreduce", "--backends", "ringreduce",
         "ringreduce:ring", "-b", "4K", "-e", "64K", "-f", "16", "--repeats", "1",
         "--json", str(out)],
        capture_output=True, text=True, timeout=300, cwd=REPO)
    if "network namespaces unavailable" in done.stderr + done.stdout:
        pytest.skip("network namespaces unavailable")
    assert done.returncode == 0, done.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    assert {(r["backend"], r["size_bytes"]) for r in rows} == {
        (b, s) for b in ("ringreduce", "ringreduce:ring") for s in (4096, 65536)}
    assert all(r["wrong"] == 0 and not r["error"] and r["world_size"] == 4 for r in rows), rows
    assert "2 hosts x 2 ranks" in done.stdout
