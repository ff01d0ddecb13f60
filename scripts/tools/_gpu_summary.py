"""The Python half of `bash scripts/gpu_check.sh quick`: the environment line, the
device-path probe, and the summary of the run.

    python -m scripts.tools._gpu_summary env --json W/env.json   # one line: GPU, torch, CUDA, nvcc
    python -m scripts.tools._gpu_summary get W/env.json nccl_multi_rank  # a field; exit 1 if false
    python -m scripts.tools._gpu_summary device-path --var NAME --json W/device_path.json
    python -m scripts.tools._gpu_summary summarize --out-dir OUT --steps W/steps.tsv \\
        --env W/env.json --device-path W/device_path.json \\
        --pass staging OUT/junit_staging.xml W/tests_staging.log \\
        --bench staging W/bench_staging.json --note "..." --sizes 4K 1M 64M 256M

`summarize` reads the steps' times (steps.tsv: name, exit status or skip/nobudget,
seconds, limit, note), the junit XML of each pytest pass (its -v log when pytest
was killed before writing it), and the JSON of each torch_ringreduce.bench run, and
writes OUT/summary.txt and OUT/summary.json (the same data) and prints the text.
Its exit status is 0 when everything that should have passed did, else 1.
No third-party imports: `env` and `device-path` import torch, `summarize` nothing.
"""
import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import xml.etree.ElementTree as ET

# torch_ringreduce.bench runs whose exit status 2 (a backend could not create a
# group, the others ran) is a finding rather than a failure.
UNAVAILABLE_OK = {"bench_nccl": "nccl could not create a group (see the notes)"}
NCCL_MULTI_RANK = (2, 30)  # first NCCL that accepts two ranks on one GPU (opt-in)
COLUMN_ORDER = ("ringreduce (staging)", "ringreduce (device)", "nccl", "gloo")
# A pytest -v line: the test's node id, then its outcome once it has one.
VERBOSE_LINE = re.compile(r"^(\S+\.py::\S+)(?: +(PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS)\b)?")


# ------------------------------------------------------------------ env

def _run(cmd):
    try:
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    return res.stdout if res.returncode == 0 else None


def _version_tuple(version):
    if isinstance(version, int):  # older torch: 2.27.7 as 22707
        return (version // 10000, version // 100 % 100, version % 100)
    return tuple(int(v) for v in version)


def gather_env():
    """What the check ran on, as a dict; `line` is the one-line form."""
    info = {"cores": os.cpu_count(), "python": sys.version.split()[0]}
    smi = _run(["nvidia-smi", "--query-gpu=name,compute_cap,memory.total,driver_version",
                "--format=csv,noheader,nounits"])
    info["gpus"] = []
    for row in (smi or "").strip().splitlines():
        parts = [p.strip() for p in row.split(",")]
        if len(parts) == 4:
            info["gpus"].append({"name": parts[0], "compute_cap": parts[1],
                                 "memory_mib": parts[2], "driver": parts[3]})
    import torch

    info["torch"] = torch.__version__
    info["torch_cuda"] = torch.version.cuda
    info["cuda_available"] = torch.cuda.is_available()
    info["nccl"] = None
    if info["cuda_available"]:
        try:
            info["nccl"] = ".".join(map(str, _version_tuple(torch.cuda.nccl.version())))
        except Exception as err:  # noqa: BLE001 - reported, not fatal
            info["nccl_error"] = f"{type(err).__name__}: {err}"
    nccl = _version_tuple(info["nccl"].split(".")) if info["nccl"] else None
    info["nccl_multi_rank"] = bool(nccl and nccl >= NCCL_MULTI_RANK)
    want = ".".join(map(str, NCCL_MULTI_RANK))
    if info["nccl_multi_rank"]:
        info["nccl_note"] = (f"NCCL {info['nccl']} >= {want}: two ranks on one GPU with "
                             "NCCL_MULTI_RANK_GPU_ENABLE=1")
    elif info["nccl"]:
        info["nccl_note"] = (f"torch's NCCL {info['nccl']} is older than {want}, the first to "
                             "take two ranks on one GPU (NCCL_MULTI_RANK_GPU_ENABLE=1): "
                             "no nccl column")
    else:
        info["nccl_note"] = ("torch reports no NCCL version"
                             + (f" ({info['nccl_error']})" if info.get("nccl_error") else "")
                             + ": no nccl column")
    try:
        from torch.utils.cpp_extension import CUDA_HOME
    except Exception:  # noqa: BLE001 - a torch without it: look on PATH only
        CUDA_HOME = None
    nvcc = shutil.which("nvcc") or (os.path.join(CUDA_HOME, "bin", "nvcc") if CUDA_HOME else None)
    out = _run([nvcc, "--version"]) if nvcc else None
    found = re.search(r"release [\d.]+, V([\d.]+)", out or "")
    info["nvcc"] = found.group(1) if found else None
    info["nvcc_path"] = nvcc
    cxx = os.environ.get("CXX") or "c++"
    first = (_run([cxx, "--version"]) or "").strip().splitlines()
    version = re.search(r"(\d+\.\d+(?:\.\d+)?)\s*$", first[0]) if first else None
    info["cxx"] = f"{cxx} {version.group(1)}" if version else cxx
    info["cxx_version"] = first[0] if first else None
    info["line"] = env_line(info)
    return info


def env_line(info):
    gpus = "; ".join(f"{g['name']} (sm_{g['compute_cap'].replace('.', '')}, "
                     f"{g['memory_mib']} MiB, driver {g['driver']})" for g in info["gpus"])
    return (f"env: GPU {gpus or 'none found by nvidia-smi'} | torch {info['torch']}, "
            f"CUDA {info['torch_cuda']}, NCCL {info['nccl']} | nvcc {info['nvcc']} | "
            f"CXX {info['cxx']} | {info['cores']} cores | python {info['python']}")


def report(result, args):
    """Prints result["line"] and writes the result as JSON to --json when given."""
    print(result["line"], flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


def cmd_env(args):
    info = gather_env()
    report(info, args)
    return 0 if info["cuda_available"] else 1


def cmd_get(args):
    with open(args.file) as f:
        value = json.load(f).get(args.key)
    print(value)
    return 0 if value else 1


# ---------------------------------------------------------- device path

def device_path_line(known, var):
    if known:
        return f"device path: built ({var} declared by this build)"
    return f"device path: not built ({var} unknown to this build)"


def cmd_device_path(args):
    """Whether this build declares the variable (torch_ringreduce.environment():
    the extension's registry, csrc/common/env.h, and the Python one, _env.py)."""
    result = {"var": args.var, "known": False, "read_by": None, "error": None}
    try:  # run as `python -m scripts.tools._gpu_summary` from the root: the package in place
        import torch_ringreduce

        rows = {row["name"]: row for row in torch_ringreduce.environment()}
        if args.var in rows:
            result.update(known=True, read_by=rows[args.var].get("read_by"))
    except Exception as err:  # noqa: BLE001 - reported in the summary
        result["error"] = f"{type(err).__name__}: {err}"
    result["line"] = device_path_line(result["known"], args.var)
    if result["error"]:
        result["line"] += f"; the registry could not be read: {result['error']}"
    report(result, args)
    return 0 if result["known"] else 1


# ------------------------------------------------------------- summary

def read_steps(path):
    steps = []
    if not path or not os.path.exists(path):
        return steps
    with open(path) as f:
        for line in f:
            parts = line.rstrip("\n").split("\t")
            if len(parts) < 4:
                continue
            name, rc, seconds, limit = parts[:4]
            note = parts[4] if len(parts) > 4 else ""
            step = {"name": name, "rc": int(rc) if rc.lstrip("-").isdigit() else None,
                    "seconds": int(seconds), "limit_s": int(limit) if limit.isdigit() else None,
                    "note": note}
            if rc == "skip":
                step["status"] = "skipped"
            elif rc == "nobudget":
                step["status"] = "skipped: no time left"
            elif step["rc"] == 0:
                step["status"] = "ok"
            elif step["rc"] in (124, 137):
                step["status"] = "timed out"
            elif step["rc"] == 2 and name in UNAVAILABLE_OK:
                step["status"] = "unavailable"
                step["note"] = step["note"] or UNAVAILABLE_OK[name]
            else:
                step["status"] = f"failed (exit {step['rc']})"
            steps.append(step)
    return steps


def step_ok(step):
    return step["status"] in ("ok", "skipped", "unavailable")


def first_error_line(element):
    """The first line that says what went wrong: the message's, else pytest's first
    `E` line; a bare "AssertionError:" takes the next line that adds something."""
    text = element.text or ""
    lines = [line.strip() for line in (element.get("message") or "").splitlines()]
    lines += [line[1:].strip() for line in text.splitlines() if line.startswith("E ")]
    lines = [line for line in lines if line]
    if not lines:
        return (text.strip().splitlines() or [""])[0][:300]
    first = lines[0]
    if first.endswith(":"):
        extra = next((line for line in lines[1:] if line.rstrip(": ") != first.rstrip(": ")), "")
        first = f"{first} {extra}".strip()
    return first[:300]


def parse_junit(path):
    """Counts, failures with their first error line, and the slowest tests of one XML."""
    root = ET.parse(path).getroot()
    counts = {"passed": 0, "failed": 0, "errors": 0, "skipped": 0}
    failures, times, passed = [], [], []
    for case in root.iter("testcase"):
        if not case.get("name"):  # the test pytest was stopped in: a nameless entry
            continue
        name = f"{case.get('classname', '')}::{case.get('name', '')}".lstrip(":")
        seconds = float(case.get("time") or 0)
        times.append((seconds, name))
        failure, error = case.find("failure"), case.find("error")
        if failure is not None:
            counts["failed"] += 1
            failures.append({"name": name, "kind": "FAILED", "first_line": first_error_line(failure)})
        elif error is not None:
            counts["errors"] += 1
            failures.append({"name": name, "kind": "ERROR", "first_line": first_error_line(error)})
        elif case.find("skipped") is not None:
            counts["skipped"] += 1
        else:
            counts["passed"] += 1
            passed.append(name)
        # A test that failed and then errored in teardown: the error too.
        if failure is not None and error is not None:
            failures.append({"name": name, "kind": "ERROR",
                             "first_line": first_error_line(error)})
    suite_time = sum(float(s.get("time") or 0) for s in
                     ([root] if root.tag == "testsuite" else root.iter("testsuite")))
    times.sort(reverse=True)
    return {"counts": counts, "total": sum(counts.values()), "time_s": round(suite_time, 1),
            "failures": failures, "passed_names": passed,
            "slowest": [{"name": n, "seconds": round(s, 1)} for s, n in times[:3] if s >= 0.05]}


def parse_verbose_log(path):
    """From a pytest -v log: outcome counts and the test that was running when it
    stopped (a node id printed with no outcome after it), for a pass with no XML."""
    counts = {"passed": 0, "failed": 0, "errors": 0, "skipped": 0}
    key = {"PASSED": "passed", "XPASS": "passed", "FAILED": "failed", "ERROR": "errors",
           "SKIPPED": "skipped", "XFAIL": "skipped"}
    running = None
    if path and os.path.exists(path):
        with open(path, errors="replace") as f:
            for line in f:
                match = VERBOSE_LINE.match(line)
                if not match:
                    continue
                if match.group(2):
                    counts[key[match.group(2)]] += 1
                    running = None
                else:
                    running = match.group(1)
    return counts, running


def junit_name(nodeid):
    """tests/test_x.py::Cls::test[a] -> tests.test_x.Cls::test[a], as parse_junit names it."""
    parts = nodeid.split("::")
    module = parts[0][:-3] if parts[0].endswith(".py") else parts[0]
    return ".".join([module.replace("/", ".")] + parts[1:-1]) + "::" + parts[-1]


def summarize_pass(label, junit, log, step):
    result = {"label": label, "junit": os.path.basename(junit) if junit else None,
              "step": step["status"] if step else "not run", "complete": False,
              "counts": None, "total": None, "time_s": None, "failures": [], "slowest": [],
              "running_when_stopped": None}
    if junit and os.path.exists(junit):
        try:
            result.update(parse_junit(junit))
            result["complete"] = True
        except ET.ParseError as err:
            result["junit_error"] = f"unreadable junit XML: {err}"
    if step and step["status"] == "timed out":
        result["complete"] = False
        _, running = parse_verbose_log(log)
        result["running_when_stopped"] = running
        # pytest's XML lists the test it was stopped in as if it had passed
        if running and result["counts"] and junit_name(running) in result["passed_names"]:
            result["counts"]["passed"] -= 1
            result["total"] -= 1
    result.pop("passed_names", None)
    if result["counts"] is None and step and step["status"] not in ("skipped", "not run") \
            and not step["status"].startswith("skipped"):
        counts, running = parse_verbose_log(log)
        result.update(counts=counts, total=sum(counts.values()), running_when_stopped=running,
                      from_log=True)
    return result


def pass_ok(result):
    counts = result["counts"]
    return bool(result["complete"] and counts and counts["failed"] == 0 and counts["errors"] == 0
                and counts["passed"])  # all skipped on a GPU machine: something is off


def column_of(backend, label):
    return f"ringreduce ({label})" if backend == "ringreduce" else backend


def read_benches(benches, sizes):
    """{size: {column: cell}}, the columns in order, notes, rows and environment."""
    table, columns, notes, rows, environment = {}, [], [], [], None
    for label, path in benches:
        if not os.path.exists(path):
            notes.append(f"bench {label}: no results ({os.path.basename(path)} was not written)")
            continue
        with open(path) as f:
            doc = json.load(f)
        environment = environment or doc.get("environment")
        for backend, why in (doc.get("unavailable_backends") or {}).items():
            notes.append(f"{column_of(backend, label)}: unavailable: {why}")
        for row in doc.get("rows", []):
            if row.get("op") != "allreduce":
                continue
            column = column_of(row["backend"], label)
            if column not in columns:
                columns.append(column)
            rows.append(dict(row, column=column))
            if sizes and row["size_bytes"] not in sizes:
                continue
            table.setdefault(row["size_bytes"], {})[column] = {
                k: row.get(k) for k in ("time_us", "busbw_GBps", "algbw_GBps", "wrong", "error")}
            if row.get("wrong"):
                notes.append(f"{column} at {human_size(row['size_bytes'])}: "
                             f"{row['wrong']} wrong elements")
            if row.get("error"):
                notes.append(f"{column} at {human_size(row['size_bytes'])}: {row['error']}")
    rank = {c: i for i, c in enumerate(COLUMN_ORDER)}
    columns.sort(key=lambda c: rank.get(c, len(rank)))
    return table, columns, notes, rows, environment


def bench_ok(rows):
    return not any(r.get("wrong") or r.get("error") for r in rows)


def human_size(n):
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale and n % scale == 0:
            return f"{n // scale} {unit}"
    return f"{n} B"


def parse_size(text):
    match = re.fullmatch(r"(\d+)([KMG]?)", text.strip().upper())
    if not match:
        raise argparse.ArgumentTypeError(f"bad size {text!r}: e.g. 4K, 1M, 64M")
    return int(match.group(1)) << {"": 0, "K": 10, "M": 20, "G": 30}[match.group(2)]


def bench_table(bench):
    """Lines of the table: a row per size, two columns (us, GB/s) per backend."""
    def cell(size, column):
        c = bench["table"][size].get(column)
        if c is None:
            return ["-", "-"]
        if c.get("error"):
            return ["error", "-"]
        return [f"{c['time_us']:.1f}", f"{c['busbw_GBps']:.2f}" + (" WRONG" if c.get("wrong") else "")]

    rows = [[human_size(size)] + [v for column in bench["columns"] for v in cell(size, column)]
            for size in bench["sizes"]]
    units = ["size"] + ["us", "GB/s"] * len(bench["columns"])
    widths = [max(len(r[i]) for r in rows + [units]) for i in range(len(units))]
    for j, column in enumerate(bench["columns"]):  # each backend's name spans its two columns
        pair = widths[1 + 2 * j] + 2 + widths[2 + 2 * j]
        if len(column) > pair:
            widths[1 + 2 * j] += len(column) - pair
    names = " " * widths[0] + "".join(
        "    " + column.rjust(widths[1 + 2 * j] + 2 + widths[2 + 2 * j])
        for j, column in enumerate(bench["columns"]))
    lines = ["  " + names]
    for row in [units] + rows:
        text = row[0].ljust(widths[0])
        for i in range(1, len(row)):
            text += ("    " if i % 2 else "  ") + row[i].rjust(widths[i])
        lines.append("  " + text)
    return lines


def render(summary):
    head = f"gpu_check quick: {'OK' if summary['ok'] else 'FAILED'}"
    if summary["total_s"] is not None:
        head += f" in {summary['total_s']} s"
    if summary["budget_s"] is not None:
        head += f" (budget {summary['budget_s']} s)"
    out = [head]
    if summary.get("env_line"):
        out.append(summary["env_line"])
    if summary.get("device_path"):
        out.append(summary["device_path"]["line"])
    else:
        out.append("device path: not checked (no CUDA build)")
    out.append("")
    out.append("steps (wall s / limit s):")
    for step in summary["steps"]:
        limit = f"{step['limit_s']} s" if step["limit_s"] is not None else "-"
        note = f"  ({step['note']})" if step["note"] else ""
        out.append(f"  {step['name']:<14} {step['seconds']:>4} s / {limit:<6} {step['status']}{note}")
    if summary.get("build_log_tail"):
        out.append("")
        out.append("build log, last lines:")
        out += [f"  | {line}" for line in summary["build_log_tail"]]
    if summary["tests"]:
        out.append("")
        out.append("tests (-m cuda):")
    for result in summary["tests"]:
        head = f"  {result['label']}: "
        if result["counts"] is None:
            out.append(head + f"no results ({result['step']})")
            continue
        c = result["counts"]
        took = f" in {result['time_s']} s" if result["time_s"] is not None else ""
        state = "" if result["complete"] else " INCOMPLETE (" + result["step"] + \
            (", counted from the log" if result.get("from_log") else "") + ")"
        out.append(head + f"{c['passed']} passed, {c['failed']} failed, {c['errors']} errors, "
                   f"{c['skipped']} skipped of {result['total']}{took}{state}")
        if result.get("note"):
            out.append(f"    note: {result['note']}")
        if not c["passed"] and result["complete"]:
            out.append("    nothing passed: every test was skipped or failed")
        if result["running_when_stopped"]:
            out.append(f"    running when stopped: {result['running_when_stopped']}")
        for failure in result["failures"][:20]:
            out.append(f"    {failure['kind']} {failure['name']}: {failure['first_line']}")
        if len(result["failures"]) > 20:
            out.append(f"    ... and {len(result['failures']) - 20} more (see {result['junit']})")
        if result["slowest"]:
            out.append("    slowest: " + ", ".join(f"{s['name'].rsplit('::', 1)[-1]} "
                                                   f"{s['seconds']} s" for s in result["slowest"]))
    bench = summary["bench"]
    if bench["columns"] or bench["notes"]:
        out.append("")
        out.append("benchmark: all-reduce, float32, 2 ranks sharing one GPU; "
                   "time per call and bus bandwidth")
    if bench["columns"]:
        out += bench_table(bench)
    for note in bench["notes"]:
        out.append(f"  note: {note}")
    out.append("")
    out.append(f"files: {', '.join(summary['files'])}")
    return "\n".join(out) + "\n"


def build_log_tail(steps, path, lines=25):
    build = next((s for s in steps if s["name"] in ("build", "build_check")
                  and s["status"] not in ("ok", "skipped")), None)
    if build is None or not path or not os.path.exists(path):
        return []
    with open(path, errors="replace") as f:
        return [line.rstrip("\n") for line in f.readlines()[-lines:]]


def cmd_summarize(args):
    steps = read_steps(args.steps)
    by_name = {s["name"]: s for s in steps}
    env = None
    if args.env and os.path.exists(args.env):
        with open(args.env) as f:
            env = json.load(f)
    device = None
    if args.device_path and os.path.exists(args.device_path):
        with open(args.device_path) as f:
            device = json.load(f)
    tests = []
    for label, junit, log in args.passes or []:
        result = summarize_pass(label, junit, log, by_name.get(f"tests_{label}"))
        if label == "device" and device is not None and not device["known"]:
            result["note"] = (f"{device['line']}: this pass ran the default data path "
                              f"with {device['var']}=device set")
        tests.append(result)
    sizes = args.sizes or []
    table, columns, notes, rows, environment = read_benches(args.bench or [], sizes)
    notes = list(args.note or []) + notes
    shown = [s for s in sizes if s in table] if sizes else sorted(table)
    ok = (bool(steps) and all(step_ok(s) for s in steps)
          and all(pass_ok(t) or t["step"] == "skipped" for t in tests) and bench_ok(rows))
    ours = {"gpu_check.log", "summary.txt", "summary.json"}
    if args.build_log:
        ours.add(os.path.basename(args.build_log))
    ours |= {os.path.basename(junit) for _, junit, _ in args.passes or []}
    summary = {
        "mode": "quick", "ok": ok, "budget_s": args.budget, "total_s": args.total,
        "env": env, "env_line": env.get("line") if env else None,
        "device_path": device, "steps": steps,
        "build_log_tail": build_log_tail(steps, args.build_log),
        "tests": tests,
        "bench": {"sizes": shown, "columns": columns, "notes": notes,
                  "table": {s: table[s] for s in shown}, "rows": rows,
                  "environment": environment},
    }
    os.makedirs(args.out_dir, exist_ok=True)
    # This run's files in the folder (another mode's results may share it).
    summary["files"] = sorted(n for n in set(os.listdir(args.out_dir)) | {"summary.txt", "summary.json"}
                              if n in ours)
    text = render(summary)
    with open(os.path.join(args.out_dir, "summary.txt"), "w") as f:
        f.write(text)
    with open(os.path.join(args.out_dir, "summary.json"), "w") as f:
        json.dump(summary, f, indent=1, default=str)
    sys.stdout.write(text)
    return 0 if ok else 1


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="\n".join(__doc__.splitlines()[1:]))
    sub = p.add_subparsers(dest="command", required=True)
    e = sub.add_parser("env", help="print the environment in one line")
    e.add_argument("--json", help="also write it here, with the NCCL verdict")
    g = sub.add_parser("get", help="print a field of a JSON file; exit 1 when it is false")
    g.add_argument("file")
    g.add_argument("key")
    d = sub.add_parser("device-path", help="whether this build declares the variable")
    d.add_argument("--var", required=True, help="the device data path's variable")
    d.add_argument("--json")
    s = sub.add_parser("summarize", help="write summary.txt and summary.json")
    s.add_argument("--out-dir", required=True)
    s.add_argument("--steps", help="steps.tsv: name, rc|skip|nobudget, seconds, limit, note")
    s.add_argument("--env", help="the JSON of `env --json`")
    s.add_argument("--device-path", help="the JSON of `device-path --json`")
    s.add_argument("--pass", dest="passes", nargs=3, action="append",
                   metavar=("LABEL", "JUNIT", "LOG"), help="a pytest pass (step tests_LABEL)")
    s.add_argument("--bench", nargs=2, action="append", metavar=("LABEL", "JSON"),
                   help="a torch_ringreduce.bench result; its ringreduce column is named by LABEL")
    s.add_argument("--sizes", nargs="+", type=parse_size, help="the sizes of the table")
    s.add_argument("--note", action="append", help="a line under the benchmark table")
    s.add_argument("--build-log", help="its last lines go in the summary when the build failed")
    s.add_argument("--budget", type=int, default=None, help="seconds the run was given")
    s.add_argument("--total", type=int, default=None, help="seconds the run took")
    args = p.parse_args(argv)
    return {"env": cmd_env, "get": cmd_get, "device-path": cmd_device_path,
            "summarize": cmd_summarize}[args.command](args)


if __name__ == "__main__":
    sys.exit(main())
