"""NVRTC without a GPU: compile CUDA C for a target architecture as CuPy would (tests only).

The `nvidia-cuda-nvrtc-cu12` wheel holds NVRTC (a library: no driver, no device), CuPy
(`cupy-cuda12x`) its kernel headers and the CCCL headers they include, and
`nvidia-cuda-runtime-cu12` the CUDA headers (`cuda_fp16.h`, and `cuda_bf16.h`, which
CuPy's `cupy/bfloat16.cuh` includes). `compile_errors(source, arch)` compiles with the
options CuPy passes (`cupy_options`) and returns NVRTC's log, or None when the source
compiles. `missing()` says what is not installed (None when all is).
"""

from __future__ import annotations

import importlib.util
import os

from runtime.cupy_backend import KERNEL_OPTIONS

_PIECES = {
    "cupy_backends.cuda.libs.nvrtc": "cupy-cuda12x",
    "nvidia.cuda_nvrtc": "nvidia-cuda-nvrtc-cu12",
    "nvidia.cuda_runtime": "nvidia-cuda-runtime-cu12",
}


def missing() -> str | None:
    """What the compile tier lacks ("pip install ..."), or None."""
    absent = []
    for module, wheel in _PIECES.items():
        try:
            found = importlib.util.find_spec(module) is not None
        except ModuleNotFoundError:
            found = False
        if not found:
            absent.append(wheel)
    if absent:
        return "NVRTC compile tier needs " + ", ".join(absent) + " (pip install '.[nvrtc]')"
    return None


def _package_dir(module: str) -> str:
    spec = importlib.util.find_spec(module)
    assert spec is not None and spec.submodule_search_locations
    return list(spec.submodule_search_locations)[0]


def cuda_include_dir() -> str:
    """The CUDA runtime headers of the `nvidia-cuda-runtime-cu12` wheel."""
    return os.path.join(_package_dir("nvidia.cuda_runtime"), "include")


def cupy_options(arch: str) -> list[str]:
    """The options CuPy 14's `compile_with_cache` gives NVRTC for a kernel on a device of
    architecture `arch` ("sm_80"): `assemble_cupy_compiler_options` (the CCCL it bundles,
    C++17, its headers, the CUDA headers), `-ftz=true`, `-arch=sm_XX` (CuPy compiles
    cubins where NVRTC can) and `--device-as-default-execution-space`, then the options the
    backend gives every kernel (`cupy_backend.KERNEL_OPTIONS`)."""
    from cupy._core import core

    options = list(core.assemble_cupy_compiler_options(()))
    if not any(o == f"-I{cuda_include_dir()}" for o in options):
        options.append(f"-I{cuda_include_dir()}")
    extra = ["-ftz=true", f"-arch={arch}", "--device-as-default-execution-space"]
    return [*options, *extra, *KERNEL_OPTIONS]  # the backend's own options last


def compile_errors(source: str, arch: str) -> str | None:
    """NVRTC's log when `source` does not compile for `arch` ("sm_80"), else None."""
    from cupy_backends.cuda.libs import nvrtc

    program = nvrtc.createProgram(source, "einpage_kernel.cu", [], [])
    try:
        try:
            nvrtc.compileProgram(program, cupy_options(arch))
        except nvrtc.NVRTCError:
            return nvrtc.getProgramLog(program)
        return None
    finally:
        nvrtc.destroyProgram(program)
