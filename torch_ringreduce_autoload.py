"""Entry point of the `torch.backends` group: `import torch` calls `autoload()`.

A top-level module on purpose: importing it runs nothing of the
torch_ringreduce package, so nothing that goes wrong there (a broken build, a
partial install) can break `import torch`: torch turns any exception from an
entry point into a RuntimeError that aborts `import torch`. We warn instead.

A build for another torch version still registers the backend (creating a group
then raises the ImportError that names both versions) and warns here with the
same message, opening no shared library.
"""
import sys
import warnings


def _warn(message: str) -> None:
    # Under `-W error` a warning raises, and torch would turn that into a failed
    # `import torch`: say it on stderr instead.
    try:
        warnings.warn(message, RuntimeWarning, stacklevel=3)
    except Exception:  # noqa: BLE001
        print(f"RuntimeWarning: {message}", file=sys.stderr)


def autoload() -> None:
    try:
        from torch_ringreduce._extension import mismatch
        from torch_ringreduce._registration import register

        register()
        message = mismatch()
    except Exception as err:  # noqa: BLE001 - must not propagate into `import torch`
        _warn(f"torch_ringreduce: could not register the 'ringreduce' backend "
              f"({type(err).__name__}: {err}); import torch_ringreduce to see the full error")
        return
    if message is not None:
        _warn(f"{message} (the 'ringreduce' backend fails until then)")
