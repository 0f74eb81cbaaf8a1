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
by op: input {name, role, location}; einsum {spec, join (string or null), agg};
fill {value (number, or "inf"/"-inf"/"nan"), pattern, origin}; gather {}; view {};
slice {starts}; concat {axis}. FLOPs are not stored: they are recomputed.

Loading rebuilds the graph through `GraphBuilder`, so a hand-edited file gets the
same checks as a program (shapes recomputed, join expressions re-parsed by the safe
parser); any problem raises `SerializationError` naming the JSON path.
"""

from __future__ import annotations

import json
from typing import Any

from einpage.errors import EinpageError, SerializationError
from taskgraph.builder import GraphBuilder
from taskgraph.graph import TaskGraph
from taskgraph.nodes import op_from_attributes

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


def taskgraph_to_dict(tg: TaskGraph) -> dict[str, Any]:
    """The JSON-ready dict of a graph."""
    return {
        "format": FORMAT,
        "version": VERSION,
        "name": tg.name,
        "tasks": [
            {
                "id": t.id,
                "op": t.kind,
                "inputs": list(t.inputs),
                "shape": list(t.shape),
                "dtype": t.dtype,
                "scope": t.scope,
                "label": t.label,
                "attrs": t.op.attributes(),
            }
            for t in tg.tasks
        ],
        "outputs": dict(tg.outputs),
    }


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

    builder = GraphBuilder(name)
    for position, entry in enumerate(tasks):
        where = f"{path}.tasks[{position}]"
        _expect(isinstance(entry, dict), where, "expected an object")
        missing = _TASK_KEYS - entry.keys()
        _expect(not missing, where, f"missing key(s) {sorted(missing)}")
        unknown = entry.keys() - _TASK_KEYS
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
    for out_name, task_id in outputs.items():
        try:
            builder.output(task_id, out_name)
        except EinpageError as err:
            raise SerializationError(f"{path}.outputs[{out_name!r}]: {err}") from None
    return builder.build()
