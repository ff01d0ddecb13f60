"""scripts/gpu_check.sh and its summary helper, scripts/tools/_gpu_summary.py,
without a GPU: the script parses and its quick mode stops at once where there is none;
the summary reads real junit XML (of a small pytest run), a pytest -v log of a pass
stopped at its time limit, and the collective benchmark's JSON."""
import json
import os
import shutil
import subprocess
import sys
import textwrap

import pytest

from scripts.tools import _gpu_summary as gs

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "scripts", "gpu_check.sh")

VAR = "EXAMPLE_DEVICE_PATH"  # any name: the helper is told which one


def test_the_script_parses():
    subprocess.run(["bash", "-n", SCRIPT], check=True)


def _gpu_present():
    if shutil.which("nvidia-smi"):
        return True
    try:
        import torch

        return torch.cuda.is_available()
    except ImportError:
        return False


@pytest.mark.skipif(_gpu_present(), reason="a GPU is here: quick would run for minutes")
def test_quick_without_a_gpu_stops_at_once(tmp_path):
    res = subprocess.run(["bash", SCRIPT, "quick"], env=dict(os.environ, OUT=str(tmp_path)),
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 2, res.stderr
    assert "no GPU: nothing to check" in res.stderr
    assert os.listdir(tmp_path) == []


def test_quick_runs_alone(tmp_path):
    res = subprocess.run(["bash", SCRIPT, "quick", "tests"], env=dict(os.environ, OUT=str(tmp_path)),
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 64
    assert "quick runs alone" in res.stderr


FAKE_TESTS = textwrap.dedent("""
    import pytest

    def test_ok():
        pass

    def test_bad():
        assert 1 == 2, "one is not two"

    @pytest.fixture
    def broken():
        raise RuntimeError("the fixture broke")

    def test_err(broken):
        pass

    @pytest.mark.skip(reason="no GPU")
    def test_skip():
        pass

    @pytest.mark.parametrize("n", [1, 2])
    def test_param(n):
        assert n == 1
""")


@pytest.fixture(scope="module")
def junit(tmp_path_factory):
    """A real junit XML: 2 passed, 2 failed, 1 error, 1 skipped."""
    folder = tmp_path_factory.mktemp("fake_pass")
    (folder / "test_fake.py").write_text(FAKE_TESTS)
    path = folder / "junit.xml"
    subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                    "-c", os.devnull, "--rootdir", str(folder), "--junitxml", str(path),
                    str(folder / "test_fake.py")], cwd=folder, capture_output=True, timeout=120)
    assert path.exists()
    return str(path)


def _row(backend, size, time_us, busbw, wrong=0, error=None):
    return {"op": "allreduce", "backend": backend, "size_bytes": size, "count": size // 4,
            "time_us": time_us, "algbw_GBps": busbw, "busbw_GBps": busbw, "wrong": wrong,
            "error": error}


def _write(path, doc):
    path.write_text(json.dumps(doc))
    return str(path)


@pytest.fixture
def run(tmp_path, junit):
    """summarize over a quick run's inputs: the staging pass complete, the device pass
    stopped at its limit with no XML, a staging and an nccl benchmark."""
    steps = tmp_path / "steps.tsv"
    steps.write_text("env\t0\t4\t60\t\nbuild\t0\t95\t236\tMAX_JOBS=16\n"
                     "build_check\t0\t2\t60\t\ntests_staging\t0\t120\t125\t\n"
                     f"tests_device\t124\t140\t140\t{VAR}=device\n"
                     "bench_staging\t0\t30\t120\t\nbench_nccl\t2\t12\t90\t\n"
                     "bench_device\tskip\t0\t-\tdevice path not built\n")
    log = tmp_path / "tests_device.log"
    log.write_text("tests/test_a.py::test_one PASSED   [ 10%]\n"
                   "tests/test_a.py::test_two[1-x] SKIPPED (no GPU)   [ 20%]\n"
                   "tests/test_a.py::test_three FAILED   [ 30%]\n"
                   "tests/test_a.py::test_hang[4] \n\n!!!!!! KeyboardInterrupt !!!!!!\n")
    env = _write(tmp_path / "env.json", {"line": "env: GPU fake", "nccl": "2.27.7"})
    device = _write(tmp_path / "device_path.json",
                    {"var": VAR, "known": False, "line": gs.device_path_line(False, VAR)})
    staging = _write(tmp_path / "bench_staging.json", {
        "environment": {"gpu": "fake"}, "unavailable_backends": {},
        "rows": [_row("ringreduce", 4096, 35.2, 0.12), _row("gloo", 4096, 80.0, 0.05),
                 _row("ringreduce", 16384, 40.0, 0.4), _row("gloo", 16384, 90.0, 0.2),
                 _row("ringreduce", 1 << 20, 400.0, 2.62), _row("gloo", 1 << 20, 900.0, 1.17),
                 _row("ringreduce", 64 << 20, 22000.0, 3.05),
                 _row("gloo", 64 << 20, None, None, wrong=None, error="RuntimeError: boom")]})
    nccl = _write(tmp_path / "bench_nccl.json", {
        "environment": {}, "rows": [],
        "unavailable_backends": {"nccl": "rank 0: DistBackendError: Duplicate GPU detected"}})
    out = tmp_path / "out"

    def summarize(*extra):
        argv = ["summarize", "--out-dir", str(out), "--steps", str(steps), "--env", env,
                "--device-path", device, "--pass", "staging", junit, os.devnull,
                "--pass", "device", str(tmp_path / "junit_device.xml"), str(log),
                "--bench", "staging", staging, "--bench", "nccl", nccl,
                "--sizes", "4K", "1M", "64M", "256M", "--budget", "400", "--total", "398",
                *extra]
        status = gs.main(argv)
        text = (out / "summary.txt").read_text()
        with open(out / "summary.json") as f:
            return status, text, json.load(f)

    return summarize


def test_summary_counts_each_pass_and_names_the_failures(run):
    status, text, doc = run()
    assert status == 1 and not doc["ok"]
    staging, device = doc["tests"]
    assert staging["complete"]
    assert staging["counts"] == {"passed": 2, "failed": 2, "errors": 1, "skipped": 1}
    failures = {f["name"].split("::")[-1]: f for f in staging["failures"]}
    assert failures["test_bad"]["first_line"].startswith("AssertionError: one is not two")
    assert failures["test_err"]["kind"] == "ERROR"
    assert "the fixture broke" in failures["test_err"]["first_line"]
    assert failures["test_param[2]"]["first_line"] == "assert 2 == 1"
    assert "staging: 2 passed, 2 failed, 1 errors, 1 skipped of 6" in text
    assert "FAILED test_fake::test_bad: AssertionError: one is not two" in text


def test_a_pass_stopped_at_its_limit_is_counted_from_its_log(run):
    _, text, doc = run()
    device = doc["tests"][1]
    assert not device["complete"] and device["from_log"]
    assert device["counts"] == {"passed": 1, "failed": 1, "errors": 0, "skipped": 1}
    assert device["running_when_stopped"] == "tests/test_a.py::test_hang[4]"
    assert "INCOMPLETE (timed out, counted from the log)" in text
    assert "running when stopped: tests/test_a.py::test_hang[4]" in text


def test_an_unknown_device_path_is_said_so(run):
    _, text, doc = run()
    line = f"device path: not built ({VAR} unknown to this build)"
    assert doc["device_path"]["line"] == line
    assert line in text
    assert f"this pass ran the default data path with {VAR}=device set" in text


def test_the_benchmark_table(run):
    _, text, doc = run("--note", "nccl: a note from the script")
    bench = doc["bench"]
    assert bench["columns"] == ["ringreduce (staging)", "gloo"]
    assert bench["sizes"] == [4096, 1 << 20, 64 << 20]  # 16 KiB is not a row; 256 MiB not run
    assert bench["table"]["4096"]["ringreduce (staging)"]["time_us"] == 35.2
    assert len(bench["rows"]) == 8  # every measured row stays in the JSON
    table = text[text.index("benchmark:"):]
    lines = table.splitlines()
    assert "ringreduce (staging)" in lines[1] and "gloo" in lines[1]
    assert lines[2].split() == ["size", "us", "GB/s", "us", "GB/s"]
    assert lines[3].split() == ["4", "KiB", "35.2", "0.12", "80.0", "0.05"]
    assert lines[5].split() == ["64", "MiB", "22000.0", "3.05", "error", "-"]
    assert "note: nccl: a note from the script" in table
    assert "note: gloo at 64 MiB: RuntimeError: boom" in table
    assert "nccl: unavailable: rank 0: DistBackendError: Duplicate GPU detected" in table


def test_step_times_and_their_verdicts(run):
    _, text, doc = run()
    status = {s["name"]: s["status"] for s in doc["steps"]}
    assert status["build"] == "ok"
    assert status["tests_device"] == "timed out"
    assert status["bench_nccl"] == "unavailable"  # exit 2 of the nccl run: a finding
    assert status["bench_device"] == "skipped"
    assert "tests_device    140 s / 140 s  timed out" in text


def test_all_passed_is_ok(tmp_path, junit):
    # The fake pass's XML with only its passing and skipped test cases left.
    import xml.etree.ElementTree as ET

    tree = ET.parse(junit)
    for suite in tree.getroot().iter("testsuite"):
        for case in list(suite):
            if case.find("failure") is not None or case.find("error") is not None:
                suite.remove(case)
    clean = tmp_path / "junit_staging.xml"
    tree.write(clean)
    steps = tmp_path / "steps.tsv"
    steps.write_text("env\t0\t4\t60\t\nbuild\t0\t95\t236\t\ntests_staging\t0\t120\t125\t\n")
    out = tmp_path / "out"
    status = gs.main(["summarize", "--out-dir", str(out), "--steps", str(steps),
                      "--pass", "staging", str(clean), os.devnull])
    assert status == 0
    text = (out / "summary.txt").read_text()
    assert text.startswith("gpu_check quick: OK")
    assert sorted(os.listdir(out)) == ["summary.json", "summary.txt"]


def test_a_failed_build_shows_the_end_of_its_log(tmp_path):
    steps = tmp_path / "steps.tsv"
    steps.write_text("env\t0\t4\t60\t\nbuild\t1\t30\t236\t\n"
                     "tests_staging\tskip\t0\t-\tno CUDA build\n")
    build_log = tmp_path / "build.log"
    build_log.write_text("".join(f"line {i}\n" for i in range(100)) + "error: it broke\n")
    out = tmp_path / "out"
    status = gs.main(["summarize", "--out-dir", str(out), "--steps", str(steps),
                      "--build-log", str(build_log),
                      "--pass", "staging", str(tmp_path / "none.xml"), os.devnull])
    assert status == 1
    text = (out / "summary.txt").read_text()
    assert "build            30 s / 236 s  failed (exit 1)" in text
    assert "  | error: it broke" in text and "  | line 99" in text and "line 50\n" not in text
    assert "staging: no results (skipped)" in text


def test_a_pass_stopped_by_sigint_keeps_the_xml_of_the_tests_that_ended(tmp_path):
    """What gpu_check.sh's `timeout -s INT` does to a pytest pass at its limit."""
    import signal
    import time

    (tmp_path / "test_slow.py").write_text(textwrap.dedent("""
        import time
        import pytest

        def test_a():
            pass

        @pytest.mark.skip(reason="no GPU")
        def test_b():
            pass

        def test_c_hangs():
            time.sleep(120)
    """))
    junit, log = tmp_path / "junit_staging.xml", tmp_path / "tests_staging.log"
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "pytest", "-v", "-p", "no:cacheprovider",
                                 "-c", os.devnull, "--rootdir", str(tmp_path),
                                 "--junitxml", str(junit), "test_slow.py"],
                                cwd=tmp_path, stdout=out, stderr=subprocess.STDOUT)
        try:
            deadline = time.monotonic() + 60
            while "test_c_hangs" not in log.read_text() and time.monotonic() < deadline:
                time.sleep(0.1)
            proc.send_signal(signal.SIGINT)
            proc.wait(timeout=60)
        finally:
            proc.kill()
    steps = tmp_path / "steps.tsv"
    steps.write_text("tests_staging\t124\t5\t5\t\n")
    gs.main(["summarize", "--out-dir", str(tmp_path / "out"), "--steps", str(steps),
             "--pass", "staging", str(junit), str(log)])
    with open(tmp_path / "out" / "summary.json") as f:
        (result,) = json.load(f)["tests"]
    assert result["counts"] == {"passed": 1, "failed": 0, "errors": 0, "skipped": 1}
    assert not result["complete"]
    assert result["running_when_stopped"] == "test_slow.py::test_c_hangs"


def test_a_bare_assertion_message_takes_the_next_error_line():
    import xml.etree.ElementTree as ET

    failure = ET.fromstring('<failure message="AssertionError: ">'
                            "def test(): ...\nE       AssertionError: \n"
                            "E       assert 'rank 2 died' in 'timeout'\n</failure>")
    assert gs.first_error_line(failure) == "AssertionError: assert 'rank 2 died' in 'timeout'"
    failure = ET.fromstring('<failure message="ValueError: bad value&#10;more">x</failure>')
    assert gs.first_error_line(failure) == "ValueError: bad value"
