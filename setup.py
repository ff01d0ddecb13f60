"""Build torch_ringreduce._C against the installed torch.

CPU build (CppExtension) when torch has no CUDA; CUDA build (CUDAExtension,
RINGREDUCE_WITH_CUDA defined, NCCL linked once csrc/transport/nccl/ exists) when
it has and nvcc is found. Force either with RINGREDUCE_CUDA=0/1. Build with `pip install --no-build-isolation -e .` so
the torch you run is the torch you built against. The build records that torch in
torch_ringreduce/_build_info.py; the package refuses to load _C under another one.
"""
import glob
import os

# Building must not depend on the entry point of an earlier install (which
# `import torch` would run): a stale one would break the build itself.
os.environ.setdefault("TORCH_DEVICE_BACKEND_AUTOLOAD", "0")

from setuptools import setup  # noqa: E402

try:
    import torch  # noqa: E402
except ImportError as err:  # pip's build isolation hides the installed torch
    raise SystemExit(
        f"torch_ringreduce: torch is needed to build ({err}). The extension is compiled "
        "against the torch you run it with: install that torch first, then "
        "build without pip's build isolation, which would hide it: "
        "pip install --no-build-isolation -e ."
    ) from None
from torch.utils.cpp_extension import (  # noqa: E402
    CUDA_HOME,
    BuildExtension,
    CppExtension,
    CUDAExtension,
)

HERE = os.path.dirname(os.path.abspath(__file__))


def want_cuda() -> bool:
    forced = os.environ.get("RINGREDUCE_CUDA")
    if forced is not None:
        return forced == "1"
    return torch.version.cuda is not None and CUDA_HOME is not None


def sources(cuda: bool) -> list:
    found = sorted(glob.glob(os.path.join("csrc", "**", "*.cpp"), recursive=True))
    if cuda:
        found += sorted(glob.glob(os.path.join("csrc", "**", "*.cu"), recursive=True))
    else:  # the CPU build leaves out everything that needs CUDA headers
        cuda_only = (os.sep + "nccl" + os.sep, os.sep + "cuda" + os.sep)
        found = [s for s in found if not any(part in s for part in cuda_only)]
    return found


def nccl_dirs():
    """Include and library folders holding nccl.h / libnccl: $NCCL_HOME, PyPI's
    nvidia-nccl wheel (what CUDA builds of torch ship), then CUDA_HOME."""
    roots = [os.environ.get("NCCL_HOME")]
    try:
        import nvidia.nccl

        roots += list(nvidia.nccl.__path__)
    except ImportError:
        pass
    roots.append(CUDA_HOME)
    for root in filter(None, roots):
        include = os.path.join(root, "include")
        if os.path.exists(os.path.join(include, "nccl.h")):
            libs = [os.path.join(root, d) for d in ("lib", "lib64")]
            return [include], [d for d in libs if os.path.isdir(d)]
    raise RuntimeError(
        "torch_ringreduce: CUDA build requested but nccl.h was not found; set NCCL_HOME "
        "or install nvidia-nccl-cu13 (or build the CPU flavour with RINGREDUCE_CUDA=0)"
    )


def nccl_library(library_dirs):
    """"nccl", or ":libnccl.so.2" where only the versioned library exists (PyPI's
    nvidia-nccl wheels ship no libnccl.so link)."""
    if any(os.path.exists(os.path.join(d, "libnccl.so")) for d in library_dirs):
        return "nccl"
    return ":libnccl.so.2"


# The torch the extension is compiled against, for torch_ringreduce/_extension.py
# to compare with the running one before it opens _C (generated, not in git).
BUILD_INFO = os.path.join("torch_ringreduce", "_build_info.py")


def build_info(cuda: bool) -> str:
    return (
        '"""Written by setup.py when it built torch_ringreduce._C: the torch it was compiled\n'
        'against. torch_ringreduce/_extension.py compares it with the running torch."""\n'
        f"TORCH_VERSION = {str(torch.__version__)!r}\n"
        f"TORCH_CUDA = {torch.version.cuda!r}\n"
        f"WITH_CUDA = {cuda!r}\n"
    )


class BuildExt(BuildExtension.with_options(use_ninja=True)):
    """Builds _C, then writes _build_info.py beside it: into the source tree for an
    in-place or editable build, into build_lib (so into the wheel) otherwise."""

    def run(self):
        super().run()
        inplace = self.inplace or getattr(self, "editable_mode", False)
        target = os.path.join(HERE if inplace else self.build_lib, BUILD_INFO)
        os.makedirs(os.path.dirname(target), exist_ok=True)
        with open(target, "w") as f:
            f.write(build_info(want_cuda()))


def extension():
    cuda = want_cuda()
    # The language standard comes from torch (C++20 for 2.13).
    # -fno-math-errno: nothing reads errno, and it lets sqrt loops vectorise.
    cxx = ["-O3", "-Wall", "-Wno-unused-parameter", "-fno-math-errno"]
    kwargs = dict(
        name="torch_ringreduce._C",
        sources=sources(cuda),
        include_dirs=[os.path.join(HERE, "csrc")],
        extra_compile_args={"cxx": cxx},
        # setuptools skips an extension newer than its sources: a reinstalled torch
        # must count as a change too.
        depends=[os.path.join(os.path.dirname(torch.__file__), "version.py")],
    )
    if cuda:
        kwargs["extra_compile_args"]["cxx"].append("-DRINGREDUCE_WITH_CUDA")
        kwargs["extra_compile_args"]["nvcc"] = ["-O3", "-DRINGREDUCE_WITH_CUDA"]
        if any(os.sep + "nccl" + os.sep in src for src in kwargs["sources"]):
            include_dirs, library_dirs = nccl_dirs()
            kwargs["include_dirs"] += include_dirs
            kwargs["library_dirs"] = library_dirs
            kwargs["runtime_library_dirs"] = library_dirs
            kwargs["libraries"] = [nccl_library(library_dirs)]
        return CUDAExtension(**kwargs)
    return CppExtension(**kwargs)


# RINGREDUCE_METADATA_ONLY=1: install the package and its entry point without
# compiling (the Makefile builds the extension in place first, incrementally).
METADATA_ONLY = os.environ.get("RINGREDUCE_METADATA_ONLY") == "1"

setup(
    ext_modules=[] if METADATA_ONLY else [extension()],
    cmdclass={"build_ext": BuildExt},
)
