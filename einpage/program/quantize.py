"""Weight-only quantization: int8 and int4 weights with group-wise scales.

Which weights are quantized is the model's to say: the weight specs of a family mark the
matrices matmuls read (`WeightSpec.quantize`, gathered by `ModelConfig.quantized_weights`);
embedding tables, norms and biases stay in the float dtype. Names play no part.

A weight `w` of shape `(..., n)` is cut along its last axis into groups of `G`
elements (`Quantization.group_size(n)`: the configured group, 128 by default, or the
largest divisor of `n` below it). Each group gets one scale `s = max|w| / qmax`
(round to nearest, symmetric: no zero point), and each element the integer
`q = clip(round(w / s), -qmax - 1, qmax)`, with `qmax` 127 for int8 and 7 for int4.

Stored (the inputs of a quantized program, named after the weight):

* `{name}.q`: int8 `(..., n/G, G)`, or for int4 uint8 `(..., n/G, G/2)`, two values a
  byte: byte `j` holds `q[j] + 8` in its low nibble and `q[j + G/2] + 8` in its high
  nibble (so reloads move half a byte per weight);
* `{name}.scale`: the program's float dtype, `(..., n/G)`.

In the program the weight is rebuilt on the device by tasks that feed the matmul
reading it (`dequantized_weight`): a cast of the integers to the float dtype (for int4
two casts whose joins unpack the nibbles with `floor`, and a concat), a multiply by
the scales, and a view to the weight's shape. The planner sees the quantized bytes as
the weight inputs (what stays on the host and crosses PCIe) and the full-precision
weight as a transient task output, freed after its matmul.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from einpage.errors import ConfigError
from einpage.program.program import Program, Tensor

__all__ = [
    "Quantization",
    "quantize",
    "dequantize",
    "quantize_weights",
    "quantized_inputs",
    "dequantized_weight",
    "quantized_weight_inputs",
    "rebuilt_weight",
]

BITS = (8, 4)


@dataclass(frozen=True, slots=True)
class Quantization:
    """How weights are quantized: `bits` (8 or 4) and the preferred `group` size."""

    bits: int = 8
    group: int = 128

    def __post_init__(self) -> None:
        if self.bits not in BITS:
            raise ConfigError(f"quantization: bits must be one of {BITS}, got {self.bits!r}")
        if not isinstance(self.group, int) or self.group < 2:
            raise ConfigError(f"quantization: group must be an integer >= 2, got {self.group!r}")

    @property
    def qmax(self) -> int:
        return 127 if self.bits == 8 else 7

    def group_size(self, n: int) -> int:
        """The group along an axis of `n` elements: the largest divisor of `n` that is at
        most `group` (even for int4, which packs pairs); `ConfigError` if none is."""
        for g in range(min(self.group, n), 1, -1):
            if n % g == 0 and (self.bits == 8 or g % 2 == 0):
                return g
        raise ConfigError(
            f"quantization: no group of at most {self.group} elements divides an axis of {n}"
            + (" into an even size (int4 packs pairs)" if self.bits == 4 else "")
        )

    def stored(self, shape: tuple[int, ...], dtype: str) -> dict[str, tuple[tuple[int, ...], str]]:
        """The shapes and dtypes of the `q` and `scale` inputs of a weight of `shape`."""
        *lead, n = shape
        g = self.group_size(n)
        if self.bits == 8:
            q = ((*lead, n // g, g), "int8")
        else:
            q = ((*lead, n // g, g // 2), "uint8")
        return {"q": q, "scale": ((*lead, n // g), dtype)}


def quantize(w: np.ndarray, quant: Quantization) -> tuple[np.ndarray, np.ndarray]:
    """`(q, scale)` of `w` as stored (see the module docstring); scales in float32."""
    w = np.asarray(w, dtype=np.float32)
    *lead, n = w.shape
    g = quant.group_size(n)
    groups = w.reshape(*lead, n // g, g)
    scale = np.abs(groups).max(axis=-1) / quant.qmax
    scale = np.where(scale == 0, 1.0, scale).astype(np.float32)
    q = np.clip(np.rint(groups / scale[..., None]), -quant.qmax - 1, quant.qmax).astype(np.int8)
    if quant.bits == 8:
        return q, scale
    half = g // 2
    biased = (q.astype(np.int16) + 8).astype(np.uint8)
    packed = biased[..., :half] | (biased[..., half:] << 4)
    return packed.astype(np.uint8), scale


def dequantize(
    q: np.ndarray, scale: np.ndarray, quant: Quantization, dtype: Any = "float32"
) -> np.ndarray:
    """The weight that `(q, scale)` stand for, in `dtype`, by NumPy integer arithmetic
    and one multiply (independent of the program's tasks: the tests' reference)."""
    if quant.bits == 8:
        values = q.astype(np.int32)
    else:
        low = (q & 0x0F).astype(np.int32) - 8
        high = (q >> 4).astype(np.int32) - 8
        values = np.concatenate([low, high], axis=-1)
    w = values.astype(dtype) * np.asarray(scale, dtype)[..., None]
    return w.reshape(*w.shape[:-2], -1)


def quantize_weights(
    cfg: Any, weights: Mapping[str, np.ndarray], bits: int = 8, group: int = 128, dtype: Any = None
) -> dict[str, np.ndarray]:
    """The inputs of a program built with `Quantization(bits, group)` from float weights:
    each weight the model quantizes (`cfg.quantized_weights()`) `name` becomes `name.q`
    and `name.scale` (scales in the weights' dtype, or `dtype`); the others are passed
    through. Round to nearest, per group of `group` elements along the last axis (see the
    module docstring)."""
    quant = Quantization(bits, group)
    shapes = cfg.weight_shapes()
    quantized = cfg.quantized_weights()
    out: dict[str, np.ndarray] = {}
    for name, array in weights.items():
        array = np.asarray(array)
        if name in shapes and tuple(array.shape) != tuple(shapes[name]):
            raise ConfigError(
                f"quantize_weights: {name} has shape {array.shape}, the config says {shapes[name]}"
            )
        if name not in quantized:
            out[name] = array
            continue
        q, scale = quantize(array, quant)
        out[f"{name}.q"] = q
        out[f"{name}.scale"] = scale.astype(dtype or array.dtype)
    return out


def quantized_inputs(cfg: Any, quant: Quantization) -> int:
    """The bytes of the weights of the model `cfg` as a quantized program stores them
    (float weights counted at 2 bytes; scales too): what one pass over the weights moves."""
    total = 0
    quantized = cfg.quantized_weights()
    for name, shape in cfg.weight_shapes().items():
        if name not in quantized:
            total += 2 * math.prod(shape)
            continue
        for part_shape, part_dtype in quant.stored(shape, "float16").values():
            total += math.prod(part_shape) * np.dtype(part_dtype).itemsize
    return total


def _letters(count: int) -> str:
    return "abcdefghijklmnopqrstuvwxyz"[:count]


def dequantized_weight(
    prog: Program, name: str, shape: tuple[int, ...], dtype: str, quant: Quantization
) -> Tensor:
    """Declare the quantized inputs of weight `name` (role "weight") and return the
    float weight of `shape` and `dtype` rebuilt from them by tasks of `prog`."""
    q, scale = quantized_weight_inputs(prog, name, shape, dtype, quant)
    return rebuilt_weight(prog, name, q, scale, shape, quant)


def quantized_weight_inputs(
    prog: Program, name: str, shape: tuple[int, ...], dtype: str, quant: Quantization
) -> tuple[Tensor, Tensor]:
    """Declare the inputs `{name}.q` and `{name}.scale` (role "weight") of a weight of
    `shape` stored as `quant` says, scales in `dtype`."""
    stored = quant.stored(shape, dtype)
    q = prog.input(f"{name}.q", *stored["q"], role="weight")
    scale = prog.input(f"{name}.scale", *stored["scale"], role="weight")
    return q, scale


def rebuilt_weight(
    prog: Program, name: str, q: Tensor, scale: Tensor, shape: tuple[int, ...], quant: Quantization
) -> Tensor:
    """The float weight of `shape` (in the scales' dtype) rebuilt from its quantized
    inputs `q` and `scale` by tasks of `prog` (the module docstring says which). A
    generation program calls this once per step that reads the weight, so each step's
    float weight is a transient of that step, never kept or moved between steps."""
    dtype = scale.dtype
    axes = _letters(q.ndim)
    cast = f"{axes}->{axes}"
    if quant.bits == 8:
        values = prog.einsum(cast, q, dtype=dtype, label=f"{name}.int8")
    else:
        low = prog.einsum(
            cast, q, join="a - 16 * floor(a / 16) - 8", dtype=dtype, label=f"{name}.low"
        )
        high = prog.einsum(cast, q, join="floor(a / 16) - 8", dtype=dtype, label=f"{name}.high")
        values = prog.concat([low, high], axis=len(axes) - 1)
    scaled = prog.einsum(f"{axes},{axes[:-1]}->{axes}", values, scale, label=f"{name}.dequant")
    return prog.view(scaled, shape)
