"""Exit 0 when an installed torch is 2.11 or newer (used as it is), else 1."""
import os
import sys

# Judge torch alone, not the entry points of whatever is installed beside it.
os.environ["TORCH_DEVICE_BACKEND_AUTOLOAD"] = "0"
try:
    import torch
except ImportError:
    sys.exit(1)
major, minor = (int(p) for p in torch.__version__.split(".")[:2])
sys.exit(0 if (major, minor) >= (2, 11) else 1)
