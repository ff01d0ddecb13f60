"""The CUDA kernels compile with nvcc alone, even on a machine that cannot run
them (CI has nvcc but no GPU); the device routing compiles in CUDA mode."""
import concurrent.futures
import glob
import os
import shutil
import subprocess
import sysconfig

import pytest
import torch.utils.cpp_extension as cpp_ext

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NVCC = shutil.which("nvcc") or (
    os.path.join(cpp_ext.CUDA_HOME, "bin", "nvcc") if cpp_ext.CUDA_HOME else None)


CU_SOURCES = sorted(os.path.relpath(p, os.path.join(REPO, "csrc"))
                    for p in glob.glob(os.path.join(REPO, "csrc", "**", "*.cu"), recursive=True))


def test_cu_sources_are_found():
    assert "kernels/cuda/sync_bn_kernels.cu" in CU_SOURCES, CU_SOURCES


@pytest.mark.skipif(not NVCC or not os.path.exists(NVCC), reason="nvcc not installed")
@pytest.mark.parametrize("source", CU_SOURCES)
def test_cu_sources_compile_with_nvcc(tmp_path, source):
    src = os.path.join(REPO, "csrc", source)
    out = tmp_path / "kernel.o"
    proc = subprocess.run([NVCC, "-std=c++17", "-O1", "-I", os.path.join(REPO, "csrc"), "-c", src,
                           "-o", str(out)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert out.stat().st_size > 0


def test_device_routing_compiles_in_cuda_mode():
    cxx = shutil.which("c++") or shutil.which("g++")
    if cxx is None:
        pytest.skip("no C++ compiler")
    includes = [os.path.join(REPO, "csrc"), sysconfig.get_paths()["include"]]
    includes += cpp_ext.include_paths()
    cmd = [cxx, "-std=c++20", "-fsyntax-only", "-DRINGREDUCE_WITH_CUDA"]
    cmd += [f"-I{p}" for p in includes]
    cmd.append(os.path.join(REPO, "csrc", "kernels", "sync_bn.cpp"))
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]


def _cuda_include():
    """The CUDA toolkit's include folder, or None (nvcc may be a wrapper script)."""
    homes = [os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), cpp_ext.CUDA_HOME,
             "/usr/local/cuda"]
    if NVCC and os.path.exists(NVCC):
        homes.append(os.path.dirname(os.path.dirname(os.path.realpath(NVCC))))
    for home in filter(None, homes):
        include = os.path.join(home, "include")
        if os.path.exists(os.path.join(include, "cuda_runtime.h")):
            return include
    return None


def _cuda_mode_sources():
    """Every C++ source the CUDA flavour compiles differently: those under a cuda/
    or nccl/ folder and those that test RINGREDUCE_WITH_CUDA, or include a header
    that does (new CUDA code is checked without editing this list)."""
    root = os.path.join(REPO, "csrc")
    texts = {}
    for folder, _, files in os.walk(root):
        for name in files:
            if name.endswith((".cpp", ".h")):
                path = os.path.join(folder, name)
                with open(path) as f:
                    texts[os.path.relpath(path, root)] = f.read()
    flagged = {rel for rel, text in texts.items()
               if "RINGREDUCE_WITH_CUDA" in text or "/cuda/" in f"/{rel}" or "/nccl/" in f"/{rel}"}
    headers = {rel for rel in flagged if rel.endswith(".h")}
    return sorted(rel for rel, text in texts.items() if rel.endswith(".cpp") and (
        rel in flagged or any(f'#include "{h}"' in text for h in headers)))


def test_cuda_mode_sources_are_found():
    found = _cuda_mode_sources()
    assert "backend/device_stage.cpp" in found and "kernels/cuda/sync_bn_cuda.cpp" in found, found


@pytest.fixture(scope="module")
def cuda_flavour_compiles(tmp_path_factory):
    """{source: (returncode, stderr)} of every CUDA-mode source checked for syntax and
    types, the compilers run side by side on every core (one at a time, they took
    half of this file's time). A CPU-only torch wheel lacks the one header CMake
    generates for c10_cuda, so it writes it (it only says c10_cuda is a shared library)."""
    cxx = shutil.which("c++") or shutil.which("g++")
    if cxx is None:
        pytest.skip("no C++ compiler")
    tmp_path = tmp_path_factory.mktemp("cuda_flavour")
    stub = tmp_path / "c10" / "cuda" / "impl"
    stub.mkdir(parents=True)
    (stub / "cuda_cmake_macros.h").write_text("#pragma once\n#define C10_CUDA_BUILD_SHARED_LIBS\n")
    includes = [os.path.join(REPO, "csrc"), sysconfig.get_paths()["include"]]
    includes += cpp_ext.include_paths() + [str(tmp_path), _cuda_include()]
    base = [cxx, "-std=c++20", "-fsyntax-only", "-DRINGREDUCE_WITH_CUDA"]
    base += [f"-I{p}" for p in includes]

    def check(source):
        proc = subprocess.run(base + [os.path.join(REPO, "csrc", *source.split("/"))],
                              capture_output=True, text=True, timeout=600)
        return source, (proc.returncode, proc.stderr)

    with concurrent.futures.ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        return dict(pool.map(check, _cuda_mode_sources()))


@pytest.mark.skipif(_cuda_include() is None, reason="no CUDA toolkit headers")
@pytest.mark.parametrize("source", _cuda_mode_sources())
def test_cuda_flavour_sources_compile(cuda_flavour_compiles, source):
    """The ATen side of the CUDA build (device guard, streams, launch checks) and the
    fused op, checked for syntax and types in CUDA mode."""
    returncode, stderr = cuda_flavour_compiles[source]
    assert returncode == 0, stderr[-4000:]
