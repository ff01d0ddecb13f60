"""Build torch_ringreduce._C in place with one progress line instead of ~40
compiler command lines (what `make build` runs).

    python -m scripts.tools.build_ext [--log build/build.log] [--jobs 2]

Runs `setup.py -q build_ext --inplace` (ninja, MAX_JOBS=--jobs: build/ keeps the
objects, so a rebuild compiles only what changed) with its whole output in the
log. On a terminal ninja's "[n/N] ..." lines become one line rewritten in place,
elsewhere (CI logs) a line at each quarter. On failure the compiler's errors and
the log's end are printed and the exit status is setup.py's. `make VERBOSE=1`
runs setup.py directly instead, with everything on the terminal.
"""
import argparse
import glob
import os
import re
import shutil
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# Measured for the CPU flavour (40 files, gcc 12, torch 2.13.0+cpu, -O3) with
# MAX_JOBS=2 on a 2-core x86_64 machine shared with other work: 3 min 12 s of
# wall clock at a load of about 1.5 (about 10 s of one core per file: compiling
# against torch's headers dominates), 14 min 22 s while two training processes
# held the cores.
CORE_SECONDS_PER_FILE = 10
NINJA = re.compile(r"^\[(\d+)/(\d+)\] (.*)$")
SOURCE = re.compile(r"(?:^|\s)-c\s+(\S+\.(?:cpp|cu))(?:\s|$)")


def torch_cuda():
    """The CUDA version of the installed torch's build (None for a CPU build), read
    from torch/version.py without importing torch."""
    import importlib.util

    spec = importlib.util.find_spec("torch")
    if spec is None or not spec.submodule_search_locations:
        return None
    try:
        with open(os.path.join(spec.submodule_search_locations[0], "version.py")) as f:
            found = re.search(r"^cuda\b[^=]*=\s*'([^']+)'", f.read(), re.M)
    except OSError:
        return None
    return found.group(1) if found else None


def cuda_build():
    """setup.py's choice, approximately: RINGREDUCE_CUDA, else a CUDA torch with nvcc."""
    forced = os.environ.get("RINGREDUCE_CUDA")
    if forced is not None:
        return forced == "1"
    home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH") or "/usr/local/cuda"
    nvcc = shutil.which("nvcc") or os.path.exists(os.path.join(home, "bin", "nvcc"))
    return torch_cuda() is not None and bool(nvcc)


def sources(cuda):
    """The files setup.py compiles for the flavour."""
    found = glob.glob(os.path.join(ROOT, "csrc", "**", "*.cpp"), recursive=True)
    if cuda:
        return found + glob.glob(os.path.join(ROOT, "csrc", "**", "*.cu"), recursive=True)
    return [s for s in found if not any(f"{os.sep}{d}{os.sep}" in s for d in ("nccl", "cuda"))]


def built_before():
    return bool(glob.glob(os.path.join(ROOT, "build", "temp.*", "**", "*.o"), recursive=True))


def minutes(seconds):
    return f"{int(seconds // 60)} min {int(seconds % 60):02d} s" if seconds >= 60 else f"{seconds:.0f} s"


def estimate(files, jobs):
    """(seconds, cores used) for compiling `files` files with `jobs` compilers."""
    parallel = max(1, min(jobs, os.cpu_count() or 1, files))
    return files * CORE_SECONDS_PER_FILE / parallel, parallel


def about(seconds):
    return f"{seconds:.0f} s" if seconds < 90 else f"{seconds / 60:.0f} minutes"


def print_failure(log_path, lines):
    """The compiler's errors (ninja's FAILED lines to its "build stopped") and the
    log's last lines, or the log's end when ninja did not fail (setup.py or the link)."""
    first = next((i for i, line in enumerate(lines) if line.startswith("FAILED:")), None)
    if first is not None:
        stop = next((i for i in range(first, len(lines))
                     if lines[i].startswith("ninja: build stopped")), len(lines) - 1)
        errors = lines[first:stop + 1]
        sys.stderr.write("".join(errors[:200]) + ("[...]\n" if len(errors) > 200 else ""))
        tail = lines[max(stop + 1, len(lines) - 1):]
    else:
        tail = lines[-80:]
    sys.stderr.write("".join(tail))
    sys.stderr.write(f"build failed: the whole output is in {log_path}\n")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--log", default=os.path.join("build", "build.log"))
    parser.add_argument("--jobs", type=int, default=2, help="MAX_JOBS: compilers at once")
    args = parser.parse_args()

    cuda = cuda_build()
    total = len(sources(cuda))
    flavour = "CUDA" if cuda else "CPU"
    seconds, cores = estimate(total, args.jobs)
    if not built_before():
        print(f"build: compiling the C++ extension torch_ringreduce._C ({flavour} build): "
              f"{total} files, {args.jobs} at a time (NPROC={args.jobs}): about {about(seconds)} "
              f"on {cores} otherwise idle core{'s' if cores > 1 else ''}, longer while other "
              "work shares them. Later builds recompile only what changed.", flush=True)
    else:
        print(f"build: recompiling what changed in torch_ringreduce._C ({flavour} build; "
              f"a replaced torch recompiles all {total} files, about {about(seconds)})",
              flush=True)
    print(f"build: the compiler output goes to {args.log}; `make VERBOSE=1` shows it here",
          flush=True)

    os.makedirs(os.path.dirname(os.path.abspath(args.log)), exist_ok=True)
    env = dict(os.environ, MAX_JOBS=str(args.jobs))
    tty = sys.stdout.isatty()
    width = shutil.get_terminal_size((80, 20)).columns
    lines, warnings, quarter, shown = [], 0, 0, False
    begin = time.monotonic()
    with open(args.log, "w") as log:
        proc = subprocess.Popen([sys.executable, "setup.py", "-q", "build_ext", "--inplace"],
                                cwd=ROOT, env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, bufsize=1)
        for line in proc.stdout:
            log.write(line)
            lines.append(line)
            if "warning:" in line:
                warnings += 1
            step = NINJA.match(line)
            if not step:
                continue
            n, count = int(step.group(1)), int(step.group(2))
            source = SOURCE.search(step.group(3))
            what = os.path.relpath(source.group(1), ROOT) if source else "linking _C"
            if tty:
                text = f"[{n}/{count}] {what}  {minutes(time.monotonic() - begin)}"
                sys.stdout.write("\r" + text[:width - 1].ljust(width - 1))
                sys.stdout.flush()
                shown = True
            elif n * 4 // count > quarter or n == count:
                quarter = n * 4 // count
                print(f"[{n}/{count}] {what}  {minutes(time.monotonic() - begin)}", flush=True)
        status = proc.wait()
    if shown:
        sys.stdout.write("\n")
    elapsed = time.monotonic() - begin
    if status != 0:
        print_failure(args.log, lines)
        return status
    extra = f", {warnings} compiler warnings (see {args.log})" if warnings else ""
    print(f"build: torch_ringreduce._C built in {minutes(elapsed)}{extra}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
