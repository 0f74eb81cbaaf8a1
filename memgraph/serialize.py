"""MemGraph JSON: writing, and loading with validation.

Schema (version 1)::

    {
      "format": "einpage.memgraph",
      "version": 1,
      "budget": 4194304,
      "alignment": 256,
      "taskgraph": { ... the TaskGraph document (taskgraph.serialize) ... },
      "nodes": [
        {"id": 0, "kind": "input", "deps": [], "tensor": 1, "storage": 0, "name": "w"},
        {"id": 1, "kind": "alloc", "deps": [], "tensor": 1, "region": [0, 2048]},
        {"id": 2, "kind": "reload", "deps": [0, 1], "tensor": 1, "storage": 0,
         "region": [0, 2048]},
        {"id": 3, "kind": "apply", "deps": [2], "tensor": 2, "region": [2048, 256],
         "reads": [[0, 2048]]},
        ...
      ],
      "info": { ... what the planner recorded: options, counters ... }
    }

A region is `[offset, size]` in bytes. Keys by kind: every node has `id` (its
position), `kind`, `deps` (earlier ids) and `tensor` (a task id); `region` for
alloc, apply, offload, reload, free and device-side input/output; `storage` (a host
storage id) for offload, reload and host-side input/output; `reads` for apply;
`name` for input and output; `into` (a task id) for a sliced offload into an output
assembled on the host. Keys a kind does not use are omitted.

The document is enough for a separate program to check (`memgraph.verify`) or run
(`runtime.run`) the plan. Loading validates structure and types and names the JSON
path of the first problem; it does not judge the plan (that is `verify`'s job).
"""

from __future__ import annotations

import json
from typing import Any

from einpage_core.errors import SerializationError
from memgraph.graph import MemGraph
from memgraph.nodes import MemNode, NodeKind, Region
from taskgraph.serialize import taskgraph_from_dict, taskgraph_to_dict

__all__ = [
    "FORMAT",
    "VERSION",
    "memgraph_to_dict",
    "memgraph_from_dict",
    "memgraph_to_json",
    "memgraph_from_json",
]

FORMAT = "einpage.memgraph"
VERSION = 1

_KEYS: dict[NodeKind, tuple[set[str], set[str]]] = {
    # kind: (required keys beyond id/kind/deps/tensor, optional keys)
    NodeKind.INPUT: ({"name"}, {"region", "storage"}),
    NodeKind.ALLOC: ({"region"}, set()),
    NodeKind.APPLY: ({"region", "reads"}, set()),
    NodeKind.OFFLOAD: ({"region", "storage"}, {"into"}),
    NodeKind.RELOAD: ({"region", "storage"}, set()),
    NodeKind.FREE: ({"region"}, set()),
    NodeKind.OUTPUT: ({"name"}, {"region", "storage"}),
}
_COMMON = {"id", "kind", "deps", "tensor"}


def _node_to_dict(node: MemNode) -> dict[str, Any]:
    data: dict[str, Any] = {
        "id": node.id,
        "kind": node.kind.value,
        "deps": list(node.deps),
        "tensor": node.tensor,
    }
    if node.region is not None:
        data["region"] = [node.region.offset, node.region.size]
    if node.storage is not None:
        data["storage"] = node.storage
    if node.kind is NodeKind.APPLY:
        data["reads"] = [[r.offset, r.size] for r in node.reads]
    if node.kind in (NodeKind.INPUT, NodeKind.OUTPUT):
        data["name"] = node.name
    if node.into is not None:
        data["into"] = node.into
    return data


def memgraph_to_dict(mg: MemGraph) -> dict[str, Any]:
    return {
        "format": FORMAT,
        "version": VERSION,
        "budget": mg.budget,
        "alignment": mg.alignment,
        "taskgraph": taskgraph_to_dict(mg.taskgraph),
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


def _region(value: Any, path: str) -> Region:
    if not isinstance(value, list) or len(value) != 2:
        raise _fail(path, f"expected [offset, size], got {value!r}")
    return Region(_int(value[0], f"{path}[0]"), _int(value[1], f"{path}[1]", 1))


def memgraph_from_dict(data: Any) -> MemGraph:
    """Validate a decoded JSON document and rebuild the MemGraph it describes."""
    if not isinstance(data, dict):
        raise _fail("$", "expected an object")
    if data.get("format") != FORMAT:
        raise _fail("$.format", f"expected {FORMAT!r}")
    if data.get("version") != VERSION:
        raise _fail("$.version", f"expected {VERSION}")
    budget = _int(data.get("budget"), "$.budget", 1)
    alignment = _int(data.get("alignment"), "$.alignment", 1)
    info = data.get("info", {})
    if not isinstance(info, dict):
        raise _fail("$.info", "expected an object")
    if "taskgraph" not in data:
        raise _fail("$.taskgraph", "missing")
    tg = taskgraph_from_dict(data["taskgraph"], "$.taskgraph")
    entries = data.get("nodes")
    if not isinstance(entries, list):
        raise _fail("$.nodes", "expected a list")
    nodes = []
    for position, entry in enumerate(entries):
        path = f"$.nodes[{position}]"
        if not isinstance(entry, dict):
            raise _fail(path, "expected an object")
        try:
            kind = NodeKind(entry.get("kind"))
        except ValueError:
            valid = ", ".join(k.value for k in NodeKind)
            raise _fail(
                f"{path}.kind", f"unknown kind {entry.get('kind')!r}; valid: {valid}"
            ) from None
        required, optional = _KEYS[kind]
        missing = (_COMMON | required) - entry.keys()
        if missing:
            raise _fail(path, f"{kind} node is missing key(s) {sorted(missing)}")
        unknown = entry.keys() - _COMMON - required - optional
        if unknown:
            raise _fail(path, f"{kind} node has unknown key(s) {sorted(unknown)}")
        if entry["id"] != position:
            raise _fail(f"{path}.id", f"expected {position} (ids are positions)")
        deps = entry["deps"]
        if not isinstance(deps, list):
            raise _fail(f"{path}.deps", "expected a list of node ids")
        for k, dep in enumerate(deps):
            if _int(dep, f"{path}.deps[{k}]") >= position:
                raise _fail(f"{path}.deps[{k}]", f"n{dep} is not an earlier node")
        tensor = _int(entry["tensor"], f"{path}.tensor")
        if tensor >= len(tg):
            raise _fail(f"{path}.tensor", f"%{tensor} is not a task of the TaskGraph")
        region = _region(entry["region"], f"{path}.region") if "region" in entry else None
        storage = _int(entry["storage"], f"{path}.storage") if "storage" in entry else None
        if kind in (NodeKind.INPUT, NodeKind.OUTPUT) and (region is None) == (storage is None):
            raise _fail(path, f"{kind} node needs exactly one of 'region' and 'storage'")
        reads = entry.get("reads", [])
        if not isinstance(reads, list):
            raise _fail(f"{path}.reads", "expected a list of regions")
        name = entry.get("name", "")
        if not isinstance(name, str):
            raise _fail(f"{path}.name", "expected a string")
        into = _int(entry["into"], f"{path}.into") if "into" in entry else None
        if into is not None and into >= len(tg):
            raise _fail(f"{path}.into", f"%{into} is not a task of the TaskGraph")
        nodes.append(
            MemNode(
                position,
                kind,
                tuple(sorted(set(deps))),
                tensor,
                region,
                storage,
                tuple(_region(r, f"{path}.reads[{k}]") for k, r in enumerate(reads)),
                name,
                into,
            )
        )
    return MemGraph(tg, tuple(nodes), budget, alignment, info)
