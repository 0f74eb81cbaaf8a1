"""Weight specs: how each program weight is made from one checkpoint tensor, and the loader.

A model lists one `WeightSpec` per weight input of its program: the input's name and
shape, the checkpoint key it comes from, the shape the checkpoint must store, and the
conversion (take a range of the last axis, transpose, reshape). `load_weights` checks
every key and shape first, naming the weight and both shapes, before it reads anything,
so a wrong checkpoint fails in milliseconds rather than after gigabytes of reading.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from einpage.models.checkpoint import Part, Source
from einpage.models.errors import ConfigMismatchError, WeightError
from einpage_core.errors import DTypeError
from taskgraph import dtypes

__all__ = ["WeightSpec", "load_weights", "resolve_prefix", "check_layer_count"]

Shape = tuple[int, ...]


@dataclass(frozen=True, slots=True)
class WeightSpec:
    """One program weight and where it comes from.

    `name`: the program input (e.g. `"layers.0.attn.wq"`); `shape`: its shape in the
    program; `key`: the checkpoint tensor (e.g. `"model.layers.0.self_attn.q_proj.weight"`);
    `source_shape`: the shape the checkpoint must store; `part`: a range `[start, stop)`
    of the checkpoint tensor's last axis to take first (GPT-2's fused QKV), or None;
    `transpose`: transpose the (2-D) tensor before it is reshaped to `shape`;
    `quantize`: the weight is a matrix a matmul reads, which weight-only quantization
    stores in fewer bits (`einpage.program.quantize`) – the model says so here, the name
    does not (embedding tables, read by gathers, norms and biases leave it False).
    """

    name: str
    shape: Shape
    key: str
    source_shape: Shape
    part: Part = None
    transpose: bool = False
    quantize: bool = False

    def convert(self, array: np.ndarray, dtype: str) -> np.ndarray:
        """The program's array from the checkpoint's (already cut to `part`), in `dtype`:
        one cast, straight from the stored dtype (bfloat16 to float32 is exact; to
        bfloat16, rounded to nearest even as torch's `.to(torch.bfloat16)`)."""
        if self.transpose:
            array = array.T
        return np.ascontiguousarray(array.reshape(self.shape), dtype=dtypes.numpy_dtype(dtype))


def resolve_prefix(keys: Sequence[str], probe: str, prefixes: Sequence[str], where: str) -> str:
    """The prefix under which `probe` (e.g. `"embed_tokens.weight"`) is stored in `keys`:
    the first of `prefixes` that works (so both `LlamaForCausalLM` and bare `LlamaModel`
    state dicts load)."""
    present = set(keys)
    for prefix in prefixes:
        if prefix + probe in present:
            return prefix
    tried = ", ".join(repr(p + probe) for p in prefixes)
    shown = ", ".join(repr(k) for k in list(keys)[:5])
    raise WeightError(
        f"{where} has no embedding table: looked for {tried}; it holds {len(present)} tensors "
        f"({shown}{', ...' if len(present) > 5 else ''})",
        name="embed",
        key=prefixes[0] + probe,
    )


def check_layer_count(
    keys: Sequence[str], layer_prefix: str, expected: int, field: str, where: str
) -> None:
    """Raise `ConfigMismatchError` unless the checkpoint's layers (keys starting with
    `layer_prefix` + "<i>.") are exactly 0 .. expected-1."""
    found = set()
    for key in keys:
        if key.startswith(layer_prefix):
            head = key[len(layer_prefix) :].split(".", 1)[0]
            if head.isdigit():
                found.add(int(head))
    if found != set(range(expected)):
        listed = f"{len(found)} layers" if found else "no layers"
        if found:
            listed += f" (numbered {min(found)} .. {max(found)})"
        raise ConfigMismatchError(
            f"the config has {field}={expected}, but {where} holds {listed} under {layer_prefix!r}"
        )


def load_weights(specs: Sequence[WeightSpec], source: Source, dtype: str) -> dict[str, np.ndarray]:
    """Read and convert every weight of `specs` from `source` (a checkpoint source, see
    `einpage.models.checkpoint`), as contiguous arrays of `dtype` (a float dtype:
    float16, bfloat16, float32, float64). Where no conversion is needed (same dtype, no
    transpose) an array may share memory with the source's tensor, so a model already
    in memory is not copied a second time: a bfloat16 checkpoint loaded as bfloat16 is
    never widened.

    Raises `WeightError` for a missing key or a shape that differs from `source_shape`
    (all are checked before any tensor is read).
    """
    dtype = dtypes.canonical(dtype)
    if not dtypes.is_float(dtype):
        raise DTypeError(f"weights must have a float dtype, got {dtype}")
    keys = set(source.keys())
    where = source.where
    for spec in specs:
        if spec.key not in keys:
            raise WeightError(
                f"weight {spec.name!r}: {where} has no tensor {spec.key!r} "
                f"(expected shape {spec.source_shape})",
                name=spec.name,
                key=spec.key,
                expected=spec.source_shape,
            )
        got = source.shape(spec.key)
        if got != spec.source_shape:
            raise WeightError(
                f"weight {spec.name!r}: {spec.key!r} in {where} has shape {got}, "
                f"but this config needs {spec.source_shape}",
                name=spec.name,
                key=spec.key,
                expected=spec.source_shape,
                got=got,
            )
    weights = {}
    for spec in specs:
        array = source.read(spec.key, spec.part)
        if not dtypes.is_float_array(array.dtype):
            raise WeightError(
                f"weight {spec.name!r}: {spec.key!r} in {where} has dtype {array.dtype}, "
                "expected a floating-point tensor",
                name=spec.name,
                key=spec.key,
            )
        weights[spec.name] = spec.convert(array, dtype)
    return weights
