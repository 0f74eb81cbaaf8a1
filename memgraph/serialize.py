"""MemGraph JSON: writing, and loading with validation.

Schema (version 2)::

    {
      "format": "einpage.memgraph",
      "version": 2,
      "budget": 4194304,
      "alignment": 256,
      "taskgraph": { ... the TaskGraph document (taskgraph.serialize) ... },
      "storages": [
        {"id": 0, "shape": [64, 8], "dtype": "float32", "nbytes": 2048, "tensor": 0,
         "kind": "input"},
        ...
      ],
      "nodes": [
        {"id": 0, "kind": "input", "deps": [], "tensor": 0, "storage": 0, "name": "w"},
        {"id": 1, "kind": "alloc", "deps": [], "tensor": 1, "region": [0, 256]},
        {"id": 2, "kind": "reload", "deps": [0, 1], "tensor": 1, "storage": 0,
         "region": [0, 256], "box": {"starts": [16, 0], "sizes": [8, 8]}},
        {"id": 3, "kind": "apply", "deps": [2], "tensor": 2, "region": [256, 256],
         "reads": [[0, 256]]},
        ...
      ],
      "info": { ... what the planner recorded: options, counters ... }
    }

`storages` lists every host storage of the plan (`memgraph.nodes.HostStorage`), by
increasing id: `shape` and `dtype` of its C-contiguous array, `nbytes` its size in
bytes (the product of the shape times the dtype's item size), `tensor` the task it
holds, and `kind` what fills it: "input" (a program input, placed before the run),
"offload" (an offload copies `tensor` there whole) or "assembly" (sliced offloads
write the boxes of output `tensor`, assembled on the host).

A region is `[offset, size]` in bytes. Keys by kind (`memgraph.nodes.NODE_FIELDS`):
every node has `id` (its position), `kind`, `deps` (earlier ids) and `tensor` (a task
id); `region` for alloc, apply, offload, reload, free and device-side input/output;
`storage` (a host storage id) for offload, reload and host-side input/output; `reads`
for apply; `name` for input and output; `into` (a task id) for a sliced offload into
an output assembled on the host; `box` for a sliced offload or reload: the box of the
storage's array it copies, one start and one size per axis of the storage (its shape
and dtype are the storage's); an offload or reload without `box` copies its whole
storage. Keys a kind does not use are omitted.

Version 1 documents (before `storages` and `box`) are still read: their storages and
boxes are worked out from the nodes and the TaskGraph, as the builder does.

The document is enough for a separate program to check (`memgraph.verify`) or run
(`runtime.run`) the plan. Loading validates structure and types and names the JSON
path of the first problem; it does not judge the plan (that is `verify`'s job).
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from einpage_core.errors import SerializationError
from memgraph.graph import HostFacts, MemGraph
from memgraph.nodes import (
    FIELDS,
    NODE_FIELDS,
    STORAGE_KINDS,
    HostBox,
    HostStorage,
    MemNode,
    NodeKind,
    Region,
)
from taskgraph.dtypes import DTYPES
from taskgraph.graph import TaskGraph
from taskgraph.serialize import taskgraph_from_dict, taskgraph_to_dict

__all__ = [
    "FORMAT",
    "VERSION",
    "READABLE_VERSIONS",
    "memgraph_to_dict",
    "memgraph_from_dict",
    "memgraph_to_json",
    "memgraph_from_json",
]

FORMAT = "einpage.memgraph"
VERSION = 2
READABLE_VERSIONS = (1, 2)
"""Versions `memgraph_from_dict` reads (1: without storages and boxes, worked out on load)."""

_COMMON = {"id", "kind", "deps", "tensor"}
_STORAGE_KEYS = {"id", "shape", "dtype", "nbytes", "tensor", "kind"}


def _node_to_dict(node: MemNode) -> dict[str, Any]:
    data: dict[str, Any] = {
        "id": node.id,
        "kind": node.kind.value,
        "deps": list(node.deps),
        "tensor": node.tensor,
    }
    spec = NODE_FIELDS[node.kind]
    present = node.fields_set() | set(spec.required)
    for name in FIELDS:  # a fixed order: documents are byte-for-byte deterministic
        if name not in present or name not in spec.allowed:
            continue
        value = getattr(node, name)
        if name == "region":
            data[name] = [value.offset, value.size]
        elif name == "reads":
            data[name] = [[r.offset, r.size] for r in value]
        elif name == "box":
            data[name] = {"starts": list(value.starts), "sizes": list(value.sizes)}
        else:
            data[name] = value
    return data


def _storage_to_dict(storage: HostStorage) -> dict[str, Any]:
    return {
        "id": storage.id,
        "shape": list(storage.shape),
        "dtype": storage.dtype,
        "nbytes": storage.nbytes,
        "tensor": storage.tensor,
        "kind": storage.kind,
    }


def memgraph_to_dict(mg: MemGraph) -> dict[str, Any]:
    return {
        "format": FORMAT,
        "version": VERSION,
        "budget": mg.budget,
        "alignment": mg.alignment,
        "taskgraph": taskgraph_to_dict(mg.taskgraph),
        "storages": [_storage_to_dict(s) for s in mg.storages.values()],
        "nodes": [_node_to_dict(n) for n in mg.nodes],
        "info": dict(mg.info),
    }


def memgraph_to_json(mg: MemGraph, indent: int | None = None) -> str:
    return json.dumps(memgraph_to_dict(mg), indent=indent, allow_nan=False)


def memgraph_from_json(text: str | bytes) -> MemGraph:
    try:
        data = json.loads(text)
    except (json.JSONDecodeError, UnicodeDecodeError, TypeError) as err:
        raise SerializationError(f"not valid JSON: {err}") from None
    return memgraph_from_dict(data)


def _fail(path: str, message: str) -> SerializationError:
    return SerializationError(f"{path}: {message}")


def _int(value: Any, path: str, minimum: int = 0) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise _fail(path, f"expected an integer >= {minimum}, got {value!r}")
    return value


def _ints(value: Any, path: str, minimum: int = 0) -> tuple[int, ...]:
    if not isinstance(value, list):
        raise _fail(path, f"expected a list of integers, got {value!r}")
    return tuple(_int(v, f"{path}[{k}]", minimum) for k, v in enumerate(value))


def _task(value: Any, path: str, tg: TaskGraph) -> int:
    task = _int(value, path)
    if task >= len(tg):
        raise _fail(path, f"%{task} is not a task of the TaskGraph")
    return task


def _region(value: Any, path: str) -> Region:
    if not isinstance(value, list) or len(value) != 2:
        raise _fail(path, f"expected [offset, size], got {value!r}")
    return Region(_int(value[0], f"{path}[0]"), _int(value[1], f"{path}[1]", 1))


def _object(value: Any, path: str, keys: set[str]) -> dict[str, Any]:
    """`value` as an object with exactly `keys`."""
    if not isinstance(value, dict):
        raise _fail(path, "expected an object")
    missing, unknown = keys - value.keys(), value.keys() - keys
    if missing:
        raise _fail(path, f"missing key(s) {sorted(missing)}")
    if unknown:
        raise _fail(path, f"unknown key(s) {sorted(unknown)}")
    return value


def _storages(value: Any, tg: TaskGraph) -> dict[int, HostStorage]:
    if not isinstance(value, list):
        raise _fail("$.storages", "expected a list")
    table: dict[int, HostStorage] = {}
    for position, entry in enumerate(value):
        path = f"$.storages[{position}]"
        entry = _object(entry, path, _STORAGE_KEYS)
        sid = _int(entry["id"], f"{path}.id")
        if sid in table:
            raise _fail(f"{path}.id", f"host#{sid} is listed twice")
        if entry["dtype"] not in DTYPES:
            raise _fail(f"{path}.dtype", f"expected one of {', '.join(DTYPES)}")
        if entry["kind"] not in STORAGE_KINDS:
            raise _fail(f"{path}.kind", f"expected one of {', '.join(STORAGE_KINDS)}")
        table[sid] = HostStorage(
            sid,
            _ints(entry["shape"], f"{path}.shape"),
            entry["dtype"],
            _int(entry["nbytes"], f"{path}.nbytes"),
            _task(entry["tensor"], f"{path}.tensor", tg),
            entry["kind"],
        )
    return table


def _box(value: Any, path: str, storage: HostStorage | None) -> HostBox:
    entry = _object(value, path, {"starts", "sizes"})
    if storage is None:
        raise _fail(path, "a box of a storage that is not in $.storages")
    return HostBox(
        storage.shape,
        storage.dtype,
        _ints(entry["starts"], f"{path}.starts"),
        _ints(entry["sizes"], f"{path}.sizes", 1),
    )


def _kind(entry: Any, path: str) -> NodeKind:
    if not isinstance(entry, dict):
        raise _fail(path, "expected an object")
    try:
        return NodeKind(entry.get("kind"))
    except ValueError:
        valid = ", ".join(k.value for k in NodeKind)
        raise _fail(f"{path}.kind", f"unknown kind {entry.get('kind')!r}; valid: {valid}") from None


def _check_keys(entry: dict[str, Any], kind: NodeKind, path: str) -> None:
    """The keys `NODE_FIELDS` declares for `kind`: required ones present, no others."""
    spec = NODE_FIELDS[kind]
    missing = (_COMMON | set(spec.required)) - entry.keys()
    if missing:
        raise _fail(path, f"{kind} node is missing key(s) {sorted(missing)}")
    unknown = entry.keys() - _COMMON - spec.allowed
    if unknown:
        raise _fail(path, f"{kind} node has unknown key(s) {sorted(unknown)}")
    if spec.one_of and len(entry.keys() & set(spec.one_of)) != 1:
        choices = " and ".join(repr(f) for f in sorted(spec.one_of))
        raise _fail(path, f"{kind} node needs exactly one of {choices}")


def _node(
    entry: Any, position: int, tg: TaskGraph, storages: dict[int, HostStorage] | None
) -> MemNode:
    """One node document, validated (`storages` is None for version 1: no boxes)."""
    path = f"$.nodes[{position}]"
    kind = _kind(entry, path)
    _check_keys(entry, kind, path)
    if entry["id"] != position:
        raise _fail(f"{path}.id", f"expected {position} (ids are positions)")
    deps = entry["deps"]
    if not isinstance(deps, list):
        raise _fail(f"{path}.deps", "expected a list of node ids")
    for k, dep in enumerate(deps):
        if _int(dep, f"{path}.deps[{k}]") >= position:
            raise _fail(f"{path}.deps[{k}]", f"n{dep} is not an earlier node")
    tensor = _task(entry["tensor"], f"{path}.tensor", tg)
    region = _region(entry["region"], f"{path}.region") if "region" in entry else None
    storage = _int(entry["storage"], f"{path}.storage") if "storage" in entry else None
    reads = entry.get("reads", [])
    if not isinstance(reads, list):
        raise _fail(f"{path}.reads", "expected a list of regions")
    name = entry.get("name", "")
    if not isinstance(name, str):
        raise _fail(f"{path}.name", "expected a string")
    into = _task(entry["into"], f"{path}.into", tg) if "into" in entry else None
    box = None
    if "box" in entry:
        held = storages.get(storage) if storages is not None and storage is not None else None
        box = _box(entry["box"], f"{path}.box", held)
    return MemNode(
        position,
        kind,
        tuple(sorted(set(deps))),
        tensor,
        region,
        storage,
        tuple(_region(r, f"{path}.reads[{k}]") for k, r in enumerate(reads)),
        name,
        into,
        box,
    )


def _with_boxes(tg: TaskGraph, nodes: list[MemNode]) -> list[MemNode]:
    """Version 1 nodes with the boxes the builder would have given them."""
    facts = HostFacts(tg)
    boxed = []
    for node in nodes:
        facts.see(node.kind, node.tensor, node.storage, node.into)
        box = facts.box(node.kind, node.tensor, node.storage, node.into)
        boxed.append(dataclasses.replace(node, box=box) if box is not None else node)
    return boxed


def memgraph_from_dict(data: Any) -> MemGraph:
    """Validate a decoded JSON document and rebuild the MemGraph it describes."""
    if not isinstance(data, dict):
        raise _fail("$", "expected an object")
    if data.get("format") != FORMAT:
        raise _fail("$.format", f"expected {FORMAT!r}")
    version = data.get("version")
    if isinstance(version, bool) or version not in READABLE_VERSIONS:
        raise _fail("$.version", f"expected {VERSION} (or 1, which is still read)")
    budget = _int(data.get("budget"), "$.budget", 1)
    alignment = _int(data.get("alignment"), "$.alignment", 1)
    info = data.get("info", {})
    if not isinstance(info, dict):
        raise _fail("$.info", "expected an object")
    if "taskgraph" not in data:
        raise _fail("$.taskgraph", "missing")
    tg = taskgraph_from_dict(data["taskgraph"], "$.taskgraph")
    storages = None
    if version >= 2:
        if "storages" not in data:
            raise _fail("$.storages", "missing")
        storages = _storages(data["storages"], tg)
    entries = data.get("nodes")
    if not isinstance(entries, list):
        raise _fail("$.nodes", "expected a list")
    nodes = [_node(entry, position, tg, storages) for position, entry in enumerate(entries)]
    if storages is None:
        nodes = _with_boxes(tg, nodes)
    return MemGraph(tg, tuple(nodes), budget, alignment, info, storages)
