"""Registration of the "ringreduce" backend: import, entry point, autoload, device strings."""
import importlib
import importlib.metadata
import os
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.distributed as dist

SUBPROCESS_TIMEOUT_S = 120


def _python(code, **kwargs):
    """Runs `code` in a fresh interpreter; the CompletedProcess."""
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                          text=True, timeout=SUBPROCESS_TIMEOUT_S, **kwargs)


def _entry_point():
    eps = importlib.metadata.entry_points(group="torch.backends")
    return next((ep for ep in eps if ep.name == "ringreduce"), None)


def test_import_and_register_are_idempotent():
    import torch_ringreduce

    plugin = dist.Backend._plugins["RINGREDUCE"]
    listed = list(dist.Backend.backend_list)
    assert "ringreduce" in listed
    assert torch_ringreduce.register() is True
    assert torch_ringreduce.register() is True
    importlib.reload(torch_ringreduce)  # runs the module's register() again
    import torch_ringreduce as again  # noqa: F401 - a second import is a no-op

    assert dist.Backend._plugins["RINGREDUCE"] is plugin
    assert list(dist.Backend.backend_list) == listed
    assert list(dist.Backend.backend_list).count("ringreduce") == 1
    assert dist.Backend.RINGREDUCE == "ringreduce"


def test_registered_for_cpu_and_cuda():
    import torch_ringreduce  # noqa: F401

    devices = dist.Backend.default_device_backend_map
    assert devices.get("cpu") != "ringreduce", "must not take over cpu for every group"
    assert dist.Backend._plugins["RINGREDUCE"].creator_fn is not None
    assert dist.Backend.backend_capability["ringreduce"] == ["cpu", "cuda"]


def test_import_torch_registers_through_the_entry_point():
    if _entry_point() is None:
        pytest.skip("no `torch.backends` entry point named ringreduce is installed "
                    "(install the package: pip install --no-build-isolation --no-deps -e .)")
    proc = _python("""
        import sys
        import torch, torch.distributed as dist
        print('RINGREDUCE' in dist.Backend._plugins)
        print('torch_ringreduce._C' in sys.modules)
    """)
    assert proc.returncode == 0, proc.stderr
    registered, loaded_ext = proc.stdout.split()
    assert registered == "True", f"import torch did not register ringreduce:\n{proc.stderr}"
    assert loaded_ext == "False", "autoload must not load the compiled extension"
    assert "could not register" not in proc.stderr, proc.stderr


def test_failing_autoload_only_warns():
    proc = _python("""
        import warnings
        import torch_ringreduce._registration as registration
        import torch_ringreduce_autoload as _autoload

        def broken():
            raise OSError("simulated failure")

        registration.register = broken
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            _autoload.autoload()  # must not raise
        for w in caught:
            print(w.category.__name__, "|", w.message)
    """)
    assert proc.returncode == 0, f"autoload raised:\n{proc.stderr}"
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RuntimeWarning")]
    assert len(lines) == 1, f"expected one RuntimeWarning, got:\n{proc.stdout}{proc.stderr}"
    assert "could not register the 'ringreduce' backend" in lines[0]
    assert "OSError: simulated failure" in lines[0]


def _device_string_group(ctx):
    import torch_ringreduce

    pg = dist.group.WORLD
    backend = pg._get_backend(torch.device("cpu"))
    t = torch.arange(5, dtype=torch.float32)
    dist.all_reduce(t)
    return {
        "get_backend": str(dist.get_backend()),
        "backend_type": type(backend).__name__,
        "is_ring": isinstance(backend, torch_ringreduce._C.Backend),
        "result": t.tolist(),
    }


def test_device_string_backend_cpu_ringreduce(fresh_world):
    world = fresh_world(1, backend="cpu:ringreduce", pg_timeout_s=30)
    (out,) = world.run(_device_string_group, timeout=60)
    assert out["is_ring"], f"cpu backend is {out['backend_type']}, not torch_ringreduce._C.Backend"
    assert out["result"] == [0.0, 1.0, 2.0, 3.0, 4.0]
    assert "ringreduce" in out["get_backend"], out["get_backend"]


def test_broken_package_does_not_break_import_torch():
    # A broken install (here: a _registration module without its functions, so
    # the package's own import raises) must not break `import torch`, which
    # runs our entry point: it warns instead.
    if _entry_point() is None:
        pytest.skip("torch.backends entry point not installed (pip install -e .)")
    proc = _python("""
        import sys, types, warnings
        warnings.simplefilter("always")
        sys.modules["torch_ringreduce._registration"] = types.ModuleType("broken")
        import torch
        print("imported", torch.__version__)
    """)
    assert proc.returncode == 0, proc.stderr
    assert "imported" in proc.stdout
    assert "could not register the 'ringreduce' backend" in proc.stderr
    assert "ImportError" in proc.stderr
