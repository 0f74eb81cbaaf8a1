"""Weights in safetensors files, read where they are (`weight_places`, `save_weights`).

A plan with a host tier (`memgraph.tiers`) reads each weight from its checkpoint file
when it needs it, at the offset the file's header gives, instead of keeping every weight
in host memory. `weight_places(path, tg)` reads the header of a safetensors file (or of
each shard of a checkpoint folder with `model.safetensors.index.json`) and returns, for
each input of the TaskGraph the file holds under the input's name, where its bytes are
(`memgraph.tiers.CheckpointPlace`). The header comes from disk, so it is validated before
any offset is used: its length, its JSON, every entry's dtype, shape and data offsets
(inside the file, the bytes the dtype and shape need, no two overlapping), and the dtype
and shape against the program's input of that name. A tensor stored under another name
or as the transpose of the program's matrix (a Hugging Face checkpoint) is read in place
as `Stored` says (`weight_places(path, tg, stored)`; the models room states each family's
names and layouts: `einpage.models.base.checkpoint_places`); one in another dtype than
the program's, or fused with others (GPT-2's attention), is not: `save_weights` writes
the program's own weights, by input name, as a safetensors file that can be.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from einpage.errors import CheckpointError
from einpage.pipeline.checkpoint_files import HEADER_LIMIT, checkpoint_files
from memgraph.graph import MemGraph
from memgraph.tiers import CheckpointPlace
from runtime.tiers import disk_inputs
from taskgraph import dtypes
from taskgraph.graph import TaskGraph
from taskgraph.nodes import Input

__all__ = [
    "Stored",
    "weight_places",
    "save_weights",
    "read_header",
    "planned_weights",
    "SAFETENSORS_DTYPES",
]

SAFETENSORS_DTYPES = {
    "F64": "float64",
    "F32": "float32",
    "F16": "float16",
    "BF16": "bfloat16",
    "I64": "int64",
    "I32": "int32",
    "I8": "int8",
    "U8": "uint8",
}
"""The safetensors dtype codes einpage reads, and its dtype for each."""

_CODES = {dtype: code for code, dtype in SAFETENSORS_DTYPES.items()}


Entry = tuple[str, tuple[int, ...], int, int]
"""A tensor of a safetensors file: dtype, shape, offset of its bytes in the file, bytes."""


def read_header(file: str | os.PathLike[str]) -> tuple[dict[str, Entry], int]:
    """The tensors of a safetensors file – name -> (dtype, shape, offset in the file, bytes)
    – validated, and the file's size."""
    head, size = _read_head(file)
    return _tensors(str(file), head, size), size


def _read_head(file: str | os.PathLike[str]) -> tuple[bytes, int]:
    """A safetensors file's head – its 8-byte length and its header, where every tensor
    is – and the file's size; the length checked against the file."""
    where = str(file)
    try:
        with open(file, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            head = f.read(8)
            if len(head) < 8:
                raise CheckpointError(f"{where!r} is not a safetensors file: under 8 bytes")
            length = int.from_bytes(head, "little")
            if not 2 <= length <= min(HEADER_LIMIT, size - 8):
                raise CheckpointError(
                    f"{where!r}: header length {length} does not fit the file ({size} bytes)"
                )
            return head + f.read(length), size
    except OSError as err:
        raise CheckpointError(f"cannot read {where!r}: {err}") from None


def _tensors(where: str, head: bytes, size: int) -> dict[str, Entry]:
    """The header of a safetensors file's `head` parsed and validated (see `read_header`)."""
    try:
        header = json.loads(head[8:])
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise CheckpointError(f"{where!r}: the header is not JSON: {err}") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{where!r}: the header is not a JSON object")
    tensors: dict[str, Entry] = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        tensors[name] = _entry(where, name, entry, len(head), size)
    spans = sorted((at, at + nbytes, name) for name, (_, _, at, nbytes) in tensors.items())
    for (_, end, first), (begin, _, second) in zip(spans, spans[1:], strict=False):
        if begin < end:
            raise CheckpointError(f"{where!r}: tensors {first!r} and {second!r} overlap")
    return tensors


def _entry(where: str, name: str, entry: Any, start: int, size: int) -> Entry:
    """One header entry, checked: (dtype, shape, offset in the file, bytes)."""
    if not isinstance(entry, dict) or set(entry) - {"dtype", "shape", "data_offsets"}:
        raise CheckpointError(f"{where!r}: the header entry of {name!r} is malformed")
    code, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
    if code not in SAFETENSORS_DTYPES:
        raise CheckpointError(
            f"{where!r}: {name!r} has dtype {code!r}; einpage reads "
            f"{', '.join(SAFETENSORS_DTYPES)}"
        )
    if not _naturals(shape) or not _naturals(offsets, 2) or offsets[0] > offsets[1]:
        raise CheckpointError(f"{where!r}: {name!r} has a malformed shape or data_offsets")
    dtype = SAFETENSORS_DTYPES[code]
    nbytes = math.prod(shape) * dtypes.numpy_dtype(dtype).itemsize
    if offsets[1] - offsets[0] != nbytes:
        raise CheckpointError(
            f"{where!r}: {name!r} is {dtype}{list(shape)} ({nbytes} bytes) but its data_offsets "
            f"span {offsets[1] - offsets[0]}"
        )
    if start + offsets[1] > size:
        raise CheckpointError(f"{where!r}: {name!r} ends past the end of the file (truncated?)")
    return dtype, tuple(shape), start + offsets[0], nbytes


def _naturals(value: Any, length: int | None = None) -> bool:
    """Whether `value` is a list of ints >= 0 (of `length` items, when given)."""
    return (
        isinstance(value, list)
        and (length is None or len(value) == length)
        and all(type(x) is int and x >= 0 for x in value)
    )


@dataclass(frozen=True, slots=True)
class Stored:
    """How a checkpoint stores one program input: as its tensor `key` of `shape` and,
    when `transposed`, as the transpose of the input's matrix (2-D: a Hugging Face
    LLaMA's `o_proj` and `down_proj`), which a run transposes back as it reads it
    (`memgraph.nodes.DiskPlace.transposed`)."""

    key: str
    shape: tuple[int, ...]
    transposed: bool = False


def weight_places(
    path: str | os.PathLike[str], tg: TaskGraph, stored: Mapping[str, Stored] | None = None
) -> dict[str, CheckpointPlace]:
    """Where each input of `tg` that the checkpoint at `path` (a safetensors file, or a
    folder as `save_pretrained` writes one) holds is: file, offset and layout. Without
    `stored`, an input is the tensor of its own name, in its own shape; with it, only the
    inputs `stored` names are placed, each as it says (the models room states a family's
    Hugging Face names and layouts: `einpage.models.checkpoint_places`).

    Raises `CheckpointError` for a malformed file, a tensor `stored` names that is not
    there, or one whose dtype or shape is not the input's; inputs the checkpoint does not
    hold are not in the result (the caller passes them), and a checkpoint that holds none
    of them is an error.
    """
    files = checkpoint_files(Path(path))
    inputs = {task.op.name: task for task in tg if isinstance(task.op, Input)}
    headers: dict[Path, tuple[dict[str, Entry], int, int, str]] = {}
    places: dict[str, CheckpointPlace] = {}
    for name, task in inputs.items():
        if stored is None:
            how = Stored(name, tuple(task.shape))
        elif name in stored:
            how = stored[name]
        else:
            continue
        file = files.get(how.key)
        if file is None:
            if stored is None:
                continue
            raise CheckpointError(
                f"the checkpoint at {str(path)!r} has no tensor {how.key!r} (the program's "
                f"input {name!r})"
            )
        if file not in headers:  # each file's head read once: parsed, and its digest kept
            head, size = _read_head(file)
            digest = hashlib.sha256(head).hexdigest()
            headers[file] = (_tensors(str(file), head, size), size, len(head), digest)
        tensors, size, head_bytes, digest = headers[file]
        if how.key not in tensors:
            raise CheckpointError(f"{str(file)!r} does not hold {how.key!r}, as its index says")
        dtype, shape, offset, _ = tensors[how.key]
        _check_stored(str(file), name, how, dtype, shape, task)
        where = str(Path(file).resolve())
        layout = (shape[0], shape[1]) if how.transposed else None
        places[name] = CheckpointPlace(
            where, size, offset, head_bytes, digest, transposed=layout
        )
    if not places:
        raise CheckpointError(
            f"the checkpoint at {str(path)!r} holds none of the program's inputs "
            f"({', '.join(sorted(inputs)[:6])}, ...) under their names; save_weights writes "
            "one that does (a Hugging Face folder is read in place by a generation, which "
            "knows its family's names: einpage generate --checkpoint DIR --host-budget SIZE)"
        )
    return places


def _check_stored(
    file: str, name: str, how: Stored, dtype: str, shape: tuple[int, ...], task: Any
) -> None:
    """`CheckpointError` unless tensor `how.key` of `file` (`dtype`, `shape`) holds input
    `name` (`task`) as `how` says: the input's dtype, `how.shape`, the input's elements;
    a transposed one 2-D."""
    said = f"{str(file)!r}: {how.key!r} is {dtype}{list(shape)}"
    if how.key != name:
        said += f" (the program's input {name!r})"
    if dtype != task.dtype:
        raise CheckpointError(
            f"{said}, but the program's input is {task.dtype}: a weight is read in place "
            f"in the dtype the file stores; plan in {dtype}"
        )
    if shape != tuple(how.shape) or math.prod(shape) != math.prod(task.shape):
        raise CheckpointError(f"{said}, but the program's input is {task.dtype}{list(task.shape)}")
    if how.transposed and len(shape) != 2:
        raise CheckpointError(f"{said}: only a 2-D tensor can be read transposed")


def save_weights(weights: Mapping[str, Any], path: str | os.PathLike[str]) -> Path:
    """Write `weights` (input name -> array) as one safetensors file at `path`, each
    tensor C-contiguous in its own dtype, in name order; returns the path. The file is
    written to a temporary name first and renamed, so a failure leaves no partial file."""
    path = Path(path)
    entries, offset = {}, 0
    arrays = []
    for name in sorted(weights):
        array = np.ascontiguousarray(weights[name])
        try:
            dtype = dtypes.canonical(array.dtype)
        except Exception:
            dtype = str(array.dtype)
        if dtype not in _CODES:
            raise CheckpointError(
                f"weight {name!r} has dtype {dtype}; save_weights writes {', '.join(_CODES)}"
            )
        entries[name] = {
            "dtype": _CODES[dtype],
            "shape": list(array.shape),
            "data_offsets": [offset, offset + array.nbytes],
        }
        offset += array.nbytes
        arrays.append(array)
    text = json.dumps(entries, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # the data starts 8-byte aligned, as safetensors writes it
    partial = path.with_name(path.name + ".partial")
    try:
        with open(partial, "wb") as f:
            f.write(len(text).to_bytes(8, "little"))
            f.write(text)
            for array in arrays:
                f.write(memoryview(array.reshape(-1).view(np.uint8)))
        os.replace(partial, path)
    except BaseException:
        partial.unlink(missing_ok=True)
        raise
    return path


def planned_weights(mg: MemGraph) -> dict[str, np.ndarray]:
    """The weights a plan with a host tier reads from its checkpoint files, read here whole
    by name (`np.fromfile` at the offsets the plan states, not the runtime's reads): what a
    reference evaluation of the plan's program needs besides the inputs a run is given. A
    weight the file holds transposed is read as its (rows, cols) matrix and transposed,
    then given the storage's shape."""
    arrays = {}
    for name, sid in disk_inputs(mg).items():
        storage = mg.storages[sid]
        file = mg.tier.files[storage.disk.file]
        if os.path.getsize(file.path) != file.nbytes:
            raise CheckpointError(
                f"{file.path!r} is {os.path.getsize(file.path)} bytes, the plan says {file.nbytes}"
            )
        dtype = dtypes.numpy_dtype(storage.dtype)
        count = math.prod(storage.shape)
        array = np.fromfile(file.path, dtype=dtype, count=count, offset=storage.disk.offset)
        if storage.disk.transposed is not None:
            array = np.ascontiguousarray(array.reshape(storage.disk.transposed).T)
        arrays[name] = array.reshape(storage.shape)
    return arrays
