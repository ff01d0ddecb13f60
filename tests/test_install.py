"""Installing: the build records its torch, a build for another torch fails clearly
(without breaking `import torch`), and the documented install commands work.

The fast tests run a copy of the package's Python files (on PYTHONPATH, in a
subprocess) with a doctored torch_ringreduce/_build_info.py or a stand-in _C.
The fresh-venv test compiles twice (an editable install, then a wheel) and took
17-25 minutes on a busy 2-core machine, so it is opt-in:

    RR_INSTALL_TEST=1 python -m pytest -q -s tests/test_install.py

It runs, as written and in a copy of the checkout, the first bash block of the
README's "## Install" section (a venv, torch, the editable install; so
`pip install torch==2.13.0` runs as the README says: from PyPI, or from
wherever pip is configured to look), then the wheel block of
docs/user-guide/install.md, and runs a 2-process all_reduce on ringreduce in
both venvs.
"""
import glob
import importlib.machinery
import importlib.metadata
import os
import re
import shutil
import subprocess
import sys
import textwrap
import time

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGE = os.path.join(ROOT, "torch_ringreduce")
REBUILD = "rebuild with `pip install --no-build-isolation -e .`"
OTHER_TORCH = "1.0.0+other"
SUBPROCESS_TIMEOUT_S = 120
INSTALL_ENV = "RR_INSTALL_TEST"


def _has_entry_point():
    eps = importlib.metadata.entry_points(group="torch.backends")
    return any(ep.name == "ringreduce" for ep in eps)


def _package_copy(root, built_against=None, extension="real"):
    """The package's Python files (and the entry point module) under `root`.

    built_against: the torch version _build_info.py records (None: no record).
    extension: "real" links this checkout's built _C (to show it is not opened),
    "undefined" compiles a stand-in _C needing a symbol nobody defines, None: none.
    """
    pkg = os.path.join(root, "torch_ringreduce")
    os.makedirs(pkg)
    for path in glob.glob(os.path.join(PACKAGE, "*.py")):
        if os.path.basename(path) != "_build_info.py":
            shutil.copy(path, pkg)
    shutil.copy(os.path.join(ROOT, "torch_ringreduce_autoload.py"), root)
    if built_against is not None:
        with open(os.path.join(pkg, "_build_info.py"), "w") as f:
            f.write(f"TORCH_VERSION = {built_against!r}\nTORCH_CUDA = None\nWITH_CUDA = False\n")
    so_name = "_C" + importlib.machinery.EXTENSION_SUFFIXES[0]
    if extension == "real":
        built = glob.glob(os.path.join(PACKAGE, "_C.*.so"))
        if not built:
            pytest.skip("torch_ringreduce._C is not built here (make build)")
        os.symlink(built[0], os.path.join(pkg, so_name))
    elif extension == "undefined":
        cc = shutil.which("cc") or shutil.which("gcc")
        if cc is None:
            pytest.skip("no C compiler to make a stand-in extension")
        src = os.path.join(root, "stand_in.c")
        with open(src, "w") as f:
            f.write("extern void *rr_symbol_from_another_torch(void);\n"
                    "void *PyInit__C(void) { return rr_symbol_from_another_torch(); }\n")
        subprocess.run([cc, "-shared", "-fPIC", "-o", os.path.join(pkg, so_name), src],
                       check=True, timeout=SUBPROCESS_TIMEOUT_S)
    return root


def _python(code, root, *flags, autoload=False):
    """Runs `code` in a fresh interpreter that imports the copy under `root`."""
    env = dict(os.environ, PYTHONPATH=str(root),
               TORCH_DEVICE_BACKEND_AUTOLOAD="1" if autoload else "0")
    # An editable install's finder would still find the checkout's _C for a copy
    # that has none: leave it out.
    prelude = textwrap.dedent(f"""
        import sys
        sys.meta_path[:] = [f for f in sys.meta_path
                            if not getattr(f, "__module__", "").startswith("__editable__")]
        import torch_ringreduce as _rr
        assert _rr.__file__.startswith({str(root)!r}), _rr.__file__
    """) if not autoload else ""
    return subprocess.run([sys.executable, *flags, "-c", prelude + textwrap.dedent(code)],
                          capture_output=True, text=True, cwd=str(root), env=env,
                          timeout=SUBPROCESS_TIMEOUT_S)


def _mismatch_message():
    return (f"torch_ringreduce was built against torch {OTHER_TORCH} but torch "
            f"{torch.__version__} is installed; {REBUILD}")


def test_this_build_records_the_running_torch():
    from torch_ringreduce import _extension

    built = _extension.built_against()
    assert built is not None, ("torch_ringreduce/_build_info.py is missing: the build "
                               "predates it; " + REBUILD + " (or make build)")
    assert built == str(torch.__version__)
    assert _extension.mismatch() is None
    import torch_ringreduce
    from torch_ringreduce import _build_info

    assert bool(_build_info.WITH_CUDA) == bool(getattr(torch_ringreduce._C, "with_cuda", False))


def test_build_for_another_torch_is_refused_before_loading(tmp_path):
    root = _package_copy(tmp_path, built_against=OTHER_TORCH, extension="real")
    proc = _python("""
        import sys
        import torch, torch.distributed as dist
        import torch_ringreduce
        for attempt in ("attribute", "from-import", "group"):
            try:
                if attempt == "attribute":
                    torch_ringreduce._C
                elif attempt == "from-import":
                    from torch_ringreduce import _C  # noqa: F401
                else:
                    dist.init_process_group("ringreduce", store=dist.HashStore(),
                                            rank=0, world_size=1)
                print(attempt, "| no error")
            except ImportError as err:
                print(attempt, "|", type(err).__name__, "|", err)
        print("opened |", "torch_ringreduce._C" in sys.modules)
        print("reference |", torch_ringreduce.reference.__name__)
    """, root)
    assert proc.returncode == 0, proc.stderr
    lines = dict(line.split(" | ", 1) for line in proc.stdout.splitlines())
    for attempt in ("attribute", "from-import", "group"):
        assert lines[attempt] == f"ImportError | {_mismatch_message()}", proc.stdout
    assert lines["opened"] == "False", "the build for another torch was opened"
    assert lines["reference"] == "torch_ringreduce.reference"  # pure Python still imports


@pytest.mark.parametrize("flags", [(), ("-W", "error")], ids=["default", "warnings-as-errors"])
def test_import_torch_survives_a_build_for_another_torch(tmp_path, flags):
    # `import torch` runs our entry point; torch turns an exception there into a
    # failed `import torch`. A mismatched build must warn with the message instead.
    root = _package_copy(tmp_path, built_against=OTHER_TORCH, extension="real")
    if _has_entry_point():
        code = "import torch"
    else:  # not installed: call the entry point as torch would
        code = "import torch; import torch_ringreduce_autoload as a; a.autoload()"
    proc = _python(f"""
        import sys, warnings
        if not sys.warnoptions:
            warnings.simplefilter("always")
        {code}
        import torch.distributed as dist
        assert sys.modules["torch_ringreduce"].__file__.startswith({str(root)!r})
        print("imported", torch.__version__, "RINGREDUCE" in dist.Backend._plugins,
              "torch_ringreduce._C" in sys.modules)
    """, root, *flags, autoload=_has_entry_point())
    assert proc.returncode == 0, f"import torch failed:\n{proc.stderr}"
    assert proc.stdout.split() == ["imported", str(torch.__version__), "True", "False"], \
        proc.stdout + proc.stderr
    assert _mismatch_message() in proc.stderr
    assert "RuntimeWarning" in proc.stderr
    assert proc.stderr.count(_mismatch_message()) == 1, proc.stderr


@pytest.mark.parametrize("recorded", ["running", "none"])
def test_undefined_symbol_becomes_a_clear_import_error(tmp_path, recorded):
    built_against = str(torch.__version__) if recorded == "running" else None
    root = _package_copy(tmp_path, built_against=built_against, extension="undefined")
    proc = _python("""
        import torch_ringreduce
        try:
            torch_ringreduce._C
        except ImportError as err:
            print(type(err).__name__, "|", err)
            print("cause |", type(err.__cause__).__name__)
    """, root)
    assert proc.returncode == 0, proc.stderr
    lines = dict(line.split(" | ", 1) for line in proc.stdout.splitlines())
    message = lines["ImportError"]
    assert "undefined symbol: rr_symbol_from_another_torch" in message
    assert f"torch {torch.__version__}" in message
    assert message.endswith(REBUILD)
    if recorded == "running":
        assert f"built against torch {torch.__version__}, the installed version" in message
    else:
        assert "the build recorded no version" in message
    assert lines["cause"] == "ImportError"


def test_missing_extension_is_left_as_it_is(tmp_path):
    # No _C at all (never built) is not a version problem: the usual error.
    root = _package_copy(tmp_path, built_against=None, extension=None)
    proc = _python("""
        import torch_ringreduce
        try:
            torch_ringreduce._C
        except ImportError as err:
            print(type(err).__name__, "|", err)
    """, root)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == \
        "ModuleNotFoundError | No module named 'torch_ringreduce._C'", proc.stdout


# ------------------------------------------------------------------ fresh venvs

INSTALL_HEADING = "## Install"
ALL_REDUCE_CHECK = """\
import sys
import torch
import torch.distributed as dist

# Registered by `import torch`, through the entry point the install added.
assert "RINGREDUCE" in dist.Backend._plugins and "torch_ringreduce._C" not in sys.modules
dist.init_process_group("ringreduce")
rank, world = dist.get_rank(), dist.get_world_size()
t = torch.arange(1000, dtype=torch.float64) * (rank + 1)
dist.all_reduce(t)
# sum over ranks of i * (r + 1) = i * world * (world + 1) / 2
assert torch.equal(t, torch.arange(1000, dtype=torch.float64) * world * (world + 1) / 2), t
import torch_ringreduce
from torch_ringreduce import _extension
assert _extension.built_against() == torch.__version__, _extension.built_against()
# Both ranks write to one stdout: a line of its own.
print(f"\\nRR_ALLREDUCE_OK rank={rank} world={world} from={torch_ringreduce.__file__}\\n", flush=True)
dist.destroy_process_group()
"""


INSTALL_PAGE = os.path.join(ROOT, "docs", "user-guide", "install.md")
WHEEL_HEADING = "## A wheel for other environments"


def section_bash_blocks(path, heading):
    """The ```bash blocks of the section of `path` under `heading`, in order."""
    with open(path, encoding="utf-8") as f:
        text = f.read()
    start = text.index("\n" + heading + "\n")
    end = text.find("\n## ", start + 1)
    section = text[start:end if end != -1 else len(text)]
    return re.findall(r"^```bash\n(.*?)^```", section, re.S | re.M)


def install_blocks(readme_path=os.path.join(ROOT, "README.md"), install_page=INSTALL_PAGE):
    """What a reader runs, in order: the README's install commands (the first bash
    block of its "## Install" section), then the wheel block of the install page."""
    readme = section_bash_blocks(readme_path, INSTALL_HEADING)
    wheel = section_bash_blocks(install_page, WHEEL_HEADING)
    assert readme, f"README.md has no bash block under {INSTALL_HEADING!r}"
    assert len(wheel) == 1, f"expected one bash block under {WHEEL_HEADING!r}: {wheel}"
    return [readme[0], wheel[0]]


def test_install_commands_are_where_the_docs_say():
    install, wheel = install_blocks()
    for command in ("python -m venv", "pip install torch==", "pip install --no-build-isolation -e ."):
        assert command in install, f"README's install block lacks {command!r}"
    for command in ("python -m build --wheel --no-isolation", "python -m venv .venv-wheel",
                    "pip install torch==", "pip install dist/*.whl"):
        assert command in wheel, f"the install page's wheel block lacks {command!r}"
    # The wheel needs the torch the build used.
    pinned = re.findall(r"torch==(\S+)", install + wheel)
    assert len(set(pinned)) == 1, f"the blocks pin different torch versions: {pinned}"


def _copy_checkout(dest):
    """The checkout's files, without what builds and venvs left in it."""
    ignore = shutil.ignore_patterns("build", "dist", "*.egg-info", "*.so", "_build_info.py",
                                    ".venv*", "__pycache__", ".git", "results", "data",
                                    ".pytest_cache", ".build-stamp", "notebooks")
    shutil.copytree(ROOT, dest, ignore=ignore, symlinks=True)
    return dest


def _run_blocks(blocks, cwd):
    """Runs the blocks one after another in one shell, as a reader would; the
    trace of each command with the time it started."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME", "TORCH_DEVICE_BACKEND_AUTOLOAD")}
    # `python` is this interpreter, as it would be for the person reading the docs.
    env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", "")
    script = "PS4='+ [$SECONDS s] '\n" + "\n".join(blocks)  # bash as root ignores PS4 from env
    proc = subprocess.run(["bash", "-e", "-x", "-c", script], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=3000)
    trace = "\n".join(line for line in proc.stderr.splitlines() if line.startswith("+ ["))
    assert proc.returncode == 0, f"the documented install commands failed:\n{script}\n--- output\n" \
        f"{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}"
    return trace


def _all_reduce_in(venv, workdir):
    script = os.path.join(workdir, "check_all_reduce.py")
    with open(script, "w") as f:
        f.write(ALL_REDUCE_CHECK)
    python = os.path.join(venv, "bin", "python")
    proc = subprocess.run([python, "-m", "torch.distributed.run", "--standalone",
                           "--nproc_per_node", "2", script], cwd=workdir,
                          capture_output=True, text=True, timeout=300,
                          env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"})
    output = f"{proc.stdout}\n{proc.stderr[-6000:]}"
    assert proc.returncode == 0, output
    found = re.findall(r"RR_ALLREDUCE_OK rank=(\d) world=2 from=(\S+?\.py)", proc.stdout)
    assert sorted(rank for rank, _ in found) == ["0", "1"], output
    return [where for _, where in found]


@pytest.mark.slow
@pytest.mark.skipif(os.environ.get(INSTALL_ENV) != "1",
                    reason=f"compiles twice in fresh venvs (about 20 min): set {INSTALL_ENV}=1")
def test_documented_install_in_fresh_venvs(tmp_path):
    blocks = install_blocks()
    checkout = _copy_checkout(str(tmp_path / "torch_ringreduce"))
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    started = time.monotonic()
    trace = ""
    try:
        # A fresh venv, what to install first, the editable install; then the wheel,
        # installed into another venv with the same torch.
        trace = _run_blocks(blocks, checkout)
        where = _all_reduce_in(os.path.join(checkout, ".venv"), str(outside))
        assert all(w.startswith(checkout) for w in where), where  # the editable one
        wheels = glob.glob(os.path.join(checkout, "dist", "*.whl"))
        assert len(wheels) == 1, wheels
        names = subprocess.run([sys.executable, "-m", "zipfile", "-l", wheels[0]],
                               capture_output=True, text=True, check=True).stdout
        for member in ("torch_ringreduce/_build_info.py", "torch_ringreduce/_extension.py",
                       "torch_ringreduce/bench/__main__.py", "torch_ringreduce_autoload.py",
                       "entry_points.txt"):
            assert member in names, f"{member} is not in the wheel:\n{names}"
        assert len(re.findall(r"torch_ringreduce/_C\.\S+\.so", names)) == 1, names
        other = os.path.join(checkout, ".venv-wheel")
        assert os.path.isdir(other), "the wheel block's venv is expected at .venv-wheel"
        where = _all_reduce_in(other, str(outside))
        assert all("site-packages" in w for w in where), where
        # The collective benchmark comes with the wheel: runs outside the checkout.
        wheel_python = os.path.join(other, "bin", "python")
        bench = subprocess.run([wheel_python, "-m", "torch_ringreduce.bench", "--nproc", "2",
                                "--ops", "allreduce", "-b", "4K", "-e", "4K", "--repeats", "1",
                                "--json", ""], cwd=str(outside),
                               capture_output=True, text=True, timeout=300,
                               env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"})
        assert bench.returncode == 0, f"{bench.stdout}\n{bench.stderr[-4000:]}"
        assert "# allreduce:" in bench.stdout and "wrong elements: 0" in bench.stdout, bench.stdout
    finally:
        print(f"\nfresh-venv install test: {time.monotonic() - started:.0f} s\n{trace}")
    shutil.rmtree(checkout, ignore_errors=True)  # two venvs of torch: 2 GB
