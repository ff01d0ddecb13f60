"""The one place that loads torch_ringreduce._C, after checking that it was built
against the torch that is running.

An extension compiled against another torch either fails to load with an
undefined-symbol traceback or, worse, loads and misbehaves: torch has no stable
C++ ABI between versions. setup.py records the torch it compiled against in
torch_ringreduce/_build_info.py (generated, not in git); `load()` compares that with
`torch.__version__` before the shared library is opened, and turns a link error
while opening it into the same kind of clear ImportError.

Kept free of the compiled extension, like _registration: the `torch.backends`
entry point calls `mismatch()` during `import torch`.
"""
import importlib
import sys

EXTENSION = "torch_ringreduce._C"
BUILD_INFO = "torch_ringreduce._build_info"
REBUILD = "rebuild with `pip install --no-build-isolation -e .`"
# What the dynamic loader says when a library needs symbols or libraries the
# running torch does not provide.
_LINK_ERRORS = ("undefined symbol", "cannot open shared object file", "symbol lookup error")


def built_against():
    """The `torch.__version__` that _C was compiled against, or None when no build
    recorded one (no build yet, or one made before the record existed)."""
    try:
        info = importlib.import_module(BUILD_INFO)
    except ImportError:
        return None
    version = getattr(info, "TORCH_VERSION", None)
    return str(version) if version else None


def running():
    import torch

    return str(torch.__version__)


def mismatch():
    """The error message when _C was built against another torch than the running
    one, else None. Cheap: opens no shared library."""
    built, now = built_against(), running()
    if built is None or built == now:
        return None
    return f"torch_ringreduce was built against torch {built} but torch {now} is installed; {REBUILD}"


def load():
    """torch_ringreduce._C, loaded once; ImportError naming both torch versions when
    it was built against another torch."""
    loaded = sys.modules.get(EXTENSION)
    if loaded is not None:
        return loaded
    message = mismatch()
    if message is not None:
        raise ImportError(message, name=EXTENSION)
    try:
        return importlib.import_module(EXTENSION)
    except (ImportError, OSError) as err:
        if not any(marker in str(err) for marker in _LINK_ERRORS):
            raise
        built, now = built_against(), running()
        if built is None:
            cause = (f"was built against another torch than the installed torch {now} "
                     f"(the build recorded no version)")
        elif built == now:
            cause = (f"was built against torch {built}, the installed version, but not this "
                     f"build of it (torch {now} was reinstalled or replaced since)")
        else:  # unreachable unless the record changed since mismatch() read it
            cause = f"was built against torch {built} but torch {now} is installed"
        raise ImportError(f"torch_ringreduce {cause}: its compiled extension does not load "
                          f"({err}); {REBUILD}", name=EXTENSION) from err
