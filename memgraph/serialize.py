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
storage; `workspace` (a region) for an apply whose task has a kernel workspace
(`Task.workspace`): transient, held for that apply only (absent otherwise, so plans
without workspaces are written as before); `recompute` (always `true` when present) for
an apply that computes its task again, its output having been dropped with no copy out
(absent otherwise: files written before recomputes load unchanged); `name`, `region`
and `link` (the index of a link of the plan for several devices) for a send or a receive
between devices. Keys a kind does not use are omitted.

Version 1 documents (before `storages` and `box`) are still read: their storages and
boxes are worked out from the nodes and the TaskGraph, as the builder does.

The document is enough for a separate program to check (`memgraph.verify`) or run
(`runtime.run`) the plan. Loading validates structure and types and names the JSON
path of the first problem; it does not judge the plan (that is `verify`'s job).

Plans of a million nodes are common (a 100 MB file), so both ways are built for speed
and report progress (`einpage_core.progress`). Writing (`write_memgraph_json`, and
`memgraph_to_json`) formats each node and task straight to text, in the exact bytes
`json.dumps(memgraph_to_dict(mg))` gives – files are what they were, and the same plan
gives the same bytes. Loading parses with the garbage collector paused (it otherwise
re-walks the millions of objects being made), tries each node and task first with quick
checks that accept only what the full checks accept (the full ones, which name the JSON
path of a problem, run where the quick ones fail), and makes each distinct op once.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Iterator
from itertools import chain, combinations
from typing import Any

from einpage_core.errors import SerializationError
from einpage_core.progress import ProgressCallback, ProgressReport, Tick, ticks
from memgraph.graph import HostFacts, MemGraph
from memgraph.nodes import (
    DISK_FILE_KINDS,
    FIELDS,
    NODE_FIELDS,
    STORAGE_KINDS,
    DiskFile,
    DiskPlace,
    HostBox,
    HostRegion,
    HostStorage,
    HostTier,
    MemNode,
    NodeKind,
    Region,
)
from taskgraph import dtypes
from taskgraph.dtypes import DTYPES
from taskgraph.graph import TaskGraph
from taskgraph.serialize import (
    ENCODER,
    Quoted,
    collector_paused,
    int_list,
    joined_chunks,
    parse_json,
    taskgraph_from_dict,
    taskgraph_json_chunks,
    taskgraph_to_dict,
)

__all__ = [
    "FORMAT",
    "VERSION",
    "READABLE_VERSIONS",
    "memgraph_to_dict",
    "memgraph_from_dict",
    "memgraph_to_json",
    "memgraph_from_json",
    "write_memgraph_json",
    "SAVE_SHARES",
    "LOAD_SHARES",
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
        if name in ("region", "workspace", "slot"):
            data[name] = [value.offset, value.size]
        elif name == "reads":
            data[name] = [[r.offset, r.size] for r in value]
        elif name == "box":
            data[name] = {"starts": list(value.starts), "sizes": list(value.sizes)}
        else:
            data[name] = value
    return data


def _storage_to_dict(storage: HostStorage) -> dict[str, Any]:
    data = {
        "id": storage.id,
        "shape": list(storage.shape),
        "dtype": storage.dtype,
        "nbytes": storage.nbytes,
        "tensor": storage.tensor,
        "kind": storage.kind,
    }
    place = storage.disk
    if place is not None:  # [file, offset], and [rows, cols] only when transposed
        data["disk"] = [place.file, place.offset]
        if place.transposed is not None:
            data["disk"].append(list(place.transposed))
    return data


def _tier_to_dict(tier: HostTier) -> dict[str, Any]:
    files = []
    for f in tier.files:
        entry: dict[str, Any] = {"kind": f.kind, "nbytes": f.nbytes, "path": f.path}
        if f.head:
            entry["head"] = [f.head, f.head_sha256]
        files.append(entry)
    return {"budget": tier.budget, "files": files}


def memgraph_to_dict(mg: MemGraph) -> dict[str, Any]:
    data = {
        "format": FORMAT,
        "version": VERSION,
        "budget": mg.budget,
        "alignment": mg.alignment,
        "taskgraph": taskgraph_to_dict(mg.taskgraph),
        "storages": [_storage_to_dict(s) for s in mg.storages.values()],
        "nodes": [_node_to_dict(n) for n in mg.nodes],
        "info": dict(mg.info),
    }
    if mg.tier is not None:
        data["tier"] = _tier_to_dict(mg.tier)
    return data


def memgraph_to_json(mg: MemGraph, indent: int | None = None) -> str:
    """The plan as JSON text: `json.dumps(memgraph_to_dict(mg))`, byte for byte, written
    without building the dicts first (with an `indent`, through the dicts)."""
    if indent is not None:
        return json.dumps(memgraph_to_dict(mg), indent=indent, allow_nan=False)
    return "".join(memgraph_json_chunks(mg))


SAVE_SHARES = {"writing tasks": 1.0, "writing nodes": 1.0}
"""The stages of `write_memgraph_json` and their shares of its progress, as measured on a
100 MB plan: 1.1 s for its 100,077 tasks, 1.2 s for its 594,387 nodes."""


def write_memgraph_json(
    mg: MemGraph, stream: Any, progress: ProgressCallback | None = None
) -> None:
    """Write `memgraph_to_json(mg)` to the text `stream` piece by piece (nothing the size
    of the file is held in memory), reporting `Progress` events to `progress`: stages
    "writing tasks" and "writing nodes", a fraction that only grows, and "done" at 1.0."""
    report = ProgressReport(progress, SAVE_SHARES)
    for chunk in memgraph_json_chunks(
        mg,
        report.stage("writing tasks", len(mg.taskgraph)),
        lambda: report.stage("writing nodes", len(mg)),
    ):
        stream.write(chunk)
    report.finish()


def memgraph_json_chunks(
    mg: MemGraph,
    task_tick: Tick | None = None,
    node_tick: Callable[[], Tick] | None = None,
) -> Iterator[str]:
    """`memgraph_to_json(mg)` in pieces of about a hundredth of the tasks or nodes each.

    The text is that of `json.dumps(memgraph_to_dict(mg))` – the same keys in the same
    order, the same separators and escapes – so plan files stay byte for byte what they
    were; each node is formatted straight to text from `NODE_FIELDS` instead of making
    its dict and encoding that, several times faster. `task_tick(done, total)` is called
    as tasks are written; `node_tick()`, when the nodes begin, gives theirs.
    """
    quoted = Quoted()
    yield (
        f'{{"format": {quoted[FORMAT]}, "version": {VERSION}, "budget": {mg.budget}, '
        f'"alignment": {mg.alignment}, "taskgraph": '
    )
    yield from taskgraph_json_chunks(mg.taskgraph, task_tick)
    storages = ", ".join(ENCODER.encode(_storage_to_dict(s)) for s in mg.storages.values())
    yield f', "storages": [{storages}], "nodes": ['
    kinds = {kind: _NodeFormat(kind, quoted) for kind in NodeKind}
    tick = node_tick() if node_tick is not None else None
    yield from joined_chunks(mg.nodes, lambda node: kinds[node.kind].text(node), tick)
    tier = "" if mg.tier is None else f', "tier": {ENCODER.encode(_tier_to_dict(mg.tier))}'
    yield f'], "info": {ENCODER.encode(dict(mg.info))}{tier}}}'


def _region_text(region: Region) -> str:
    return f"[{region.offset}, {region.size}]"


_FIELD_TEXT: dict[str, Callable[[Any, Quoted], str]] = {
    "region": lambda region, quoted: _region_text(region),
    "storage": lambda storage, quoted: str(storage),
    "reads": lambda reads, quoted: "[" + ", ".join(map(_region_text, reads)) + "]",
    "name": lambda name, quoted: quoted[name],
    "into": lambda into, quoted: str(into),
    "box": lambda box, quoted: (
        f'{{"starts": {int_list(box.starts)}, "sizes": {int_list(box.sizes)}}}'
    ),
    "workspace": lambda region, quoted: _region_text(region),
    "recompute": lambda recompute, quoted: "true",
    "link": lambda link, quoted: str(link),
    "slot": lambda slot, quoted: _region_text(slot),
}
"""Each optional node field's value as JSON text, as `_node_to_dict` puts it."""

_UNSET: dict[str, Any] = {
    "region": None,
    "storage": None,
    "reads": (),
    "name": "",
    "into": None,
    "box": None,
    "workspace": None,
    "recompute": False,
    "link": None,
    "slot": None,
}
"""Each optional field's value when a node does not set it (`MemNode.fields_set`)."""


class _NodeFormat:
    """How nodes of one kind are written: `_node_to_dict`'s keys in its order (the
    common ones, then the fields of `FIELDS` the kind allows, required ones always and
    optional ones when set), as text."""

    def __init__(self, kind: NodeKind, quoted: Quoted):
        spec = NODE_FIELDS[kind]
        self.quoted = quoted
        self.kind = quoted[kind.value]
        self.fields = [
            (name, f', "{name}": ', name in spec.required, _FIELD_TEXT[name])
            for name in FIELDS
            if name in spec.allowed
        ]

    def text(self, node: MemNode) -> str:
        tensor = "null" if node.tensor is None else node.tensor
        text = f'{{"id": {node.id}, "kind": {self.kind}, "deps": {int_list(node.deps)}, '
        text += f'"tensor": {tensor}'
        for name, key, required, value_text in self.fields:
            value = getattr(node, name)
            if required or value != _UNSET[name]:
                text += key + value_text(value, self.quoted)
        return text + "}"


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


def _slot(value: Any, path: str) -> HostRegion:
    region = _region(value, path)
    return HostRegion(region.offset, region.size)


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
        entry = _object(entry, path, _STORAGE_KEYS | _present(entry, "disk"))
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
            _disk_place(entry["disk"], f"{path}.disk") if "disk" in entry else None,
        )
    return table


def _disk_place(value: Any, path: str) -> DiskPlace:
    """`[file, offset]`, or `[file, offset, [rows, cols]]` for a transposed place."""
    if not isinstance(value, list) or len(value) not in (2, 3):
        raise _fail(path, f"expected [file, offset] or [file, offset, [rows, cols]], got {value!r}")
    transposed = None
    if len(value) == 3:
        if not isinstance(value[2], list) or len(value[2]) != 2:
            raise _fail(f"{path}[2]", f"expected [rows, cols] (transposed), got {value[2]!r}")
        rows, cols = _ints(value[2], f"{path}[2]", 1)
        transposed = (rows, cols)
    return DiskPlace(_int(value[0], f"{path}[0]"), _int(value[1], f"{path}[1]"), transposed)


def _present(value: Any, key: str) -> set[str]:
    """{key} when `value` is an object that has the optional `key`, else nothing."""
    return {key} if isinstance(value, dict) and key in value else set()


def _head(value: Any, path: str, kind: str) -> tuple[int, str]:
    """A checkpoint's `[bytes, sha256 hex]` of its head, or (0, "") when absent."""
    if value is None:
        return 0, ""
    if kind != "checkpoint" or not isinstance(value, list) or len(value) != 2:
        raise _fail(path, "expected [bytes, sha256 hex] on a checkpoint")
    digest = value[1]
    if not isinstance(digest, str) or len(digest) != 64 or set(digest) - set("0123456789abcdef"):
        raise _fail(f"{path}[1]", "expected 64 lowercase hex digits")
    return _int(value[0], f"{path}[0]", 1), digest


def _tier(value: Any, storages: dict[int, HostStorage] | None) -> HostTier:
    """The `tier` document: the host budget and the files, each storage's place in one."""
    entry = _object(value, "$.tier", {"budget", "files"})
    budget = _int(entry["budget"], "$.tier.budget", 1)
    if not isinstance(entry["files"], list):
        raise _fail("$.tier.files", "expected a list")
    files = []
    for k, item in enumerate(entry["files"]):
        path = f"$.tier.files[{k}]"
        item = _object(item, path, {"kind", "nbytes", "path"} | _present(item, "head"))
        if item["kind"] not in DISK_FILE_KINDS:
            raise _fail(f"{path}.kind", f"expected one of {', '.join(DISK_FILE_KINDS)}")
        if not isinstance(item["path"], str) or (item["kind"] == "checkpoint") != bool(
            item["path"]
        ):
            raise _fail(f"{path}.path", "expected a checkpoint's path, or \"\" for the spill file")
        head, digest = _head(item.get("head"), f"{path}.head", item["kind"])
        nbytes = _int(item["nbytes"], f"{path}.nbytes")
        files.append(DiskFile(item["kind"], nbytes, item["path"], head, digest))
    for storage in (storages or {}).values():
        place = storage.disk
        if place is not None and (
            place.file >= len(files) or place.offset + storage.nbytes > files[place.file].nbytes
        ):
            raise _fail(
                f"$.storages (host#{storage.id}).disk",
                f"{place} ({storage.nbytes} bytes) is not inside a file of $.tier.files",
            )
        if place is not None and place.transposed is not None:
            rows, cols = place.transposed
            matrix = rows * cols * dtypes.itemsize(storage.dtype)
            if matrix != storage.nbytes:
                raise _fail(
                    f"$.storages (host#{storage.id}).disk[2]",
                    f"a transposed ({rows}, {cols}) matrix of {storage.dtype} is {matrix} bytes,"
                    f" the storage {storage.nbytes}",
                )
    return HostTier(budget, tuple(files))


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
    workspace = None
    if "workspace" in entry:
        workspace = _region(entry["workspace"], f"{path}.workspace")
    if "recompute" in entry and entry["recompute"] is not True:
        raise _fail(f"{path}.recompute", f"expected true (or no key), got {entry['recompute']!r}")
    link = _int(entry["link"], f"{path}.link") if "link" in entry else None
    slot = _slot(entry["slot"], f"{path}.slot") if "slot" in entry else None
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
        workspace,
        "recompute" in entry,
        link,
        slot,
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


LOAD_SHARES = {"reading": 2.0, "checking tasks": 3.0, "checking nodes": 3.0}
"""The stages of loading a plan and their shares of its progress: parsing the JSON text,
checking (rebuilding) the TaskGraph, checking the nodes; as measured on a 100 MB plan
(1.6 s, 2.5 s and 2.6 s)."""


def memgraph_from_json(text: str | bytes, progress: ProgressCallback | None = None) -> MemGraph:
    """Parse and validate a plan's JSON text (as `memgraph_from_dict`), reporting
    `Progress` events to `progress`: stages "reading", "checking tasks" and "checking
    nodes", a fraction that only grows, and "done" at 1.0."""
    report = ProgressReport(progress, LOAD_SHARES)
    report.stage("reading", 1)
    mg = _memgraph_from_dict(parse_json(text), report)
    report.finish()
    return mg


def memgraph_from_dict(
    data: Any, progress: ProgressCallback | None = None, *, device_part: bool = False
) -> MemGraph:
    """Validate a decoded JSON document and rebuild the MemGraph it describes (`progress`
    as `memgraph_from_json`'s, without the reading); `device_part`: the plan of one
    device of several, whose TaskGraph may have no output (`taskgraph_from_dict`)."""
    checking = {stage: share for stage, share in LOAD_SHARES.items() if stage != "reading"}
    report = ProgressReport(progress, checking)
    mg = _memgraph_from_dict(data, report, device_part)
    report.finish()
    return mg


def _memgraph_from_dict(data: Any, report: ProgressReport, device_part: bool = False) -> MemGraph:
    with collector_paused():  # see `collector_paused`: millions of objects, all kept
        return _memgraph_from_checked_dict(data, report, device_part)


def _memgraph_from_checked_dict(
    data: Any, report: ProgressReport, device_part: bool = False
) -> MemGraph:
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
    tasks = data["taskgraph"].get("tasks") if isinstance(data["taskgraph"], dict) else None
    tick = report.stage("checking tasks", len(tasks) if isinstance(tasks, list) else 0)
    tg = taskgraph_from_dict(data["taskgraph"], "$.taskgraph", tick, device_part=device_part)
    storages = None
    if version >= 2:
        if "storages" not in data:
            raise _fail("$.storages", "missing")
        storages = _storages(data["storages"], tg)
    entries = data.get("nodes")
    if not isinstance(entries, list):
        raise _fail("$.nodes", "expected a list")
    nodes = _nodes(entries, tg, storages, report.stage("checking nodes", len(entries)))
    if storages is None:
        nodes = _with_boxes(tg, nodes)
    tier = None
    if "tier" in data:
        tier = _tier(data["tier"], storages)
    elif storages is not None and any(s.disk is not None for s in storages.values()):
        raise _fail("$.tier", "missing, but storages have places on disk")
    return MemGraph(tg, tuple(nodes), budget, alignment, info, storages, tier)


def _nodes(
    entries: list[Any], tg: TaskGraph, storages: dict[int, HostStorage] | None, tick: Tick
) -> list[MemNode]:
    """The node documents `entries`, validated, as MemNodes; `tick(done, total)` about a
    hundred times. Each entry is first tried by `_quick_node`, which accepts only what
    `_node` accepts, without building a JSON path per check; what it does not accept,
    `_node` checks again, to name the first problem (or accept it after all)."""
    total = len(entries)
    every = ticks(total)
    tick(0, total)
    nodes = []
    tasks = len(tg)
    regions: dict[tuple[int, int], Region] = {}
    for position, entry in enumerate(entries):
        if position % every == 0 and position:
            tick(position, total)
        node = _quick_node(entry, position, tasks, storages, regions)
        nodes.append(node if node is not None else _node(entry, position, tg, storages))
    tick(total, total)
    return nodes


_KIND_OF = {kind.value: kind for kind in NodeKind}


def _key_sets(kind: NodeKind) -> frozenset[frozenset[str]]:
    """Every set of keys a node document of `kind` may have (what `_check_keys` passes)."""
    spec = NODE_FIELDS[kind]
    base = _COMMON | set(spec.required)
    optional = list(spec.optional)
    choices = [(name,) for name in spec.one_of] or [()]
    subsets = chain.from_iterable(combinations(optional, n) for n in range(len(optional) + 1))
    return frozenset(
        frozenset(base.union(subset, choice)) for subset in subsets for choice in choices
    )


_KEY_SETS = {kind: _key_sets(kind) for kind in NodeKind}


def _quick_ints(value: Any, minimum: int) -> bool:
    """Whether `value` is a list of ints (not bools) >= `minimum`."""
    return type(value) is list and all(type(v) is int and v >= minimum for v in value)


def _quick_region(value: Any, regions: dict[tuple[int, int], Region]) -> Region | None:
    """`value` as a Region when it is `[offset >= 0, size >= 1]`, else None; equal
    regions are one object (`regions`), as they are immutable."""
    if type(value) is not list or len(value) != 2:
        return None
    offset, size = value
    if type(offset) is not int or type(size) is not int or offset < 0 or size < 1:
        return None
    key = (offset, size)
    region = regions.get(key)
    if region is None:
        region = regions[key] = Region(offset, size)
    return region


def _quick_node(
    entry: Any,
    position: int,
    tasks: int,
    storages: dict[int, HostStorage] | None,
    regions: dict[tuple[int, int], Region],
) -> MemNode | None:
    """The MemNode of a node document that passes every check of `_node` (and a few
    stricter ones: `id` an int, not 1.0), or None for anything else – `_node` then
    decides, and names the problem."""
    if type(entry) is not dict:
        return None
    kind = entry.get("kind")
    kind = _KIND_OF.get(kind) if type(kind) is str else None
    if kind is None:
        return None
    keys = entry.keys()
    for allowed in _KEY_SETS[kind]:
        if keys == allowed:
            break
    else:
        return None
    node_id, deps, tensor = entry["id"], entry["deps"], entry["tensor"]
    if type(node_id) is not int or node_id != position or type(deps) is not list:
        return None
    for dep in deps:
        if type(dep) is not int or not 0 <= dep < position:
            return None
    if type(tensor) is not int or not 0 <= tensor < tasks:
        return None
    region = storage = into = box = None
    reads: tuple[Region, ...] = ()
    if "region" in entry:
        region = _quick_region(entry["region"], regions)
        if region is None:
            return None
    if "storage" in entry:
        storage = entry["storage"]
        if type(storage) is not int or storage < 0:
            return None
    if "reads" in entry:
        if type(entry["reads"]) is not list:
            return None
        reads = tuple(_quick_region(r, regions) for r in entry["reads"])
        if any(r is None for r in reads):
            return None
    name = entry.get("name", "")
    if type(name) is not str:
        return None
    if "into" in entry:
        into = entry["into"]
        if type(into) is not int or not 0 <= into < tasks:
            return None
    if "box" in entry:
        held = storages.get(storage) if storages is not None and storage is not None else None
        value = entry["box"]
        if held is None or type(value) is not dict or value.keys() != {"starts", "sizes"}:
            return None
        starts, sizes = value["starts"], value["sizes"]
        if not (_quick_ints(starts, 0) and _quick_ints(sizes, 1)):
            return None
        box = HostBox(held.shape, held.dtype, tuple(starts), tuple(sizes))
    workspace = None
    if "workspace" in entry:
        workspace = _quick_region(entry["workspace"], regions)
        if workspace is None:
            return None
    recompute = "recompute" in entry
    if recompute and entry["recompute"] is not True:
        return None
    link = entry.get("link")
    if link is not None and (type(link) is not int or link < 0):
        return None
    slot = None
    if "slot" in entry:
        held_at = _quick_region(entry["slot"], regions)
        if held_at is None:
            return None
        slot = HostRegion(held_at.offset, held_at.size)
    deps = tuple(sorted(set(deps))) if len(deps) > 1 else tuple(deps)
    return MemNode(
        position,
        kind,
        deps,
        tensor,
        region,
        storage,
        reads,
        name,
        into,
        box,
        workspace,
        recompute,
        link,
        slot,
    )
