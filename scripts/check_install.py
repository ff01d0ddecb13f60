"""Exit 0 when torch_ringreduce is pip-installed from this checkout with its
`torch.backends` entry point, else 1 (the Makefile then installs it)."""
import os
import sys
from importlib import metadata

here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
try:
    dist = metadata.distribution("torch_ringreduce")
except metadata.PackageNotFoundError:
    sys.exit(1)
has_entry = any(e.group == "torch.backends" and e.name == "ringreduce" for e in dist.entry_points)
sys.path.insert(0, "")  # resolve the package the way a user's script would
os.chdir("/")
try:
    import importlib.util

    spec = importlib.util.find_spec("torch_ringreduce")
    same = spec is not None and os.path.dirname(spec.origin).startswith(here)
except Exception:  # noqa: BLE001
    same = False
sys.exit(0 if has_entry and same else 1)
