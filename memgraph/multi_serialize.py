"""Plan files for several devices: a `MultiPlan` as JSON, and loading it with validation.

Schema (version 1)::

    {
      "format": "einpage.multiplan",
      "version": 1,
      "devices": 2,
      "strategy": "pipeline",
      "inputs": ["x", "w0", "w1"],
      "outputs": {"y": [1, "y"]},
      "links": [
        {"task": 3, "source": 0, "target": 1, "output": "send:%3", "input": "recv:%3",
         "shape": [4, 8], "dtype": "float32", "nbytes": 128},
        {"task": 5, "source": 1, "target": 2, "output": "send:%5", "input": "recv:%5",
         "shape": [4, 8], "dtype": "float32", "nbytes": 128, "path": "peer"},
        ...
      ],
      "parts": [
        {"device": 0, "budget": 4194304, "origin": [0, 1, 3],
         "plan": { ... device 0's MemGraph document (memgraph.serialize) ... }},
        ...
      ],
      "program": { ... the TaskGraph placed (taskgraph.serialize), when written with it ... },
      "info": { ... MultiPlan.info: the strategy, the budgets asked, the planner's options ... }
    }

`inputs`, `outputs`, `links` and `strategy` are the `PlacedGraph`'s (`inputs`: what the
driver stages; `outputs`: original output name -> [device, that device's output name]).
A link's `path` (`Link.path`, one of `memgraph.peer.PATHS`) is written only when it is not
"host": "peer" for a link sent straight between the devices (a `send` node on the source,
a `recv` on the target, each naming the link by its index in `links`); a link without it
is staged through host memory, so files of host-staged plans are what they were.
Each entry of `parts` is device `device`'s: its `DevicePlan.budget`, its
`DevicePart.origin` (for each task of its TaskGraph, the task of the program it stands
for) and its MemGraph, written by `memgraph.serialize` – which holds the device's
TaskGraph: `DevicePart.tg` is that graph (`plan_devices` plans each part's graph), so it
is stored once, inside the plan. `program` (optional) is the TaskGraph that was placed:
the reference `einpage run --check` evaluates, as it evaluates a single plan's own
TaskGraph. Keys are written in this order and the text is deterministic: the same
MultiPlan gives the same bytes, and a file loaded and written again is the file.

Loading (`multi_from_json`, `read_multi_json`) validates every field's structure and
type and names the JSON path of the first problem in a `SerializationError` (each
device's MemGraph through `memgraph.serialize`, its paths prefixed with the part's);
device numbers must lie in 0..devices-1, the parts be devices 0, 1, ... in order, each
origin have one entry per task of its device's graph. It does not judge the plan: that a
link's output exists on its source, its size matches, and the whole is acyclic is
`memgraph.multi.verify_multi`'s job, as `memgraph.verify` is for one plan.

>>> import einpage as ep
>>> from memgraph.multi import plan_devices, verify_multi
>>> prog = ep.Program("two")
>>> x = prog.input("x", (4, 8))
>>> h = x @ prog.input("w0", (8, 8), role="weight")
>>> prog.output(h @ prog.input("w1", (8, 8), role="weight"), "y")
>>> mp = plan_devices(prog.build(), 2, "100%")
>>> text = multi_to_json(mp)
>>> back = multi_from_json(text)
>>> multi_to_json(back) == text, verify_multi(back).links
(True, 1)
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from einpage_core.errors import SerializationError
from memgraph.multi import DevicePart, DevicePlan, Link, MultiPlan, PlacedGraph
from memgraph.peer import PATHS
from memgraph.serialize import memgraph_from_dict, memgraph_json_chunks
from taskgraph.dtypes import DTYPES
from taskgraph.graph import TaskGraph
from taskgraph.serialize import (
    ENCODER,
    parse_json,
    taskgraph_from_dict,
    taskgraph_json_chunks,
)

__all__ = [
    "FORMAT",
    "VERSION",
    "MultiPlanFile",
    "multi_to_json",
    "multi_json_chunks",
    "write_multi_json",
    "multi_from_json",
    "read_multi_json",
    "multi_from_dict",
    "is_multi_document",
]

FORMAT = "einpage.multiplan"
VERSION = 1

_TOP_KEYS = ("format", "version", "devices", "strategy", "inputs", "outputs", "links", "parts")
_OPTIONAL_KEYS = ("program", "info")
_LINK_KEYS = ("task", "source", "target", "output", "input", "shape", "dtype", "nbytes")
_LINK_OPTIONAL = ("path",)
_PART_KEYS = ("device", "budget", "origin", "plan")


@dataclass(frozen=True)
class MultiPlanFile:
    """What a multi-device plan file holds: the `plan` (a `MultiPlan`) and, when it was
    written with one, the `program` that was placed (the TaskGraph a check evaluates)."""

    plan: MultiPlan
    program: TaskGraph | None = None

    def __repr__(self) -> str:
        program = "no program" if self.program is None else f"program {self.program.name!r}"
        return f"<MultiPlanFile {self.plan!r} {program}>"


# -- writing ---------------------------------------------------------------------------


def _link_to_dict(link: Link) -> dict[str, Any]:
    data = {
        "task": link.task,
        "source": link.source,
        "target": link.target,
        "output": link.output,
        "input": link.input,
        "shape": list(link.shape),
        "dtype": link.dtype,
        "nbytes": link.nbytes,
    }
    if link.path != "host":  # host-staged links are written as before paths existed
        data["path"] = link.path
    return data


def _encode(value: Any, what: str) -> str:
    try:
        return ENCODER.encode(value)
    except (TypeError, ValueError) as err:
        raise SerializationError(f"cannot write {what} as JSON: {err}") from None


def multi_json_chunks(mp: MultiPlan, program: TaskGraph | None = None) -> Iterator[str]:
    """`multi_to_json(mp, program)` in pieces (each device's plan in the pieces of
    `memgraph.serialize.memgraph_json_chunks`): nothing the size of the file is built."""
    if not isinstance(mp, MultiPlan):
        raise SerializationError(f"expected a memgraph.multi.MultiPlan, got {type(mp).__name__}")
    placed = mp.placed
    outputs = {name: [device, local] for name, (device, local) in placed.outputs.items()}
    yield (
        f'{{"format": {_encode(FORMAT, "format")}, "version": {VERSION}, '
        f'"devices": {_encode(placed.devices, "devices")}, '
        f'"strategy": {_encode(placed.strategy, "strategy")}, '
        f'"inputs": {_encode(list(placed.inputs), "inputs")}, '
        f'"outputs": {_encode(outputs, "outputs")}, '
        f'"links": {_encode([_link_to_dict(k) for k in placed.links], "links")}, "parts": ['
    )
    for index, (part, plan) in enumerate(zip(placed.parts, mp.plans, strict=True)):
        if plan.mg.taskgraph is not part.tg and plan.mg.taskgraph.to_json() != part.tg.to_json():
            raise SerializationError(
                f"device {part.device}: its plan was made for another TaskGraph than its part's "
                f"({plan.mg.taskgraph!r}, not {part.tg!r}); a plan file stores one"
            )
        yield ", " if index else ""
        yield (
            f'{{"device": {_encode(plan.device, "a device")}, '
            f'"budget": {_encode(plan.budget, "a budget")}, '
            f'"origin": {_encode(list(part.origin), "an origin")}, "plan": '
        )
        yield from memgraph_json_chunks(plan.mg)
        yield "}"
    yield "]"
    if program is not None:
        if not isinstance(program, TaskGraph):
            raise SerializationError(
                f"the program must be a TaskGraph, got {type(program).__name__}"
            )
        yield ', "program": '
        yield from taskgraph_json_chunks(program)
    yield f', "info": {_encode(dict(mp.info), "the plan info")}}}'


def multi_to_json(mp: MultiPlan, program: TaskGraph | None = None) -> str:
    """The multi-device plan `mp` as JSON text (schema in the module docstring), with the
    TaskGraph `program` it was placed from if given; deterministic, byte for byte."""
    return "".join(multi_json_chunks(mp, program))


def write_multi_json(mp: MultiPlan, stream: Any, program: TaskGraph | None = None) -> None:
    """Write `multi_to_json(mp, program)` to the text `stream`, piece by piece."""
    for chunk in multi_json_chunks(mp, program):
        stream.write(chunk)


# -- loading ---------------------------------------------------------------------------


def _fail(path: str, message: str) -> SerializationError:
    return SerializationError(f"{path}: {message}")


def _int(value: Any, path: str, minimum: int = 0) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise _fail(path, f"expected an integer >= {minimum}, got {value!r}")
    return value


def _device(value: Any, path: str, devices: int) -> int:
    device = _int(value, path)
    if device >= devices:
        raise _fail(path, f"device {device} is not one of the plan's devices 0..{devices - 1}")
    return device


def _str(value: Any, path: str) -> str:
    if not isinstance(value, str) or not value:
        raise _fail(path, f"expected a non-empty string, got {value!r}")
    return value


def _list(value: Any, path: str) -> list[Any]:
    if not isinstance(value, list):
        raise _fail(path, f"expected a list, got {type(value).__name__}")
    return value


def _object(value: Any, path: str, required: tuple[str, ...], optional: tuple[str, ...] = ()):
    """`value` as an object with every key of `required`, and no key outside both."""
    if not isinstance(value, dict):
        raise _fail(path, f"expected an object, got {type(value).__name__}")
    missing = [key for key in required if key not in value]
    if missing:
        raise _fail(path, f"missing key(s) {missing}")
    unknown = sorted(value.keys() - set(required) - set(optional))
    if unknown:
        raise _fail(path, f"unknown key(s) {unknown}")
    return value


def _link(value: Any, path: str, devices: int) -> Link:
    entry = _object(value, path, _LINK_KEYS, _LINK_OPTIONAL)
    if entry["dtype"] not in DTYPES:
        raise _fail(f"{path}.dtype", f"expected one of {', '.join(DTYPES)}, got {entry['dtype']!r}")
    shape = _list(entry["shape"], f"{path}.shape")
    return Link(
        _int(entry["task"], f"{path}.task"),
        _device(entry["source"], f"{path}.source", devices),
        _device(entry["target"], f"{path}.target", devices),
        _str(entry["output"], f"{path}.output"),
        _str(entry["input"], f"{path}.input"),
        tuple(_int(n, f"{path}.shape[{k}]") for k, n in enumerate(shape)),
        entry["dtype"],
        _int(entry["nbytes"], f"{path}.nbytes"),
        _path(entry.get("path", "host"), f"{path}.path", PATHS),
    )


def _path(value: Any, path: str, paths: tuple[str, ...]) -> str:
    if not isinstance(value, str) or value not in paths:
        raise _fail(path, f"expected one of {', '.join(map(repr, paths))}, got {value!r}")
    return value


def _outputs(value: Any, devices: int) -> dict[str, tuple[int, str]]:
    if not isinstance(value, dict):
        raise _fail("$.outputs", f"expected an object, got {type(value).__name__}")
    outputs = {}
    for name, where in value.items():
        path = f"$.outputs[{name!r}]"
        if not isinstance(where, list) or len(where) != 2:
            raise _fail(path, f"expected [device, output name], got {where!r}")
        outputs[name] = (_device(where[0], f"{path}[0]", devices), _str(where[1], f"{path}[1]"))
    return outputs


def _part(value: Any, index: int) -> tuple[DevicePart, DevicePlan]:
    path = f"$.parts[{index}]"
    entry = _object(value, path, _PART_KEYS)
    device = _int(entry["device"], f"{path}.device")
    if device != index:
        raise _fail(
            f"{path}.device", f"expected {index} (the parts are devices 0, 1, ... in order)"
        )
    budget = _int(entry["budget"], f"{path}.budget", 1)
    origin = _list(entry["origin"], f"{path}.origin")
    origin_ids = tuple(_int(t, f"{path}.origin[{k}]") for k, t in enumerate(origin))
    try:
        mg = memgraph_from_dict(entry["plan"], device_part=True)
    except SerializationError as err:
        text = str(err)
        inner = text[1:] if text.startswith("$") else f": {text}"
        raise SerializationError(f"{path}.plan{inner}") from None
    if len(origin_ids) != len(mg.taskgraph):
        raise _fail(
            f"{path}.origin",
            f"has {len(origin_ids)} entries for the {len(mg.taskgraph)} tasks of device "
            f"{device}'s graph (one per task)",
        )
    if mg.budget != budget:
        raise _fail(
            f"{path}.budget",
            f"{budget} B, but device {device}'s plan says its budget is {mg.budget} B",
        )
    return DevicePart(device, mg.taskgraph, origin_ids), DevicePlan(device, mg, budget)


def multi_from_dict(data: Any) -> MultiPlanFile:
    """Validate a decoded multi-plan document and rebuild what it holds (see the module
    docstring); `SerializationError` names the JSON path of the first problem."""
    if not isinstance(data, dict):
        raise _fail("$", f"expected an object, got {type(data).__name__}")
    if data.get("format") != FORMAT:
        raise _fail("$.format", f"expected {FORMAT!r}, got {data.get('format')!r}")
    version = data.get("version")
    if isinstance(version, bool) or version != VERSION:
        raise _fail("$.version", f"expected {VERSION}, got {version!r}")
    _object(data, "$", _TOP_KEYS, _OPTIONAL_KEYS)
    devices = _int(data["devices"], "$.devices", 1)
    strategy = _str(data["strategy"], "$.strategy")
    inputs = _list(data["inputs"], "$.inputs")
    driver_inputs = tuple(_str(name, f"$.inputs[{k}]") for k, name in enumerate(inputs))
    outputs = _outputs(data["outputs"], devices)
    links = _list(data["links"], "$.links")
    link_list = tuple(_link(entry, f"$.links[{k}]", devices) for k, entry in enumerate(links))
    entries = _list(data["parts"], "$.parts")
    if len(entries) != devices:
        raise _fail("$.parts", f"has {len(entries)} parts for {devices} devices (one per device)")
    parts, plans = zip(*(_part(entry, k) for k, entry in enumerate(entries)), strict=True)
    info = data.get("info", {})
    if not isinstance(info, dict):
        raise _fail("$.info", f"expected an object, got {type(info).__name__}")
    program = None
    if "program" in data:
        program = taskgraph_from_dict(data["program"], "$.program")
        for part in parts:
            for k, task in enumerate(part.origin):
                if task >= len(program):
                    raise _fail(
                        f"$.parts[{part.device}].origin[{k}]",
                        f"%{task} is not a task of the program ({len(program)} tasks)",
                    )
    placed = PlacedGraph(devices, tuple(parts), link_list, outputs, strategy, driver_inputs)
    return MultiPlanFile(MultiPlan(placed, tuple(plans), dict(info)), program)


def read_multi_json(text: str | bytes) -> MultiPlanFile:
    """Parse and validate a multi-device plan file's text: the plan and its program."""
    return multi_from_dict(parse_json(text))


def multi_from_json(text: str | bytes) -> MultiPlan:
    """The `MultiPlan` in a multi-device plan file's text, validated (`read_multi_json`
    also gives the program it was placed from, if the file holds it)."""
    return read_multi_json(text).plan


def is_multi_document(data: Any) -> bool:
    """Whether a decoded JSON document says it is a multi-device plan (its `format`)."""
    return isinstance(data, dict) and data.get("format") == FORMAT
