"""Execute the report notebooks headless, top to bottom, against a results folder.

    python -m scripts.tools.run_notebooks          # notebooks/*.ipynb on results/, in place
    python -m scripts.tools.run_notebooks --results /tmp/r --output-dir /tmp/out
    python -m scripts.tools.run_notebooks notebooks/training_report.ipynb --results /tmp/r

The notebooks read $RINGREDUCE_RESULTS (set here from --results) and run with
their own folder as the working directory. Executed notebooks (with outputs)
are written in place, or to --output-dir. Needs nbformat, nbclient, ipykernel
and matplotlib. Exit status: 0 all ran, 1 a notebook raised, 2 missing packages.
"""
import argparse
import glob
import os
import re
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
NEEDED = ("nbformat", "nbclient", "ipykernel", "matplotlib")
RESULTS_ENV = "RINGREDUCE_RESULTS"


def missing_packages():
    import importlib.util

    return [name for name in NEEDED if importlib.util.find_spec(name) is None]


def figures(nb):
    """How many images the executed notebook shows."""
    return sum(1 for cell in nb.cells if cell.cell_type == "code"
               for out in cell.get("outputs", []) if "image/png" in out.get("data", {}))


def _short(text, lines=25):
    """The end of a cell's traceback, without terminal colours."""
    text = re.sub(r"\x1b\[[0-9;]*m", "", text).rstrip().splitlines()
    return "\n".join(text[-lines:])


def execute(path, output, timeout, kernel):
    """Run one notebook; (ok, message)."""
    import nbformat
    from nbclient import NotebookClient
    from nbclient.exceptions import CellExecutionError

    nb = nbformat.read(path, as_version=4)
    client = NotebookClient(nb, timeout=timeout, kernel_name=kernel,
                            resources={"metadata": {"path": os.path.dirname(path)}})
    begin = time.perf_counter()
    try:
        client.execute()
        ok, message = True, f"{figures(nb)} figures"
    except CellExecutionError as err:
        ok, message = False, _short(str(err))
    if output:
        os.makedirs(os.path.dirname(output) or ".", exist_ok=True)
        nbformat.write(nb, output)  # with the outputs up to the failing cell
    return ok, f"{time.perf_counter() - begin:.1f} s, {message}"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("notebooks", nargs="*",
                   help="notebooks to run (default: every notebooks/*.ipynb)")
    p.add_argument("--results", default=os.path.join(ROOT, "results"),
                   help="folder of JSON results the notebooks read (default results/)")
    p.add_argument("--output-dir", default="",
                   help="write executed notebooks here (default: in place)")
    p.add_argument("--timeout", type=int, default=600, help="seconds per cell")
    p.add_argument("--kernel", default="python3")
    return p.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    missing = missing_packages()
    if missing:
        print(f"run_notebooks: missing {', '.join(missing)}: "
              f"pip install {' '.join(NEEDED)}", file=sys.stderr)
        return 2
    notebooks = args.notebooks or sorted(glob.glob(os.path.join(ROOT, "notebooks", "*.ipynb")))
    if not notebooks:
        print("run_notebooks: no notebooks found", file=sys.stderr)
        return 1
    os.environ[RESULTS_ENV] = os.path.abspath(args.results)
    # The kernel's inline backend renders figures as PNG outputs; a MPLBACKEND such
    # as agg would silently drop them.
    os.environ.pop("MPLBACKEND", None)
    failed = 0
    for path in notebooks:
        path = os.path.abspath(path)
        output = os.path.join(args.output_dir, os.path.basename(path)) if args.output_dir \
            else path
        ok, message = execute(path, output, args.timeout, args.kernel)
        failed += not ok
        print(f"{'ok    ' if ok else 'FAILED'} {os.path.relpath(path, ROOT)} ({message})",
              flush=True)
    print(f"run_notebooks: {len(notebooks) - failed}/{len(notebooks)} notebooks ran against "
          f"{os.environ[RESULTS_ENV]}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
