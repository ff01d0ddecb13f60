"""Every RINGREDUCE_* variable is declared once (csrc/common/env.h for the
extension, torch_ringreduce/_env.py for Python, build and scripts), the code
reads no other, and the tables of docs/user-guide/environment.md list exactly these
with their defaults."""
import os
import re
import subprocess
import sys

import pytest

from torch_ringreduce import _env

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NAME = re.compile(r"\bRINGREDUCE_[A-Z0-9_]+\b")
SCANNED = ("csrc", "torch_ringreduce", "scripts", "notebooks", "tests", ".ci")
SCANNED_FILES = ("setup.py", "Makefile", "pyproject.toml")


def _extension_variables():
    from torch_ringreduce import _C

    return _C.environment()


def _declared():
    rows = {v["name"]: v["default"] for v in _extension_variables()}
    for var in _env.PYTHON_VARIABLES + _env.BUILD_VARIABLES:
        assert var.name not in rows, f"{var.name} is declared twice"
        rows[var.name] = var.default
    return rows


def _source_files():
    for top in SCANNED:
        for dirpath, dirnames, filenames in os.walk(os.path.join(ROOT, top)):
            dirnames[:] = [d for d in dirnames if d not in ("__pycache__", ".ipynb_checkpoints")]
            for f in filenames:
                if f.endswith((".py", ".cpp", ".h", ".cu", ".sh", ".ipynb")) or f == "run":
                    yield os.path.join(dirpath, f)
    for f in SCANNED_FILES:
        yield os.path.join(ROOT, f)


ENV_PAGE = os.path.join("docs", "user-guide", "environment.md")


def _documented_tables():
    """name -> default column of every variable row in the tables of ENV_PAGE."""
    with open(os.path.join(ROOT, ENV_PAGE), encoding="utf-8") as f:
        text = f.read()
    rows = {}
    for line in text.splitlines():
        if not line.lstrip().startswith("|"):
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 3 and cells[0].startswith("`RINGREDUCE_"):
            name = cells[0].strip("`")
            assert name not in rows, f"{ENV_PAGE} lists {name} twice"
            rows[name] = cells[2]
    return rows


def test_the_code_reads_only_declared_variables():
    declared = set(_declared()) | set(_env.MACROS)
    unknown = {}
    for path in _source_files():
        with open(path, encoding="utf-8", errors="replace") as f:
            for name in set(NAME.findall(f.read())) - declared:
                unknown.setdefault(name, []).append(os.path.relpath(path, ROOT))
    assert not unknown, f"RINGREDUCE_* names not declared in env.h or _env.py: {unknown}"


def test_extension_reads_variables_only_through_declarations():
    # C++ reads a variable only as envInt/envString(kEnv...): a string literal
    # passed to them, or getenv of one of ours, bypasses the declarations.
    pattern = re.compile(r'(env(Int|String)\(\s*")|getenv\(\s*"RINGREDUCE_')
    for path in _source_files():
        if path.endswith((".cpp", ".h", ".cu")):
            with open(path, encoding="utf-8") as f:
                assert not pattern.search(f.read()), f"{path} reads a variable by literal name"


def test_documented_tables_match_the_declarations():
    declared, documented = _declared(), _documented_tables()
    assert sorted(documented) == sorted(declared), (
        f"{ENV_PAGE} only: {sorted(set(documented) - set(declared))}; "
        f"declared only: {sorted(set(declared) - set(documented))}")
    for name, default in declared.items():
        assert documented[name].strip("`") == default.strip("`"), (
            f"{name}: {ENV_PAGE} says default {documented[name]!r}, declared {default!r}")


def test_environment_reports_the_values_in_effect():
    code = ("import json, torch_ringreduce as t; "
            "print(json.dumps({r['name']: r['value'] for r in t.environment()}))")
    env = dict(os.environ, RINGREDUCE_SEGMENT_BYTES="12345", RINGREDUCE_SOCKET_IFNAME="lo",
               RINGREDUCE_SYNCBN_REFERENCE="1")
    env.pop("RINGREDUCE_SHM", None)
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         check=True).stdout
    import json

    values = json.loads(out.splitlines()[-1])
    assert values["RINGREDUCE_SEGMENT_BYTES"] == 12345
    assert values["RINGREDUCE_SOCKET_IFNAME"] == "lo"
    assert values["RINGREDUCE_SYNCBN_REFERENCE"] == 1
    assert values["RINGREDUCE_SHM"] is None


def test_a_non_integer_value_is_a_clear_error():
    env = dict(os.environ, RINGREDUCE_SEGMENT_BYTES="12k")
    res = subprocess.run([sys.executable, "-c",
                          "import torch_ringreduce as t; t.environment()"],
                         env=env, capture_output=True, text=True)
    assert res.returncode != 0
    assert "RINGREDUCE_SEGMENT_BYTES='12k' is not an integer" in res.stderr, res.stderr[-2000:]


@pytest.mark.parametrize("var", _env.PYTHON_VARIABLES + _env.BUILD_VARIABLES,
                         ids=lambda v: v.name)
def test_python_declarations_are_complete(var):
    assert var.name.startswith("RINGREDUCE_") and var.meaning and var.default is not None
