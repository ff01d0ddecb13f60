"""How many CPUs a host's ranks may use, for the wait policy's "do the ranks
fit the cores" rule (spinning, streaming ring stores): the union of the ranks'
affinity masks, capped by the cgroup CPU quota (csrc/transport/cpu_budget.h).

The oracles: Python's os.sched_getaffinity on every rank, and cgroup files
written here with known quotas.
"""
import os

import pytest
import torch
import torch.distributed as dist

from _harness import backend_under_test

pytestmark = pytest.mark.skipif(backend_under_test() != "ringreduce",
                                reason="tests ringreduce's own wait policy")


def _C():
    from torch_ringreduce import _C
    return _C


@pytest.mark.parametrize("text,want", [
    ("0", "0"),
    ("0-3", "0-3"),
    ("3,1,2,0", "0-3"),
    ("0-3,8,10-11", "0-3,8,10-11"),
    ("0-1,1-2,7", "0-2,7"),
    ("", ""),
    ("1,x,3", "1"),      # stops at the first malformed item
    ("2-1,5", ""),       # a range that runs backwards is malformed
    ("4-", ""),
])
def test_cpu_list_round_trip(text, want):
    assert _C()._cpu_list(text) == want


def _tree(tmp_path, proc_lines, files):
    """A fake /proc/self/cgroup and cgroup mount: {relative path: content}."""
    proc = tmp_path / "cgroup"
    proc.write_text("".join(line + "\n" for line in proc_lines))
    root = tmp_path / "mnt"
    for rel, content in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(content + "\n")
    return str(proc), str(root)


@pytest.mark.parametrize("proc_lines,files,want", [
    # cgroup v2: the quota of the process's cgroup, rounded up
    (["0::/job"], {"job/cpu.max": "200000 100000"}, 2),
    (["0::/job"], {"job/cpu.max": "150000 100000"}, 2),
    (["0::/job"], {"job/cpu.max": "50000 100000"}, 1),
    (["0::/job"], {"job/cpu.max": "max 100000"}, 0),
    # an ancestor's lower quota caps it; a missing file is no quota
    (["0::/a/b"], {"a/b/cpu.max": "800000 100000", "a/cpu.max": "300000 100000"}, 3),
    (["0::/a/b"], {"cpu.max": "400000 100000"}, 4),
    (["0::/"], {"cpu.max": "max 100000"}, 0),
    (["0::/"], {}, 0),
    # cgroup v1: the cpu controller's quota and period, in its own mount
    (["4:memory:/x", "1:cpu,cpuacct:/job"],
     {"cpu,cpuacct/job/cpu.cfs_quota_us": "250000",
      "cpu,cpuacct/job/cpu.cfs_period_us": "100000"}, 3),
    (["1:cpu:/"], {"cpu/cpu.cfs_quota_us": "-1", "cpu/cpu.cfs_period_us": "100000"}, 0),
    # a path the mount does not show (a container without a cgroup namespace):
    # the mount's root still caps it
    (["1:cpu:/docker/abc"], {"cpu/cpu.cfs_quota_us": "100000",
                             "cpu/cpu.cfs_period_us": "100000"}, 1),
    # unreadable or malformed: no quota
    (["garbage"], {}, 0),
    (["0::/job"], {"job/cpu.max": "lots 100000"}, 0),
])
def test_cgroup_quota(tmp_path, proc_lines, files, want):
    proc, root = _tree(tmp_path, proc_lines, files)
    assert _C()._cgroup_cpu_limit(proc, root) == want


def _policy_with_affinity(ctx, pins):
    """A new ringreduce group created while each rank's thread runs on
    pins[rank] (None: as it is); its wait policy and the ranks' masks."""
    rank = ctx.rank
    saved = os.sched_getaffinity(0)
    try:
        if pins[rank] is not None:
            os.sched_setaffinity(0, pins[rank])
        masks = [None] * ctx.world_size
        dist.all_gather_object(masks, sorted(os.sched_getaffinity(0)), group=ctx.oracle)
        group = dist.new_group(backend="ringreduce")
    finally:
        os.sched_setaffinity(0, saved)
    policy = group._get_backend(torch.device("cpu")).wait_policy()
    dist.destroy_process_group(group)
    return {"policy": policy, "masks": masks, "quota": _C()._cgroup_cpu_limit(),
            "spin_env": "RINGREDUCE_SPIN_US" in os.environ}


def _check_policy(results, world_size):
    for rank, res in enumerate(results):
        policy, quota = res["policy"], res["quota"]
        union = set().union(*map(set, res["masks"]))
        want = min(len(union), quota) if quota > 0 else len(union)
        want = min(want, os.cpu_count())
        assert policy["usable_cpus"] == want, (rank, res)
        assert policy["local_ranks"] == world_size, (rank, res)
        assert policy["ranks_fit_cpus"] == (world_size <= want), (rank, res)
        if not res["spin_env"]:
            assert (policy["spin_us"] > 0) == policy["ranks_fit_cpus"], (rank, res)


def test_ranks_pinned_to_one_cpu_do_not_fit(worlds):
    """Two ranks pinned to the same CPU: one usable CPU, no spinning."""
    cpu = min(os.sched_getaffinity(0))
    results = worlds.run(2, _policy_with_affinity, [{cpu}, {cpu}])
    _check_policy(results, 2)
    assert [r["policy"]["usable_cpus"] for r in results] == [1, 1]


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two CPUs")
def test_ranks_pinned_one_per_cpu_fit(worlds):
    """mpirun-style binding (one CPU per rank): the union counts, they fit."""
    first, second = sorted(os.sched_getaffinity(0))[:2]
    results = worlds.run(2, _policy_with_affinity, [{first}, {second}])
    _check_policy(results, 2)
    assert [r["policy"]["ranks_fit_cpus"] for r in results] == [True, True]


def test_unpinned_ranks_count_their_masks(worlds):
    results = worlds.run(2, _policy_with_affinity, [None, None])
    _check_policy(results, 2)


def _cpu_cgroup_dirs():
    """(mount, this process's cgroup dir) of the cpu controller, v1 or v2, or None."""
    for line in open("/proc/self/cgroup").read().splitlines():
        _, controllers, path = line.split(":", 2)
        if controllers == "" and os.path.exists("/sys/fs/cgroup/cgroup.controllers"):
            if "cpu" in open("/sys/fs/cgroup/cgroup.controllers").read().split():
                return "v2", "/sys/fs/cgroup", "/sys/fs/cgroup" + path.rstrip("/")
        if "cpu" in controllers.split(","):
            mount = "/sys/fs/cgroup/" + controllers
            if not os.path.isdir(mount):
                mount = "/sys/fs/cgroup/cpu"
            return "v1", mount, mount + path.rstrip("/")
    return None


@pytest.fixture
def one_cpu_cgroup():
    """A cgroup whose CPU quota is one CPU (made and removed here); skipped where
    this process may not make one."""
    found = _cpu_cgroup_dirs()
    if found is None:
        pytest.skip("no cpu cgroup controller")
    version, mount, _ = found
    path = os.path.join(mount, f"ringreduce-test-{os.getpid()}")
    try:
        os.mkdir(path)
        if version == "v2":
            with open(os.path.join(path, "cpu.max"), "w") as f:
                f.write("100000 100000")
        else:
            with open(os.path.join(path, "cpu.cfs_quota_us"), "w") as f:
                f.write("100000")
    except OSError as err:
        if os.path.isdir(path):
            os.rmdir(path)
        pytest.skip(f"cannot make a cgroup with a CPU quota here: {err}")
    yield path
    os.rmdir(path)  # fails (and says so) if a worker was left in it


def _policy_in_cgroup(ctx, path):
    """A new ringreduce group created while this rank runs in the cgroup at
    `path`; then the rank goes back where it was."""
    home = _cpu_cgroup_dirs()[2]
    try:
        with open(os.path.join(path, "cgroup.procs"), "w") as f:
            f.write(str(os.getpid()))
    except OSError as err:
        return {"skip": f"cannot move a rank into the cgroup: {err}"}
    try:
        quota = _C()._cgroup_cpu_limit()
        group = dist.new_group(backend="ringreduce")
    finally:
        with open(os.path.join(home, "cgroup.procs"), "w") as f:
            f.write(str(os.getpid()))
    policy = group._get_backend(torch.device("cpu")).wait_policy()
    dist.destroy_process_group(group)
    return {"policy": policy, "quota": quota}


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two CPUs")
def test_cgroup_quota_caps_the_cpus(worlds, one_cpu_cgroup):
    """Two ranks that could run on two CPUs, in a cgroup granted one: they do not
    fit, so they neither spin nor stream."""
    results = worlds.run(2, _policy_in_cgroup, one_cpu_cgroup)
    if any("skip" in res for res in results):
        pytest.skip(next(res["skip"] for res in results if "skip" in res))
    for rank, res in enumerate(results):
        assert res["quota"] == 1, (rank, res)
        assert res["policy"]["usable_cpus"] == 1, (rank, res)
        assert res["policy"]["ranks_fit_cpus"] is False, (rank, res)
