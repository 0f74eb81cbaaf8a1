"""Weight-only quantization: int8 and int4 weights with group-wise scales (and minimums).

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

With `minimum=True` (zero points, as GGUF's Q4_1 and K-quants store them) each group
also has a minimum `m` and the integers are unsigned: `w = s * q + m`, `q` in
`0 .. 2**bits - 1` (int4 nibbles unbiased, int8 as uint8), and a third input
`{name}.min` (the shape and dtype of the scales). `transposed=True` says the groups run
along the first axis of the weight viewed as a matrix `[prod(shape[:-1]), shape[-1]]`:
the stored integers are those of its transpose `[shape[-1], prod(shape[:-1])]` (a
checkpoint that quantized the matrix in its own layout, such as a GGUF's output
projections), and the program transposes the rebuilt matrix.

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
    "quantize_each",
    "quantized_inputs",
    "dequantized_weight",
    "quantized_weight_inputs",
    "rebuilt_weight",
]

BITS = (8, 4)


@dataclass(frozen=True, slots=True)
class Quantization:
    """How weights are quantized: `bits` (8 or 4), the preferred `group` size, whether
    groups have a `minimum` (a zero point; unsigned integers) and whether the groups run
    along the weight's first axis (`transposed`; see the module docstring)."""

    bits: int = 8
    group: int = 128
    minimum: bool = False
    transposed: bool = False

    def __post_init__(self) -> None:
        if self.bits not in BITS:
            raise ConfigError(f"quantization: bits must be one of {BITS}, got {self.bits!r}")
        if not isinstance(self.group, int) or self.group < 2:
            raise ConfigError(f"quantization: group must be an integer >= 2, got {self.group!r}")
        for flag in ("minimum", "transposed"):
            if not isinstance(getattr(self, flag), bool):
                raise ConfigError(
                    f"quantization: {flag} must be True or False, got {getattr(self, flag)!r}"
                )

    @property
    def label(self) -> str:
        """A short name for program names: `int8`, `int4`, `uint4+min`, ..."""
        return f"{'uint' if self.minimum else 'int'}{self.bits}" + ("+min" if self.minimum else "")

    @property
    def qmax(self) -> int:
        """The largest integer stored: 127 or 7 (symmetric), 255 or 15 (with minimums)."""
        if self.minimum:
            return 2**self.bits - 1
        return 127 if self.bits == 8 else 7

    def matrix(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        """The shape whose last axis is cut into groups: `shape` itself, or for a
        `transposed` quantization the transpose of `shape` viewed as a matrix."""
        if not self.transposed:
            return tuple(shape)
        return (shape[-1], math.prod(shape[:-1]))

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
        """The shapes and dtypes of the `q`, `scale` (and `min`) inputs of a weight of
        `shape`."""
        *lead, n = self.matrix(shape)
        g = self.group_size(n)
        if self.bits == 8:
            q = ((*lead, n // g, g), "uint8" if self.minimum else "int8")
        else:
            q = ((*lead, n // g, g // 2), "uint8")
        parts = {"q": q, "scale": ((*lead, n // g), dtype)}
        if self.minimum:
            parts["min"] = ((*lead, n // g), dtype)
        return parts


def quantize(w: np.ndarray, quant: Quantization) -> tuple[np.ndarray, ...]:
    """`(q, scale)` of `w` as stored (see the module docstring), or `(q, scale, min)`
    with minimums; scales and minimums in float32. A `transposed` quantization cuts the
    groups along the first axis of `w` viewed as a matrix."""
    w = np.asarray(w, dtype=np.float32)
    if quant.transposed:
        w = w.reshape(-1, w.shape[-1]).T
    *lead, n = w.shape
    g = quant.group_size(n)
    groups = w.reshape(*lead, n // g, g)
    if quant.minimum:
        low = groups.min(axis=-1)
        scale = (groups.max(axis=-1) - low) / quant.qmax
        scale = np.where(scale == 0, 1.0, scale).astype(np.float32)
        q = np.clip(np.rint((groups - low[..., None]) / scale[..., None]), 0, quant.qmax)
        return pack(q.astype(np.int16), quant), scale, low.astype(np.float32)
    scale = np.abs(groups).max(axis=-1) / quant.qmax
    scale = np.where(scale == 0, 1.0, scale).astype(np.float32)
    q = np.clip(np.rint(groups / scale[..., None]), -quant.qmax - 1, quant.qmax)
    return pack(q.astype(np.int16), quant), scale


def pack(q: np.ndarray, quant: Quantization) -> np.ndarray:
    """The stored integers of `q` [..., groups, G] (values in the quantization's range):
    int8 or uint8 as they are, int4 two a byte (byte `j`: `q[j]` in its low nibble,
    `q[j + G/2]` in its high nibble, biased by 8 unless the groups have minimums)."""
    if quant.bits == 8:
        return q.astype(np.uint8 if quant.minimum else np.int8)
    half = q.shape[-1] // 2
    biased = (q + (0 if quant.minimum else 8)).astype(np.uint8)
    return (biased[..., :half] | (biased[..., half:] << 4)).astype(np.uint8)


def dequantize(
    q: np.ndarray,
    scale: np.ndarray,
    quant: Quantization,
    dtype: Any = "float32",
    minimum: np.ndarray | None = None,
) -> np.ndarray:
    """The weight that `(q, scale)` (and `minimum`, for a quantization with minimums)
    stand for, in `dtype`, by NumPy integer arithmetic, one multiply and one add
    (independent of the program's tasks: the tests' reference). The result has the
    stored matrix's shape (`quant.matrix`; transpose it back for a `transposed` one)."""
    if quant.minimum != (minimum is not None):
        raise ConfigError(
            f"dequantize: the quantization {'has' if quant.minimum else 'has no'} minimums, "
            f"but minimum={'None' if minimum is None else 'an array'} was given"
        )
    bias = 0 if quant.minimum else 8
    if quant.bits == 8:
        values = q.astype(np.int32)
    else:
        low = (q & 0x0F).astype(np.int32) - bias
        high = (q >> 4).astype(np.int32) - bias
        values = np.concatenate([low, high], axis=-1)
    w = values.astype(dtype) * np.asarray(scale, dtype)[..., None]
    if minimum is not None:
        w = w + np.asarray(minimum, dtype)[..., None]
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
    return quantize_each(cfg, weights, dict.fromkeys(cfg.quantized_weights(), quant), dtype)


def quantize_each(
    cfg: Any,
    weights: Mapping[str, np.ndarray],
    quants: Mapping[str, Quantization],
    dtype: Any = None,
) -> dict[str, np.ndarray]:
    """The inputs of a program built with one `Quantization` per weight (`quants`, as a
    GGUF file's tensors each have their type) from float weights: each weight named in
    `quants` becomes `name.q`, `name.scale` (and `name.min`, with minimums), scales in
    the weights' dtype or `dtype`; the others are passed through."""
    shapes = cfg.weight_shapes()
    out: dict[str, np.ndarray] = {}
    for name, array in weights.items():
        array = np.asarray(array)
        if name in shapes and tuple(array.shape) != tuple(shapes[name]):
            raise ConfigError(
                f"quantize_weights: {name} has shape {array.shape}, the config says {shapes[name]}"
            )
        if name not in quants:
            out[name] = array
            continue
        q, scale, *minimum = quantize(array, quants[name])
        out[f"{name}.q"] = q
        out[f"{name}.scale"] = scale.astype(dtype or array.dtype)
        if minimum:
            out[f"{name}.min"] = minimum[0].astype(dtype or array.dtype)
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
    float weight of `shape` and `dtype` rebuilt from them by tasks of `prog` (a
    `transposed` quantization's matrix transposed back by one more task)."""
    parts = quantized_weight_inputs(prog, name, shape, dtype, quant)
    return rebuilt_weight(prog, name, parts, shape, quant)


def quantized_weight_inputs(
    prog: Program, name: str, shape: tuple[int, ...], dtype: str, quant: Quantization
) -> dict[str, Tensor]:
    """Declare the inputs `{name}.q`, `{name}.scale` (and `{name}.min`, with minimums),
    role "weight", of a weight of `shape` stored as `quant` says, scales in `dtype`;
    returned by part (`q`, `scale`, `min`)."""
    return {
        part: prog.input(f"{name}.{part}", *shape_dtype, role="weight")
        for part, shape_dtype in quant.stored(shape, dtype).items()
    }


def rebuilt_weight(
    prog: Program,
    name: str,
    parts: Mapping[str, Tensor],
    shape: tuple[int, ...],
    quant: Quantization,
) -> Tensor:
    """The float weight of `shape` (in the scales' dtype) rebuilt from its quantized
    inputs `parts` (`quantized_weight_inputs`) by tasks of `prog` (the module docstring
    says which). A generation program calls this once per step that reads the weight, so
    each step's float weight is a transient of that step, never kept or moved between
    steps."""
    dtype = parts["scale"].dtype
    axes = _letters(parts["q"].ndim)
    cast = f"{axes}->{axes}"
    bias = "" if quant.minimum else " - 8"
    if quant.bits == 8:
        values = prog.einsum(cast, parts["q"], dtype=dtype, label=f"{name}.int8")
    else:
        low = prog.einsum(
            cast, parts["q"], join=f"a - 16 * floor(a / 16){bias}", dtype=dtype,
            label=f"{name}.low",
        )  # fmt: skip
        high = prog.einsum(
            cast, parts["q"], join=f"floor(a / 16){bias}", dtype=dtype, label=f"{name}.high"
        )
        values = prog.concat([low, high], axis=len(axes) - 1)
    groups = axes[:-1]
    if quant.minimum:
        scaled = prog.einsum(
            f"{axes},{groups},{groups}->{axes}", values, parts["scale"], parts["min"],
            join="a * b + c", label=f"{name}.dequant",
        )  # fmt: skip
    else:
        scaled = prog.einsum(
            f"{axes},{groups}->{axes}", values, parts["scale"], label=f"{name}.dequant"
        )
    if not quant.transposed:
        return prog.view(scaled, shape)
    matrix = prog.view(scaled, quant.matrix(shape))
    flipped = prog.einsum("ab->ba", matrix, label=f"{name}.transpose")
    return prog.view(flipped, shape)
