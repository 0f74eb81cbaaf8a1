"""TaskGraph JSON: writing, and loading with validation.

Schema (version 1)::

    {
      "format": "einpage.taskgraph",
      "version": 1,
      "name": "mlp",
      "tasks": [
        {"id": 0, "op": "input", "inputs": [], "shape": [64, 512], "dtype": "float32",
         "scope": "", "label": "", "attrs": {"name": "x", "role": "activation",
                                             "location": "device"}},
        {"id": 2, "op": "einsum", "inputs": [0, 1], "shape": [64, 2048], "dtype": "float32",
         "scope": "layer0", "label": "", "attrs": {"spec": "bd,df->bf", "join": null,
                                                  "agg": "sum"}},
        ...
      ],
      "outputs": {"y": 7}
    }

`id` must equal the task's position and `inputs` must name earlier tasks. `attrs`
by op: input {name, role, location, domain} (domain may be absent, as files written
before it existed: "real"); einsum {spec, join (string or null), agg};
fill {value (number, or "inf"/"-inf"/"nan"), pattern, origin}; gather {}; view {};
slice {starts}; concat {axis}; argreduce {agg}; kth_largest {k}. FLOPs are not
stored: they are recomputed.

A task made by partitioning has one more key, `"block"` (absent otherwise), its
provenance (`taskgraph.nodes.Block`)::

    "block": {"of": 12, "starts": [0, 11, 0, 0], "shape": [1, 11, 4096, 4096],
              "kind": "block", "reduced": []}

`of` is the original task's id, `starts`/`shape` the region of its output (`shape`
must equal the task's shape), `kind` one of block/partial/assembly/output, and
`reduced` the `[start, size]` ranges of the reduced indices a partial aggregates.

Loading rebuilds the graph through `GraphBuilder`, so a hand-edited file gets the
same checks as a program (shapes recomputed, join expressions re-parsed by the safe
parser); any problem raises `SerializationError` naming the JSON path.
"""

from __future__ import annotations

import json
from typing import Any

from einpage_core.errors import EinpageError, SerializationError
from taskgraph.builder import GraphBuilder
from taskgraph.graph import TaskGraph
from taskgraph.nodes import Block, Task, op_from_attributes, with_blocks

__all__ = [
    "FORMAT",
    "VERSION",
    "taskgraph_to_dict",
    "taskgraph_from_dict",
    "taskgraph_to_json",
    "taskgraph_from_json",
]

FORMAT = "einpage.taskgraph"
VERSION = 1
_TASK_KEYS = {"id", "op", "inputs", "shape", "dtype", "scope", "label", "attrs"}
_OPTIONAL_TASK_KEYS = {"block"}


def taskgraph_to_dict(tg: TaskGraph) -> dict[str, Any]:
    """The JSON-ready dict of a graph."""
    return {
        "format": FORMAT,
        "version": VERSION,
        "name": tg.name,
        "tasks": [_task_to_dict(t) for t in tg.tasks],
        "outputs": dict(tg.outputs),
    }


def _task_to_dict(t: Task) -> dict[str, Any]:
    entry = {
        "id": t.id,
        "op": t.kind,
        "inputs": list(t.inputs),
        "shape": list(t.shape),
        "dtype": t.dtype,
        "scope": t.scope,
        "label": t.label,
        "attrs": t.op.attributes(),
    }
    if t.block is not None:
        entry["block"] = t.block.attributes()
    return entry


def taskgraph_to_json(tg: TaskGraph, indent: int | None = None) -> str:
    return json.dumps(taskgraph_to_dict(tg), indent=indent, allow_nan=False)


def taskgraph_from_json(text: str | bytes) -> TaskGraph:
    """Parse and validate JSON text into a TaskGraph."""
    try:
        data = json.loads(text)
    except (json.JSONDecodeError, UnicodeDecodeError, TypeError) as err:
        raise SerializationError(f"not valid JSON: {err}") from None
    return taskgraph_from_dict(data)


def _expect(condition: bool, path: str, message: str) -> None:
    if not condition:
        raise SerializationError(f"{path}: {message}")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def taskgraph_from_dict(data: Any, path: str = "$") -> TaskGraph:
    """Validate a decoded JSON document and rebuild the graph it describes."""
    _expect(isinstance(data, dict), path, "expected an object")
    _expect(data.get("format") == FORMAT, f"{path}.format", f"expected {FORMAT!r}")
    _expect(data.get("version") == VERSION, f"{path}.version", f"expected {VERSION}")
    name = data.get("name", "program")
    _expect(isinstance(name, str), f"{path}.name", "expected a string")
    tasks = data.get("tasks")
    _expect(isinstance(tasks, list), f"{path}.tasks", "expected a list")
    outputs = data.get("outputs")
    _expect(isinstance(outputs, dict), f"{path}.outputs", "expected an object")
    _expect(bool(outputs), f"{path}.outputs", "a program needs at least one output")

    builder = GraphBuilder(name)
    blocks: list[Block | None] = []
    for position, entry in enumerate(tasks):
        where = f"{path}.tasks[{position}]"
        _expect(isinstance(entry, dict), where, "expected an object")
        missing = _TASK_KEYS - entry.keys()
        _expect(not missing, where, f"missing key(s) {sorted(missing)}")
        unknown = entry.keys() - _TASK_KEYS - _OPTIONAL_TASK_KEYS
        _expect(not unknown, where, f"unknown key(s) {sorted(unknown)}")
        _expect(
            entry["id"] == position and _is_int(entry["id"]),
            f"{where}.id",
            f"expected {position} (ids are positions)",
        )
        _expect(isinstance(entry["op"], str), f"{where}.op", "expected a string")
        _expect(
            isinstance(entry["inputs"], list) and all(map(_is_int, entry["inputs"])),
            f"{where}.inputs",
            "expected a list of task ids",
        )
        _expect(
            isinstance(entry["shape"], list) and all(map(_is_int, entry["shape"])),
            f"{where}.shape",
            "expected a list of ints",
        )
        _expect(isinstance(entry["dtype"], str), f"{where}.dtype", "expected a string")
        _expect(isinstance(entry["scope"], str), f"{where}.scope", "expected a string")
        _expect(isinstance(entry["label"], str), f"{where}.label", "expected a string")
        _expect(isinstance(entry["attrs"], dict), f"{where}.attrs", "expected an object")
        try:
            op = op_from_attributes(entry["op"], entry["attrs"])
            builder.add(
                op,
                entry["inputs"],
                tuple(entry["shape"]),
                entry["dtype"],
                entry["scope"],
                entry["label"],
            )
        except EinpageError as err:
            raise SerializationError(f"{where}: {err}") from None
        except (KeyError, TypeError, ValueError) as err:
            raise SerializationError(
                f"{where}.attrs: invalid attributes for {entry['op']!r}: {err}"
            ) from None
        block = _block_from_entry(entry, where)
        if block is not None and block.shape != builder.tasks[-1].shape:
            raise SerializationError(
                f"{where}.block: shape {list(block.shape)} must equal the task's shape "
                f"{list(builder.tasks[-1].shape)}"
            )
        blocks.append(block)
    for out_name, task_id in outputs.items():
        try:
            builder.output(task_id, out_name)
        except EinpageError as err:
            raise SerializationError(f"{path}.outputs[{out_name!r}]: {err}") from None
    return TaskGraph(with_blocks(builder.tasks, blocks), builder.outputs, name)


def _block_from_entry(entry: dict[str, Any], where: str) -> Block | None:
    if "block" not in entry:
        return None
    try:
        return Block.from_attributes(entry["block"])
    except EinpageError as err:
        raise SerializationError(f"{where}.block: {err}") from None
    except (TypeError, ValueError) as err:
        raise SerializationError(f"{where}.block: invalid block: {err}") from None
