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
by op: input {name, role, location, domain} (domain is absent when it is "real", as
in files written before it existed); einsum {spec, join (string or null), agg};
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

A task with facts (`taskgraph.facts`: what its tensor is) has the key `"facts"` (after
`"block"`; absent when there are none, so files written before facts existed load and
write back byte for byte), one object per fact, its `kind` and its fields::

    "facts": [{"kind": "kv_page", "layer": 0, "part": "k", "page": 3}]
    "facts": [{"kind": "update", "of": 12}, {"kind": "gradient", "of": 12}]

Kinds and fields: kv_page {layer, part ("k" or "v"), page (int or null)}; kv_entries
{layer, part}; chosen_ids {step}; gradient {of}; update {of}; optimizer_state {of,
state}; master_weight {of}; softmax {}; log_sum_exp {}; layer {index}. `of` is the id
of an earlier task (an input for update, optimizer_state and master_weight).

A task whose kernel needs device memory besides its operands and output has the key
`"workspace"` (last; absent when 0, so files written before workspaces existed load
and write back byte for byte): its bytes (`Task.workspace`, declared by
`runtime.declare_workspaces`), an integer >= 0, only on a task the device computes::

    "workspace": 4096

Loading rebuilds the graph through `GraphBuilder`, so a hand-edited file gets the
same checks as a program (shapes recomputed, join expressions re-parsed by the safe
parser); any problem raises `SerializationError` naming the JSON path.

A partitioned graph has a hundred thousand tasks, so both ways are built for speed (a
plan embeds its graph: `memgraph.serialize`). Writing formats each task straight to
text, in the exact bytes `json.dumps(taskgraph_to_dict(tg))` gives. Loading parses with
the garbage collector paused (`collector_paused`), checks each task first with quick
checks that accept only what the full checks accept, and makes each distinct op once
(the blocks of one einsum share one parsed spec and join).
"""

from __future__ import annotations

import gc
import json
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from itertools import combinations
from typing import Any

from einpage_core.errors import EinpageError, SerializationError
from einpage_core.progress import Tick, ticks
from taskgraph.builder import GraphBuilder
from taskgraph.facts import Fact, fact_from_attributes
from taskgraph.graph import TaskGraph
from taskgraph.nodes import Block, Op, Task, op_from_attributes, with_blocks

__all__ = [
    "FORMAT",
    "VERSION",
    "taskgraph_to_dict",
    "taskgraph_from_dict",
    "taskgraph_to_json",
    "taskgraph_from_json",
    "taskgraph_json_chunks",
    "parse_json",
    "collector_paused",
]

FORMAT = "einpage.taskgraph"
VERSION = 1
_TASK_KEYS = {"id", "op", "inputs", "shape", "dtype", "scope", "label", "attrs"}
_OPTIONAL_TASK_KEYS = {"block", "facts", "workspace"}

ENCODER = json.JSONEncoder(allow_nan=False)
"""What `json.dumps(value, allow_nan=False)` uses, made once: `ENCODER.encode(value)` is
the same text without building an encoder per call."""


@contextmanager
def collector_paused() -> Iterator[None]:
    """Python's cyclic garbage collector off for the block, as it was after it.

    Reading a large document makes millions of dicts and lists that all stay alive; each
    collection the allocations trigger walks every one of them again, which took 4 of the
    5 seconds `json.loads` spends on a 100 MB plan. Nothing made here is garbage until
    the document is dropped, so pausing loses nothing; the collector resumes afterwards.
    """
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def parse_json(text: str | bytes) -> Any:
    """The decoded JSON document in `text` (the collector paused meanwhile), or a
    `SerializationError` saying why it is not JSON: not JSON text at all, nested deeper
    than Python's parser goes, or an integer longer than Python converts (4300 digits)."""
    try:
        with collector_paused():
            return json.loads(text)
    except RecursionError:
        raise SerializationError(
            "not valid JSON here: arrays or objects nested too deeply to read (plans and "
            "TaskGraphs nest fewer than ten levels)"
        ) from None
    except (ValueError, TypeError) as err:  # JSONDecodeError, UnicodeDecodeError: ValueErrors
        raise SerializationError(f"not valid JSON: {err}") from None


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
    if t.facts:
        entry["facts"] = [fact.attributes() for fact in t.facts]
    if t.workspace:
        entry["workspace"] = t.workspace
    return entry


def taskgraph_to_json(tg: TaskGraph, indent: int | None = None) -> str:
    """The graph as JSON text: `json.dumps(taskgraph_to_dict(tg))`, byte for byte, written
    without building the dicts first (with an `indent`, through the dicts)."""
    if indent is not None:
        return json.dumps(taskgraph_to_dict(tg), indent=indent, allow_nan=False)
    return "".join(taskgraph_json_chunks(tg))


def taskgraph_json_chunks(tg: TaskGraph, tick: Tick | None = None) -> Iterator[str]:
    """`taskgraph_to_json(tg)` in pieces of about a hundredth of the tasks each, calling
    `tick(done, total)` after each piece. The text is that of `json.dumps` of
    `taskgraph_to_dict` (keys in the same order, the same separators and escapes), so a
    file stays byte for byte what it was; each task is formatted straight to text,
    which is several times faster than making its dict and encoding that."""
    quoted = Quoted()
    name = quoted[tg.name]
    yield f'{{"format": {quoted[FORMAT]}, "version": {VERSION}, "name": {name}, "tasks": ['
    yield from joined_chunks(tg.tasks, lambda t: _task_text(t, quoted), tick)
    yield f'], "outputs": {ENCODER.encode(dict(tg.outputs))}}}'


class Quoted(dict):
    """Strings as JSON string literals (`ENCODER.encode`), each encoded once."""

    def __missing__(self, text: str) -> str:
        literal = self[text] = ENCODER.encode(text)
        return literal


def int_list(values: Any) -> str:
    """A sequence of ints as JSON text, as `json.dumps` writes it: `[1, 2, 3]`."""
    return "[" + ", ".join(map(str, values)) + "]"


def joined_chunks(
    items: Sequence[Any], text: Callable[[Any], str], tick: Tick | None
) -> Iterator[str]:
    """The JSON texts of `items` (`text(item)` each) separated by ", ", in pieces of
    `ticks(len(items))` items; `tick(done, total)` after each piece."""
    total = len(items)
    step = ticks(total)
    if tick is not None:
        tick(0, total)
    for start in range(0, total, step):
        piece = ", ".join(map(text, items[start : start + step]))
        yield piece if start == 0 else ", " + piece
        if tick is not None:
            tick(min(start + step, total), total)


def _task_text(t: Task, quoted: Quoted) -> str:
    """`json.dumps(_task_to_dict(t))`, formatted directly."""
    text = (
        f'{{"id": {t.id}, "op": {quoted[t.kind]}, "inputs": {int_list(t.inputs)}, '
        f'"shape": {int_list(t.shape)}, "dtype": {quoted[t.dtype]}, '
        f'"scope": {quoted[t.scope]}, "label": {quoted[t.label]}, '
        f'"attrs": {ENCODER.encode(t.op.attributes())}'
    )
    if t.block is not None:
        text += f', "block": {ENCODER.encode(t.block.attributes())}'
    if t.facts:
        text += f', "facts": {ENCODER.encode([fact.attributes() for fact in t.facts])}'
    if t.workspace:
        text += f', "workspace": {t.workspace}'
    return text + "}"


def taskgraph_from_json(text: str | bytes) -> TaskGraph:
    """Parse and validate JSON text into a TaskGraph."""
    return taskgraph_from_dict(parse_json(text))


def _expect(condition: bool, path: str, message: str) -> None:
    if not condition:
        raise SerializationError(f"{path}: {message}")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def taskgraph_from_dict(
    data: Any, path: str = "$", tick: Tick | None = None, *, device_part: bool = False
) -> TaskGraph:
    """Validate a decoded JSON document and rebuild the graph it describes, calling
    `tick(done, total)` about a hundred times as tasks are checked. A program needs an
    output; one device's share of a program placed on several (`device_part`, read from
    a plan file for several devices) may have none: a device left idle, or holding only
    tasks whose results nothing reads.

    Every task goes through `GraphBuilder` and its op through `op_from_attributes`; an op
    is made once per distinct (kind, attributes) document and shared by the tasks that
    have the same one (ops are immutable values: the thousands of blocks of one einsum
    re-parse one spec and one join expression once, not each).
    """
    with collector_paused():
        return _taskgraph_from_dict(data, path, tick, device_part)


def _taskgraph_from_dict(
    data: Any, path: str, tick: Tick | None, device_part: bool = False
) -> TaskGraph:
    _expect(isinstance(data, dict), path, "expected an object")
    _expect(data.get("format") == FORMAT, f"{path}.format", f"expected {FORMAT!r}")
    _expect(data.get("version") == VERSION, f"{path}.version", f"expected {VERSION}")
    name = data.get("name", "program")
    _expect(isinstance(name, str), f"{path}.name", "expected a string")
    tasks = data.get("tasks")
    _expect(isinstance(tasks, list), f"{path}.tasks", "expected a list")
    outputs = data.get("outputs")
    _expect(isinstance(outputs, dict), f"{path}.outputs", "expected an object")
    _expect(bool(outputs) or device_part, f"{path}.outputs", "a program needs at least one output")

    builder = GraphBuilder(name)
    blocks: list[Block | None] = []
    ops: dict[Any, Op] = {}
    total = len(tasks)
    every = ticks(total)
    if tick is not None:
        tick(0, total)
    for position, entry in enumerate(tasks):
        if tick is not None and position % every == 0 and position:
            tick(position, total)
        if not _quick_task_check(entry, position):
            _check_task(entry, position, path)  # names the first problem
        try:
            key = _op_key(entry["op"], entry["attrs"])
            op = ops.get(key) if key is not None else None
            if op is None:
                op = op_from_attributes(entry["op"], entry["attrs"])
                if key is not None:
                    ops[key] = op
            builder.add(
                op,
                entry["inputs"],
                tuple(entry["shape"]),
                entry["dtype"],
                entry["scope"],
                entry["label"],
                _facts_from_entry(entry, path, position),
                _workspace_from_entry(entry, path, position),
            )
        except SerializationError:
            raise
        except EinpageError as err:
            raise SerializationError(f"{path}.tasks[{position}]: {err}") from None
        except (KeyError, TypeError, ValueError) as err:
            raise SerializationError(
                f"{path}.tasks[{position}].attrs: invalid attributes for {entry['op']!r}: {err}"
            ) from None
        block = _block_from_entry(entry, path, position)
        if block is not None and block.shape != builder.tasks[-1].shape:
            raise SerializationError(
                f"{path}.tasks[{position}].block: shape {list(block.shape)} must equal the "
                f"task's shape {list(builder.tasks[-1].shape)}"
            )
        blocks.append(block)
    if tick is not None:
        tick(total, total)
    for out_name, task_id in outputs.items():
        try:
            builder.output(task_id, out_name)
        except EinpageError as err:
            raise SerializationError(f"{path}.outputs[{out_name!r}]: {err}") from None
    return TaskGraph(with_blocks(builder.tasks, blocks), builder.outputs, name)


_TASK_KEY_SETS = tuple(
    _TASK_KEYS | set(optional)
    for n in range(len(_OPTIONAL_TASK_KEYS) + 1)
    for optional in combinations(sorted(_OPTIONAL_TASK_KEYS), n)
)


def _quick_task_check(entry: Any, position: int) -> bool:
    """Whether a task document passes every check of `_check_task` (and a few stricter
    ones: exact types), without building a JSON path per check."""
    if type(entry) is not dict:
        return False
    if entry.keys() not in _TASK_KEY_SETS:
        return False
    task_id, inputs, shape = entry["id"], entry["inputs"], entry["shape"]
    if type(task_id) is not int or task_id != position:
        return False
    if type(inputs) is not list or type(shape) is not list:
        return False
    for value in inputs:
        if type(value) is not int:
            return False
    for value in shape:
        if type(value) is not int:
            return False
    return (
        type(entry["op"]) is str
        and type(entry["dtype"]) is str
        and type(entry["scope"]) is str
        and type(entry["label"]) is str
        and type(entry["attrs"]) is dict
    )


def _check_task(entry: Any, position: int, path: str) -> None:
    """The structure of task document `position`: `SerializationError` naming the JSON
    path of the first problem."""
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


def _op_key(kind: str, attrs: dict[str, Any]) -> tuple[str, str] | None:
    """A key equal for two (kind, attrs) documents exactly when they are the same JSON
    values of the same types: the attributes' JSON text (so 1, 1.0 and true, 0.0 and -0.0
    stay apart), or None when they have no such text (NaN; the op is then made without
    the cache)."""
    try:
        return (kind, ENCODER.encode(attrs))
    except (TypeError, ValueError):
        return None


def _facts_from_entry(entry: dict[str, Any], path: str, position: int) -> tuple[Fact, ...]:
    """The facts of a task document (none when it has no "facts" key); `SerializationError`
    naming the JSON path of the first bad one. Whether each names the right tasks is
    checked by the builder."""
    if "facts" not in entry:
        return ()
    where = f"{path}.tasks[{position}].facts"
    documents = entry["facts"]
    _expect(isinstance(documents, list) and bool(documents), where, "expected a non-empty list")
    facts = []
    for number, document in enumerate(documents):
        try:
            facts.append(fact_from_attributes(document))
        except EinpageError as err:
            raise SerializationError(f"{where}[{number}]: {err}") from None
        except (TypeError, ValueError) as err:
            raise SerializationError(f"{where}[{number}]: invalid fact: {err}") from None
    return tuple(facts)


def _workspace_from_entry(entry: dict[str, Any], path: str, position: int) -> int:
    """The workspace bytes of a task document (0 when it has no "workspace" key);
    `SerializationError` unless they are an integer >= 0 (the builder checks that the
    task is one the device computes)."""
    if "workspace" not in entry:
        return 0
    value = entry["workspace"]
    _expect(
        _is_int(value) and value >= 0,
        f"{path}.tasks[{position}].workspace",
        f"expected a number of bytes (an integer >= 0), got {value!r}",
    )
    return value


def _block_from_entry(entry: dict[str, Any], path: str, position: int) -> Block | None:
    if "block" not in entry:
        return None
    where = f"{path}.tasks[{position}]"
    try:
        return Block.from_attributes(entry["block"])
    except EinpageError as err:
        raise SerializationError(f"{where}.block: {err}") from None
    except (TypeError, ValueError) as err:
        raise SerializationError(f"{where}.block: invalid block: {err}") from None
