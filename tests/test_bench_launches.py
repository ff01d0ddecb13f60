"""scripts/benchmarks/bench_launches.py: fresh launches of the collective benchmark
(python -m torch_ringreduce.bench), the spread over them, and the wait summary a
ringreduce table carries (what its ranks' waits did). Nothing here times anything:
the numbers are checked to exist and to be consistent with the launches' own rows."""
import json
import statistics
import subprocess
import sys

import pytest

from scripts import module_env
from scripts.benchmarks import bench_launches

BENCH = ["--nproc", "2", "--backends", "ringreduce", "gloo", "--ops", "allreduce",
         "-b", "4K", "-e", "16K", "-f", "4", "--repeats", "2", "--target-time", "0.02"]


def test_launches_and_their_spread(tmp_path):
    out = tmp_path / "launches.json"
    env = module_env(OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-m", "scripts.benchmarks.bench_launches",
                           "--launches", "2", "--json", str(out), "--", *BENCH],
                          capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert len(doc["launches"]) == 2
    # The second launch ran the backends in the other order.
    assert doc["launches"][0]["args"]["backends"] == ["ringreduce", "gloo"]
    assert doc["launches"][1]["args"]["backends"] == ["gloo", "ringreduce"]
    rows = {(r["backend"], r["size_bytes"]): r for r in doc["summary"]}
    assert set(rows) == {(b, s) for b in ("ringreduce", "gloo") for s in (4096, 16384)}
    for (backend, size), r in rows.items():
        ts = [next(x["time_us"] for x in launch["rows"]
                   if x["backend"] == backend and x["size_bytes"] == size)
              for launch in doc["launches"]]
        assert r["time_us_by_launch"] == ts
        assert r["cpu_by_launch"] == [
            next(x["cpu"] for x in launch["rows"]
                 if x["backend"] == backend and x["size_bytes"] == size)
            for launch in doc["launches"]]
        assert (r["min_us"], r["median_us"], r["max_us"]) == (min(ts), statistics.median(ts),
                                                            max(ts))
        assert r["max_over_median"] == pytest.approx(max(ts) / statistics.median(ts))
    for launch in doc["launches"]:
        waits = launch["waits"]["allreduce"]
        assert set(waits) == {"ringreduce"}, waits  # ours only
        w = waits["ringreduce"]
        assert all(isinstance(w[k], int) and w[k] >= 0
                   for k in ("spun", "yielded", "slept", "migrations")), w
        assert len(w["cpus_by_rank"]) == 2 and all(w["cpus_by_rank"]), w
    assert "ringreduce slowest launch" in proc.stdout, proc.stdout
    assert "ringreduce launches over 1.5x the row's median" in proc.stdout, proc.stdout
    assert "max/median" in proc.stdout


def test_every_other_launch_reverses_the_backends():
    argv = ["--nproc", "2", "--backends", "a", "b", "c", "--ops", "allreduce"]
    assert bench_launches.reversed_backends(argv) == ["--nproc", "2", "--backends", "c", "b",
                                                      "a", "--ops", "allreduce"]
    assert bench_launches.reversed_backends(["--nproc", "2"]) == ["--nproc", "2"]


def test_the_ring_stores_of_the_size_class_that_holds_the_row():
    """The slowest launch's line names the ring stores of the largest size class
    at or below the row's size (its messages), as the bench summed them over the ranks."""
    stores = {"modes": ["measured"], "ops": [
        {"op": "broadcast", "size_class": 65536, "plain": 3, "streaming": 4},
        {"op": "broadcast", "size_class": 262144, "plain": 5, "streaming": 0},
        {"op": "broadcast", "size_class": 1048576, "plain": 1, "streaming": 7}]}
    assert bench_launches._stores_at(stores, 524288) == (
        ", ring stores (262144 B+ messages): 5 plain / 0 streaming")
    assert bench_launches._stores_at(stores, 65536) == (
        ", ring stores (65536 B+ messages): 3 plain / 4 streaming")
    assert bench_launches._stores_at(stores, 16384) == ""  # no ring message that small
    assert bench_launches._stores_at(None, 65536) == ""    # gloo, or an older JSON


def test_slow_launches_name_the_other_backends_in_the_same_launch():
    """A launch of ours over 1.5x the row's median is listed with what every
    other backend took in that launch over its own median (shared: the
    machine's), from the summary's per-launch times."""
    def row(backend, size, ts):
        return {"op": "allreduce", "backend": backend, "size_bytes": size,
                "median_us": statistics.median(ts), "time_us_by_launch": ts}
    rows = [row("ringreduce", 4096, [10.0, 10.0, 40.0, 10.0]),
            row("mpi", 4096, [2.0, 2.0, 8.0, 2.0]),
            row("ringreduce", 65536, [20.0, 25.0, 20.0, 20.0]),  # 1.25x: not slow
            row("mpi", 65536, [30.0, 90.0, 30.0, 30.0])]
    assert bench_launches.shared_slow_launches(rows, "allreduce", "ringreduce") == [
        "4096 B launch 2 4.00x (mpi 4.00x)"]
    assert bench_launches.shared_slow_launches(rows, "allreduce", "mpi") == [
        "4096 B launch 2 4.00x (ringreduce 4.00x)", "65536 B launch 1 3.00x (ringreduce 1.25x)"]
    assert bench_launches.shared_slow_launches(rows, "broadcast", "ringreduce") == []


def test_slow_launches_say_how_their_ranks_spent_the_cpu():
    """With the rows' CPU readings (the rank that ran least in each launch's
    median repeat), a slow launch's entry shows its own beside the median
    launch's; a launch without them (an older JSON) shows none."""
    ok = {"ran": 1.0, "waited": 0.0, "off": 0.0, "threads": 0.01, "steal": 0.0}
    lost = {"ran": 0.45, "waited": 0.5, "off": 0.05, "threads": None, "steal": 0.02}
    rows = [{"op": "allreduce", "backend": "ringreduce", "size_bytes": 4096,
             "median_us": 10.0, "time_us_by_launch": [10.0, 9.0, 30.0, 11.0],
             "cpu_by_launch": [ok, ok, lost, None]}]
    assert bench_launches.shared_slow_launches(rows, "allreduce", "ringreduce") == [
        "4096 B launch 2 3.00x (CPU ran 45 / waited 50 / off 5 / threads ? / steal 2 % "
        "against ran 100 / waited 0 / off 0 / threads 1 / steal 0 % in the median launch)"]
    rows[0]["cpu_by_launch"] = [ok, ok, lost, None][::-1]
    assert bench_launches.shared_slow_launches(rows, "allreduce", "ringreduce") == [
        "4096 B launch 2 3.00x"]


def test_the_cores_probe_of_a_launch():
    """The slowest and median launch lines end with the launch's cores probe
    (round trip, plain / streaming hand-over), and with nothing for a probe that
    failed or a JSON without one."""
    probe = {"cpus": [0, 1], "round_trip_ns": 812.4, "plain_GBps": 1.24,
             "streaming_GBps": 6.51}
    assert bench_launches._cores(probe) == (
        ", cores 0-1: 812 ns round trip, 1.2 / 6.5 GB/s plain / streaming")
    assert bench_launches._cores({"cpus": [0, 1], "error": "no CPU 1"}) == ""
    assert bench_launches._cores(None) == ""


def _launch(times, floor=None, inplace=None):
    """A launch's document: all-reduce rows {(backend, size): time_us}, with
    over_floor_us and busbw_per_inplace_all where given ({backend: value})."""
    rows = []
    for (backend, size), t in times.items():
        row = {"op": "allreduce", "backend": backend, "size_bytes": size, "time_us": t}
        if floor and size == min(s for _, s in times) and backend in floor:
            row["over_floor_us"] = floor[backend]
        if inplace and size == max(s for _, s in times) and backend in inplace:
            row["busbw_per_inplace_all"] = inplace[backend]
        rows.append(row)
    return {"rows": rows}


def test_floor_and_in_place_pass_over_launches(capsys):
    """The summary carries each launch's time over the floor and busbw / in-place
    pass (None where a launch lacks it) with their min / median / max, and the
    table prints them per backend under the op's rows."""
    docs = [_launch({("ringreduce", 4096): 20.0, ("gloo", 4096): 100.0,
                     ("ringreduce", 65536): 50.0, ("gloo", 65536): 400.0},
                    floor={"ringreduce": 4.0, "gloo": 80.0},
                    inplace={"ringreduce": 0.40, "gloo": 0.05}),
            _launch({("ringreduce", 4096): 30.0, ("gloo", 4096): 110.0,
                     ("ringreduce", 65536): 60.0, ("gloo", 65536): 420.0},
                    floor={"ringreduce": -1.5, "gloo": 90.0},
                    inplace={"ringreduce": 0.30}),  # gloo's in-place ratio missing here
            _launch({("ringreduce", 4096): 25.0, ("gloo", 4096): 105.0,
                     ("ringreduce", 65536): 55.0, ("gloo", 65536): 410.0},
                    floor={"ringreduce": 9.0, "gloo": 85.0},
                    inplace={"ringreduce": 0.35, "gloo": 0.07})]
    rows = {(r["backend"], r["size_bytes"]): r for r in bench_launches.summarize(docs)}
    small, large = rows[("ringreduce", 4096)], rows[("ringreduce", 65536)]
    assert small["over_floor_us_by_launch"] == [4.0, -1.5, 9.0]
    assert (small["over_floor_us_min"], small["over_floor_us_median"],
            small["over_floor_us_max"]) == (-1.5, 4.0, 9.0)
    assert "busbw_per_inplace_all_by_launch" not in small  # not measured at that size
    assert "over_floor_us_by_launch" not in large
    assert large["busbw_per_inplace_all_by_launch"] == [0.40, 0.30, 0.35]
    gloo = rows[("gloo", 65536)]
    assert gloo["busbw_per_inplace_all_by_launch"] == [0.05, None, 0.07]
    assert (gloo["busbw_per_inplace_all_min"], gloo["busbw_per_inplace_all_median"],
            gloo["busbw_per_inplace_all_max"]) == (0.05, pytest.approx(0.06), 0.07)

    bench_launches.print_table(list(rows.values()), docs)
    out = capsys.readouterr().out
    assert ("# ringreduce over the one-rank floor (us) at 4096 B, min / median / max of "
            "3 launches: -1.5 / +4.0 / +9.0") in out
    assert ("# ringreduce busbw / in-place pass of all ranks at 65536 B, min / median / max "
            "of 3 launches: 0.30 / 0.35 / 0.40") in out
    assert ("# gloo busbw / in-place pass of all ranks at 65536 B, min / median / max of "
            "2 launches: 0.05 / 0.06 / 0.07") in out
    # Under the op's table, before ringreduce's slow launches.
    assert out.index("over the one-rank floor") < out.index("launches over 1.5x")
    assert "the cores' own exchange" not in out  # no launch probed the cores


def test_the_cores_own_exchange_over_launches(capsys):
    """Launches whose floor probed the cores (2 ranks) give a min / median / max
    line under the all-reduce table; a launch without it is left out."""
    docs = [_launch({("ringreduce", 4096): 20.0}, floor={"ringreduce": 3.0})
            for _ in range(4)]
    for doc, us in zip(docs, (1.9, 2.4, None, 1.7)):
        doc["reference"] = {"floor": {"size_bytes": 4096, "cores_exchange_us": us}}
    assert bench_launches.cores_exchange_line(docs) == (
        "# the cores' own exchange of 4096 B (two pinned threads, no library), "
        "min / median / max of 3 launches: 1.7 / 1.9 / 2.4 us")
    bench_launches.print_table(bench_launches.summarize(docs), docs)
    assert bench_launches.cores_exchange_line(docs) in capsys.readouterr().out
    assert bench_launches.cores_exchange_line([{"rows": []}, {"reference": None}]) is None


def test_the_json_names_this_scripts_command():
    """The summary's environment is the first launch's under bench_launches' own
    command line, without the launches' launcher (mpirun runs a launch, not it)."""
    docs = [{"environment": {"argv": ["-m", "torch_ringreduce.bench", "--nproc", "2"],
                             "launcher": "mpirun", "launcher_argv": None, "cpu_model": "X",
                             "date": "2030-01-02T03:04:05+00:00"}, "rows": []}]
    given = ["--launches", "2", "--json", "out.json", "--", "--nproc", "2"]
    env = bench_launches.environment(docs, given)
    assert env["argv"] == ["-m", "scripts.benchmarks.bench_launches", *given]
    assert env["launcher"] is None and env["cpu_model"] == "X"
    assert docs[0]["environment"]["argv"][1] == "torch_ringreduce.bench"  # left as it was


@pytest.mark.parametrize("mpi", [True, False])
def test_make_report_runs_the_launches(monkeypatch, mpi):
    """make_report's step "launches": 12 fresh launches of the all-reduce against Open
    MPI (only where it can run) and gloo, with the floor and the in-place pass, then 6
    of the all-reduce and broadcast against gloo with the cores busy; --quick 2 launches
    of tiny sizes each."""
    from scripts.tools import make_report
    monkeypatch.setattr(make_report, "mpi_available", lambda: mpi)
    backends = ["ringreduce", "mpi", "gloo"] if mpi else ["ringreduce", "gloo"]
    args = make_report.parse_args(["--results", "/r", "--only", "launches"])
    (step, _, idle), (step2, _, busy) = make_report.commands(args)
    assert step == step2 == "launches" and make_report.STEPS.index("launches") == 1
    at = idle.index("--")
    assert idle[1:at] == ["-m", "scripts.benchmarks.bench_launches", "--launches", "12",
                          "--json", "/r/launches_np2.json"]
    assert idle[at + 1:] == ["--nproc", "2", "--backends", *backends, "--ops", "allreduce",
                             "-b", "4K", "-e", "64M", "-f", "4", "--repeats", "5", "--memcpy",
                             "--floor"]
    at = busy.index("--")
    assert busy[1:at] == ["-m", "scripts.benchmarks.bench_launches", "--launches", "6",
                          "--json", "/r/launches_busy_np2.json"]
    assert busy[at + 1:] == ["--nproc", "2", "--backends", "ringreduce", "gloo", "--ops",
                             "allreduce", "broadcast", "-b", "4K", "-e", "64M", "-f", "4",
                             "--repeats", "3", "--busy", "cores"]
    for argv in (idle, busy):
        bench_launches.parse_args(argv[3:])  # bench_launches takes it (--json before --)
    quick = make_report.commands(make_report.parse_args(["--results", "/r", "--quick"]))
    idle, busy = [a for s, _, a in quick if s == "launches"]
    assert idle[idle.index("--launches") + 1] == busy[busy.index("--launches") + 1] == "2"
    assert idle[idle.index("--") + 1:] == [
        "--nproc", "2", "--backends", *backends, "--ops", "allreduce", "-b", "4K", "-e", "64K",
        "--repeats", "1", "--target-time", "0.01", "--memcpy", "--floor"]
    assert busy[busy.index("--") + 1:] == [
        "--nproc", "2", "--backends", "ringreduce", "gloo", "--ops", "allreduce", "broadcast",
        "-b", "4K", "-e", "64K", "--repeats", "1", "--target-time", "0.01", "--busy", "cores"]


def test_make_report_runs_many_ranks():
    """make_report's step "ranks": the all-reduce and broadcast at 8, 16 and 32 ranks
    against gloo (CPU only); --quick 8 ranks at tiny sizes."""
    from scripts.tools import make_report
    cmds = make_report.commands(make_report.parse_args(["--results", "/r", "--only", "ranks"]))
    assert [c[0] for c in cmds] == ["ranks"] * 3
    for n, (_, _, argv) in zip((8, 16, 32), cmds):
        assert argv[1:] == ["-m", "torch_ringreduce.bench", "--nproc", str(n), "--backends",
                            "ringreduce", "gloo", "--ops", "allreduce", "broadcast", "--device",
                            "cpu", "-b", "4K", "-e", "16M", "-f", "4", "--repeats", "3",
                            "--target-time", "0.1", "--json", f"/r/bench_collectives_np{n}.json"]
    quick = make_report.commands(make_report.parse_args(
        ["--results", "/r", "--only", "ranks", "--quick"]))
    assert [a[a.index("--nproc") + 1] for _, _, a in quick] == ["8"]
    cuda = make_report.parse_args(["--results", "/r", "--only", "ranks", "--device", "cuda"])
    assert make_report.commands(cuda) == []
