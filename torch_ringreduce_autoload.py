"""Entry point of the `torch.backends` group: `import torch` calls `autoload()`.

A top-level module on purpose: importing it runs nothing of the
torch_ringreduce package, so nothing that goes wrong there (a broken build, a
partial install) can break `import torch`. We warn instead.
"""
import warnings


def autoload() -> None:
    try:
        from torch_ringreduce._registration import register

        register()
    except Exception as err:  # noqa: BLE001 - must not propagate into `import torch`
        warnings.warn(
            f"torch_ringreduce: could not register the 'ringreduce' backend "
            f"({type(err).__name__}: {err}); import torch_ringreduce to see the full error",
            RuntimeWarning,
            stacklevel=2,
        )
