"""Exit 0 when torch_ringreduce is pip-installed from this checkout with the
`torch.backends` entry point that pyproject.toml declares, else 1 (the
Makefile then installs it). Imports neither torch nor the package."""
import os
import re
import sys
from importlib import metadata, util

here = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
with open(os.path.join(here, "pyproject.toml")) as f:
    declared = re.search(r'^ringreduce\s*=\s*"([^"]+)"', f.read(), re.M).group(1)
try:
    dist = metadata.distribution("torch_ringreduce")
except metadata.PackageNotFoundError:
    sys.exit(1)
entry = [e.value for e in dist.entry_points if e.group == "torch.backends"]
os.chdir("/")  # resolve modules the way a user's script elsewhere would
module = util.find_spec(declared.split(":")[0])
from_here = module is not None and os.path.abspath(module.origin).startswith(here)
sys.exit(0 if entry == [declared] and from_here else 1)
