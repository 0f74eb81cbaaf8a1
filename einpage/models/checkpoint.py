"""Reading tensors from Hugging Face checkpoints: in-memory state dicts and safetensors on disk.

A *source* is what the weight loaders read from. It lists its keys, tells a tensor's
shape without reading it, and reads one tensor (optionally only a range of its last
axis) as a NumPy array in the dtype it is stored in:

* `StateDictSource` wraps a `model.state_dict()` (torch tensors or NumPy arrays);
* `SafetensorsSource` opens a checkpoint directory lazily with
  `safetensors.safe_open(..., framework="numpy")` and reads only the tensors asked
  for. A sharded checkpoint is described by `model.safetensors.index.json`; that file
  comes from disk, so it is validated (shape of the JSON, shard names that stay inside
  the directory, shards that exist) before anything is read.

bfloat16 tensors stay bfloat16 (NumPy arrays of `ml_dtypes.bfloat16`, which
`taskgraph.dtypes` registers): safetensors' NumPy loader does not know the type, so a
bfloat16 tensor is read from the file's header and raw bytes and viewed as bfloat16,
and a torch bfloat16 tensor's bits are viewed the same way. Nothing is widened to
float32 on the way; the weight loader converts to the program's dtype (widening to
float32 is exact).
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from einpage.models.errors import CheckpointError
from einpage.pipeline.checkpoint_files import (
    HEADER_LIMIT,
    INDEX_FILE,
    SINGLE_FILE,
    checkpoint_files,
    load_json,
)
from taskgraph import dtypes

__all__ = [
    "Source",
    "StateDictSource",
    "SafetensorsSource",
    "open_source",
    "read_hf_config",
    "require_hf_config",
    "checkpoint_dtype",
    "to_numpy",
    "INDEX_FILE",
    "SINGLE_FILE",
    "CONFIG_FILE",
]

CONFIG_FILE = "config.json"

Part = tuple[int, int] | None
"""A range `[start, stop)` of a tensor's last axis, or None for the whole tensor."""


class Source(Protocol):
    """What weight loaders read: keys, shapes without reading, and tensors."""

    where: str  # for messages: "the state dict", "checkpoint '/path'"

    def keys(self) -> list[str]: ...

    def shape(self, key: str) -> tuple[int, ...]: ...

    def read(self, key: str, part: Part = None) -> np.ndarray: ...

    def close(self) -> None: ...


def to_numpy(value: Any) -> np.ndarray:
    """A NumPy array with the data of `value` (a NumPy array or a torch tensor). A torch
    bfloat16 tensor becomes a bfloat16 array with the same bits (torch cannot convert it
    to NumPy itself, so its bits go through int16). Torch is imported only for a torch
    tensor, when it is loaded already."""
    if isinstance(value, np.ndarray):
        return value
    if hasattr(value, "detach") and hasattr(value, "numpy"):  # a torch tensor
        tensor = value.detach().cpu()
        if str(tensor.dtype) == "torch.bfloat16":
            import torch

            bits = tensor.view(torch.int16).numpy()
            return bits.view(dtypes.numpy_dtype("bfloat16"))
        return tensor.numpy()
    return np.asarray(value)


def _take(array: np.ndarray, part: Part) -> np.ndarray:
    return array if part is None else array[..., part[0] : part[1]]


class StateDictSource:
    """Tensors of an in-memory state dict (name -> torch tensor or NumPy array)."""

    def __init__(self, state_dict: Mapping[str, Any]):
        if not isinstance(state_dict, Mapping):
            raise CheckpointError(
                f"a state dict must be a mapping of name to tensor, got {type(state_dict).__name__}"
            )
        self._tensors = state_dict
        self.where = "the state dict"

    def keys(self) -> list[str]:
        return list(self._tensors)

    def shape(self, key: str) -> tuple[int, ...]:
        return tuple(int(d) for d in self._tensors[key].shape)

    def read(self, key: str, part: Part = None) -> np.ndarray:
        return _take(to_numpy(self._tensors[key]), part)

    def close(self) -> None:
        """Nothing to release (present so every source is used the same way)."""

    def __enter__(self) -> StateDictSource:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class SafetensorsSource:
    """Tensors of a safetensors checkpoint: a directory (single file or sharded) or one file.

    Files are opened on first use and memory-mapped by safetensors; `read` copies only
    the tensor (or the part of it) that is asked for. Use as a context manager, or call
    `close()`, to release the files.
    """

    def __init__(self, path: str | os.PathLike[str]):
        self.path = Path(path)
        self.where = f"checkpoint {str(self.path)!r}"
        self._files = checkpoint_files(self.path)  # key -> the file that holds it
        self._handles: dict[Path, Any] = {}  # open files
        self._held: dict[Path, set[str]] = {}  # file -> the keys it really holds

    def keys(self) -> list[str]:
        return list(self._files)

    def _handle(self, key: str) -> Any:
        """The open file that holds `key` (opened on first use)."""
        from safetensors import safe_open

        file = self._files[key]
        if file not in self._handles:
            try:
                handle = safe_open(str(file), framework="numpy")
            except Exception as err:  # safetensors raises its own error types
                raise CheckpointError(
                    f"cannot open safetensors file {str(file)!r}: {err}"
                ) from None
            self._handles[file] = handle
            self._held[file] = set(handle.keys())
        if key not in self._held[file]:
            raise CheckpointError(
                f"{INDEX_FILE} in {str(self.path)!r} maps {key!r} to {file.name!r}, "
                f"but that file has no tensor {key!r}"
            )
        return self._handles[file]

    def shape(self, key: str) -> tuple[int, ...]:
        return tuple(int(d) for d in self._handle(key).get_slice(key).get_shape())

    def read(self, key: str, part: Part = None) -> np.ndarray:
        handle = self._handle(key)
        tensor = handle.get_slice(key)
        if tensor.get_dtype() == "BF16":
            return _take(_read_bf16(self._files[key], key), part)
        if part is None:
            return handle.get_tensor(key)
        return tensor[..., part[0] : part[1]]

    def close(self) -> None:
        # safe_open handles release their memory map when dropped.
        self._handles.clear()
        self._held.clear()

    def __enter__(self) -> SafetensorsSource:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def open_source(source: Any) -> StateDictSource | SafetensorsSource:
    """A source for a state dict (a mapping) or a checkpoint path (str or PathLike)."""
    if isinstance(source, StateDictSource | SafetensorsSource):
        return source
    if isinstance(source, str | os.PathLike):
        return SafetensorsSource(source)
    return StateDictSource(source)


def read_hf_config(path: str | os.PathLike[str]) -> dict[str, Any] | None:
    """The `config.json` beside a checkpoint as a dict, or None when there is none."""
    path = Path(path)
    file = path / CONFIG_FILE if path.is_dir() else path.parent / CONFIG_FILE
    if not file.is_file():
        return None
    data = load_json(file)
    if not isinstance(data, dict):
        raise CheckpointError(f"{str(file)!r}: expected a JSON object, got {type(data).__name__}")
    return data


HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")
"""What a Hugging Face hub id looks like (`meta-llama/Llama-2-7b-hf`): einpage reads
checkpoint folders and downloads nothing, so a path of this form that is not there is
most likely a hub id, and the message says how to get its folder."""

GET_A_FOLDER = (
    "a checkpoint is the folder save_pretrained writes (config.json and the .safetensors); "
    "get one with `huggingface-cli download ID --local-dir DIR` or, in transformers, "
    "`model.save_pretrained(DIR)`"
)
"""How to get a checkpoint folder, for the messages of a path that is not one."""


def require_hf_config(
    path: str | os.PathLike[str], owner: str, caller: str | None = None
) -> tuple[dict[str, Any], str]:
    """The `config.json` of a checkpoint (a directory, or a weights file beside it) and a
    name for the model (the directory's name); `CheckpointError` naming the path given
    when it does not exist (and, for what looks like a hub id, that einpage downloads
    nothing, and how to get the folder) or holds no `config.json`. Messages start with
    `caller` (default `{owner}.from_checkpoint`, which also suggests `{owner}.from_hf`)."""
    path = Path(path)
    who = caller or f"{owner}.from_checkpoint"
    if not path.exists():
        if HUB_ID.fullmatch(str(path)):
            raise CheckpointError(
                f"{who}: there is no folder {str(path)!r}; it looks like a Hugging Face hub "
                f"id, and einpage does not download checkpoints: run `huggingface-cli "
                f"download {path} --local-dir DIR` (or `save_pretrained(DIR)` in "
                "transformers) and pass DIR"
            )
        raise CheckpointError(f"{who}: the checkpoint {str(path)!r} does not exist; {GET_A_FOLDER}")
    folder = path if path.is_dir() else path.parent
    config = read_hf_config(path)
    if config is None:
        where = f"the folder {str(folder)!r}"
        if not path.is_dir():
            where += f" (beside the file {str(path)!r})"
        alternative = "" if caller else f", or build the config with {owner}.from_hf(...)"
        raise CheckpointError(f"{who}: no {CONFIG_FILE} in {where}; {GET_A_FOLDER}{alternative}")
    return config, folder.resolve().name


DTYPE_KEYS = ("dtype", "torch_dtype")
"""Where a `config.json` names the dtype its weights were saved in (transformers 5 writes
`dtype`; earlier versions `torch_dtype`)."""


def checkpoint_dtype(config: Mapping[str, Any], where: str) -> str | None:
    """The float dtype a checkpoint's `config.json` (`config`, read from `where`) says its
    weights are in (`DTYPE_KEYS`: "bfloat16", "float16", "float32", "float64", or
    "torch.bfloat16" as some writers spell it), canonical; None when it names none (or
    "auto"). `CheckpointError` naming the key, the value and the float dtypes einpage
    plans in when it names another (int8, float8, ...): planning such a checkpoint in a
    dtype it was not saved in would silently change its memory and its numbers.

    >>> checkpoint_dtype({"dtype": "bfloat16"}, "config.json")
    'bfloat16'
    >>> checkpoint_dtype({"torch_dtype": "torch.float16"}, "config.json")
    'float16'
    """
    for key in DTYPE_KEYS:
        value = config.get(key)
        if value is None or value == "auto":
            continue
        name = value.removeprefix("torch.") if isinstance(value, str) else value
        if isinstance(name, str) and name in dtypes.TABLE and dtypes.is_float(name):
            return name
        raise CheckpointError(
            f"{where}: {key} is {value!r}, which einpage does not plan in; it plans in "
            f"{', '.join(dtypes.FLOAT_DTYPES)} (give one as --dtype / dtype=)"
        )
    return None


def _read_bf16(file: Path, key: str) -> np.ndarray:
    """Read the bfloat16 tensor `key` of a safetensors file as a bfloat16 array, from the
    file's header and bytes (safetensors' NumPy framework does not know bfloat16)."""
    try:
        with open(file, "rb") as f:
            header_size = int.from_bytes(f.read(8), "little")
            if not 0 < header_size <= HEADER_LIMIT:
                raise CheckpointError(f"{str(file)!r}: bad safetensors header size {header_size}")
            entry = json.loads(f.read(header_size))[key]
            begin, end = (int(x) for x in entry["data_offsets"])
            shape = tuple(int(d) for d in entry["shape"])
            count = int(np.prod(shape, dtype=np.int64))
            if entry["dtype"] != "BF16" or end - begin != 2 * count:
                raise CheckpointError(f"{str(file)!r}: the header of {key!r} is inconsistent")
            f.seek(8 + header_size + begin)
            raw = np.fromfile(f, dtype="<u2", count=count)
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise CheckpointError(
            f"cannot read bfloat16 tensor {key!r} from {str(file)!r}: {err}"
        ) from None
    if raw.size != count:
        raise CheckpointError(f"{str(file)!r}: tensor {key!r} is truncated")
    return raw.view(dtypes.numpy_dtype("bfloat16")).reshape(shape)
