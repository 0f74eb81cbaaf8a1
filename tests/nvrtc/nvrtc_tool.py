"""NVRTC without a GPU: compile CUDA C for a target architecture (tests only).

The `nvidia-cuda-nvrtc-cu12` wheel holds NVRTC (a library: no driver, no device), CuPy
(`cupy-cuda12x`) its kernel headers and the CCCL headers they include, and
`nvidia-cuda-runtime-cu12` the CUDA headers (`cuda_fp16.h`). `compile_errors(source,
arch)` compiles with the include paths CuPy passes and returns NVRTC's log, or None
when the source compiles. `missing()` says what is not installed (None when all is).
"""

from __future__ import annotations

import importlib.util
import os

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


def include_options() -> list[str]:
    """`-I` options: CuPy's headers, the CCCL it bundles, the CUDA runtime headers."""
    cupy_include = os.path.join(_package_dir("cupy"), "_core", "include")
    cccl = os.path.join(cupy_include, "cupy", "_cccl")
    cuda = os.path.join(_package_dir("nvidia.cuda_runtime"), "include")
    dirs = [cupy_include, f"{cccl}/libcudacxx", f"{cccl}/thrust", f"{cccl}/cub", cuda]
    return [f"-I{d}" for d in dirs]


def compile_errors(source: str, arch: str) -> str | None:
    """NVRTC's log when `source` does not compile for `arch` ("compute_80"), else None."""
    from cupy_backends.cuda.libs import nvrtc

    program = nvrtc.createProgram(source, "einpage_kernel.cu", [], [])
    try:
        options = [f"-arch={arch}", *include_options(), "--std=c++17"]
        try:
            nvrtc.compileProgram(program, options)
        except nvrtc.NVRTCError:
            return nvrtc.getProgramLog(program)
        return None
    finally:
        nvrtc.destroyProgram(program)
