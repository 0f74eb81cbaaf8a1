"""Which files a safetensors checkpoint has (`checkpoint_files`): one file, a folder with
`model.safetensors`, or a sharded folder whose `model.safetensors.index.json` maps each
tensor to its shard – the index validated (the shape of the JSON, shard names that stay
inside the folder, shards that exist) before any shard is opened.

Shared by the model loaders (`einpage.models.checkpoint`) and the weights a plan reads
where they are (`einpage.pipeline.weight_files`), so it sits in the room before both.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from einpage.errors import CheckpointError

__all__ = ["INDEX_FILE", "SINGLE_FILE", "HEADER_LIMIT", "checkpoint_files", "load_json"]

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
HEADER_LIMIT = 100 * 2**20
"""The largest safetensors header read (safetensors caps headers at 100 MB)."""


def load_json(file: Path) -> Any:
    try:
        return json.loads(file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError) as err:
        raise CheckpointError(f"cannot read {str(file)!r}: {err}") from None
    except json.JSONDecodeError as err:
        raise CheckpointError(
            f"{str(file)!r} is not valid JSON: {err.msg} at line {err.lineno} column {err.colno}"
        ) from None


def checkpoint_files(path: Path) -> dict[str, Path]:
    """Every tensor key of the checkpoint at `path`, mapped to the file that holds it.

    A directory with `model.safetensors` is read as one file (as `from_pretrained`
    prefers it); otherwise `model.safetensors.index.json` lists the shards.
    """
    if path.is_file():
        return dict.fromkeys(_file_keys(path), path)
    if not path.is_dir():
        raise CheckpointError(f"checkpoint path {str(path)!r} does not exist")
    single, index = path / SINGLE_FILE, path / INDEX_FILE
    if single.is_file():
        return dict.fromkeys(_file_keys(single), single)
    if index.is_file():
        return _index_files(index)
    present = sorted(p.name for p in path.iterdir())[:10]
    raise CheckpointError(
        f"checkpoint directory {str(path)!r} has neither {SINGLE_FILE} nor {INDEX_FILE} "
        f"(it holds: {', '.join(present) or 'nothing'})"
    )


def _file_keys(file: Path) -> list[str]:
    from safetensors import safe_open

    try:
        with safe_open(str(file), framework="numpy") as handle:
            return list(handle.keys())
    except Exception as err:  # safetensors raises its own error types
        raise CheckpointError(f"cannot open safetensors file {str(file)!r}: {err}") from None


def _index_files(index: Path) -> dict[str, Path]:
    """Validate a sharded checkpoint's index and map each key to its shard's path."""
    data = load_json(index)
    where = str(index)
    if not isinstance(data, dict):
        raise CheckpointError(f"{where!r}: expected a JSON object, got {type(data).__name__}")
    if not isinstance(data.get("metadata", {}), dict | type(None)):
        raise CheckpointError(f"{where!r}: 'metadata' must be an object")
    weight_map = data.get("weight_map")
    if not isinstance(weight_map, dict):
        raise CheckpointError(
            f"{where!r}: 'weight_map' must be an object mapping tensor names to shard files, "
            f"got {type(weight_map).__name__}"
        )
    if not weight_map:
        raise CheckpointError(f"{where!r}: 'weight_map' is empty")
    files: dict[str, Path] = {}
    for key, shard in weight_map.items():
        if not isinstance(shard, str):
            raise CheckpointError(
                f"{where!r}: weight_map[{key!r}] must be a file name, got {shard!r}"
            )
        plain = shard not in ("", ".", "..") and "/" not in shard and "\\" not in shard
        if not plain or not shard.endswith(".safetensors"):
            raise CheckpointError(
                f"{where!r}: weight_map[{key!r}] = {shard!r} is not the name of a .safetensors "
                "file in the checkpoint directory (paths are not allowed)"
            )
        file = index.parent / shard
        if not file.is_file():
            raise CheckpointError(
                f"{where!r}: weight_map[{key!r}] names shard {shard!r}, which does not exist"
            )
        files[key] = file
    return files
