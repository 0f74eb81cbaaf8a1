"""An independent oracle for memory plans: judges a plan from its JSON text alone.

It shares no code with `memgraph.verify` (nor with `memgraph.happens_before`,
`memgraph.verify_ranges`, `memgraph.residency` or any MemGraph class): it reads the plan
document with its own small reader (the task facts it needs come from the embedded
TaskGraph document, with op kinds and item sizes from `taskgraph`'s tables), works out
happens-before explicitly, and replays the plan over the arena's bytes. The tests hold
`memgraph.verify` to the same verdict on every plan the suite makes (`conftest.py`) and
on mutations of real plans (`memgraph/test_verify_equivalence.py`).

The execution model
-------------------
A node may start once every node it depends on, directly or through other nodes, has
finished; nothing else orders two nodes, not their insertion order and not a stream
they share (the runtime's "random" mode; its "streams" and "sequential" modes only add
order). So node `a` *happens before* node `b` exactly when `a` is reachable from `b`
through `deps`: the oracle computes, for every node, the set of nodes that happen
before it (a bitset, built in one pass over the nodes in insertion order).

The rules, each stated once (a plan is accepted when it breaks none)
--------------------------------------------------------------------
Structure (S):

* S1 a node's `id` is its position, and its `deps` are earlier nodes.
* S2 a node's `tensor` is a task of the TaskGraph and not a view (a view has no bytes
  of its own: nodes name the task it views, its *base*).
* S3 every device region a node names (`region`, `reads`, `workspace`) lies inside the arena
  `[0, budget)` and has at least one byte; an input or output is on the host
  (`storage`) or on the device (`region`), not both.
* S4 an alloc's offset is a multiple of the plan's alignment, and its region holds at
  least its tensor's bytes.
* S5 a tensor's bytes start at a multiple of its element size (its dtype's bytes per
  element), wherever a node sees them: the tensor an alloc places, and every operand
  an apply reads (a view as its own dtype says). A GPU load of a float32 from an
  address that is not a multiple of 4 faults, whatever the plan's alignment says.

Device bytes (D). The oracle replays the nodes in insertion order over a map of the
arena that says, for every byte, whether it is free (and which free released it last)
or held by a tensor: the alloc that holds it, the write that put the tensor's data
there (if any), and the reads of that data since. Allocs, writes and frees *change*
bytes; reads do not.

* D1 an alloc (of tensor t) takes bytes that are all free, and happens after the free
  that released each of them last; t has no other region at that point of the
  schedule (a node names a tensor's bytes by tensor and region: one at a time).
* D2 a write (an apply's output, a reload, an input put on the device) fills exactly
  the region allocated to its tensor, not written before, and happens after its alloc.
* D3 a read (an apply's operands, a view operand reading its base's region; an
  offload; an output on the device) reads exactly a region where its tensor's data was
  written, and happens after that write.
* D4 a free releases exactly a region allocated to its tensor, and happens after its
  alloc, its write and every read of its bytes.
* D5 the bytes held at once never exceed the budget (the peak is reported).
* D6 a kernel's workspace (an apply's `workspace` region) is there exactly when the
  task's document declares one (`"workspace"`: bytes), at least that many bytes, at an
  offset that is a multiple of the alignment. It is held for the apply alone: its bytes
  are all free when the apply starts, the apply happens after the free that released
  each of them last, the bytes held during the apply (D5) count it, and when the apply
  ends its bytes are free again, released by the apply -- so whatever takes them next
  happens after it (D1).

Together these make the changes of each byte a chain under happens-before (alloc,
write, free, alloc, ...: each after the one before it), with every read between the
write it reads and the next change. So in every execution the dependencies allow,
each read sees the bytes its tensor's write put there.

Host storages (H). Each node that names a storage finds it in the plan's table.

* H1 the table's entry of a storage says what fills it (`kind`), the task it holds
  (`tensor`), that task's shape and dtype, and its bytes: "input" for a program input
  placed there, "offload" for a tensor copied there whole, "assembly" for a program
  output whose blocks are copied into their boxes. Every entry is written by a node.
* H2 a storage is filled one way, with one tensor: once, by its input or by one whole
  offload (which carries no box) -- or box by box, by sliced offloads. (Filled twice,
  a storage could be written while a reload reads it. `memgraph.verify` accepts a
  storage filled again by a whole offload of its tensor, when each reload waits for
  the latest fill: no planner makes such a plan, and the watch would report one.)
* H3 a reload reads a storage already written, and happens after that write. A whole
  reload brings back the tensor the storage holds and carries no box. A *sliced*
  reload brings a Slice read straight from the input the storage holds: its box lies
  inside the storage, has the Slice's shape and dtype, and starts where the Slice
  starts. A storage filled by sliced offloads is never reloaded.
* H4 a sliced offload (`into` set) fills output `into`'s storage: `into` is a Concat
  that assembles a program output, and the Concats under it (of the same kind) form a
  tree whose other operands are its *leaves* -- one box of the output each, no base
  tensor twice. The offload copies a leaf (by its base tensor) into exactly that
  leaf's box, whose bytes are the tensor's; no element of the storage is written
  twice.
* H5 an output on the host finds its tensor in its storage: written before the output
  (happens-before), or, for an output assembled by sliced offloads, every element
  written, by offloads that all happen before the output.

The program (P):

* P1 an input node names the Input task of that name; each input appears once, and
  every input appears.
* P2 an apply computes a task that is not an Input, reading one region per operand. A
  task is computed once, except a Slice read straight from an input, which may be
  computed any number of times, by applies or by sliced reloads (H3), and a task
  computed again by a recompute (P4). Every task the
  device computes is computed; the Concats of an output assembled on the host count
  as computed when that output is (H5).
* P3 an output node names a program output, once, with the base task that holds its
  bytes; every output appears.
* P4 an apply marked `"recompute": true` computes a task again: some apply earlier in
  the plan computed it. Its output bytes were given back in between (D2: a write fills
  a region allocated afresh), its operands are read where their data was written (D3),
  and a task is a function of its operands' data, which never changes once written (a
  reload brings back what was copied out, an apply writes its task's value): so it
  writes the same data as the first apply. It may then be read like that data (D3).
  The mark is `true` or absent, never anything else.
* P5 a copy between devices (plans for several devices) stands for an end of the
  program on this device: a `send` reads a program output on the device (its base task,
  where its data was written, D3; once per link, so an output may be sent several times
  and be on the host too, and it counts as appearing, P3) and a `recv` is an input put
  on the device (P1, a write, D2); each link index (`link`) is used by one send or
  receive of the plan. Whether the other device has the matching end is the whole
  plan's question (`verify_multi`), not this one's.
* P6 a host tier (the document's `"tier"`: a host arena of `budget` bytes and disk
  `files`) holds every storage of kind "offload" or "assembly" and every input storage
  with a place on disk (`"disk"`: [file, offset], or [file, offset, [rows, cols]]); any
  other input is the caller's array. Without a tier, no storage has a place on disk and
  no node names a slot or is a `read`, `write` or `release`. With one:

  - (the table, before any node) a place on disk lies inside its file; an input's is
    in a "checkpoint" file, any other storage's in a "spill" file; a transposed place
    (`[file, offset, [rows, cols]]`: the file holds the storage as a (rows, cols)
    matrix, transposed) is in a checkpoint, rows and cols are >= 1 and rows * cols
    elements of the storage's dtype are exactly its bytes; the spill places of two
    storages share no byte;
  - every `slot` [offset, size] lies inside [0, budget), with at least one byte; an
    offload, reload or host output of a storage the tier holds names a slot, of any
    other storage (or an output on the device) none;
  - a storage *occupies* a slot from the node that fills it -- a `read` (from its place
    on disk), or an offload naming a slot it does not occupy -- until a `release`. The
    slot holds the storage's bytes; a storage may occupy several slots at once (a weight
    read ahead of its next reload); a read, write or release names a storage the tier
    holds, and its tensor; a reload, write, release or host output names a slot its
    storage occupies (an offload naming one fills it again);
  - two occupancies of overlapping slots are never live at once (in insertion order),
    and the fill of the later one happens after the release of the earlier; the bytes
    of the live slots never exceed the budget;
  - a reload, write, release or host output happens after every fill of its
    occupancy, and a release after every node that used it (reloads, writes);
  - a read from a spill file happens after the latest write of its storage before it
    (there is one); a write needs a place in a spill file (a checkpoint is never
    written);
  - a host output's occupancy is never released; an assembled storage whose slot was
    released is filled again by a read, never by a sliced offload (which would start
    it empty, losing the boxes written before).

The verdict names the first node, in insertion order, that breaks a rule (or no node,
for P's "every ... appears" and H1's "every entry is written", which concern the whole
plan). `memgraph.verify` reports its first violation in the same order, so where both
reject a plan they name the same node.

>>> import einpage as ep
>>> from memgraph import plan
>>> prog = ep.Program("tiny")
>>> w = prog.input("w", (64,), role="weight")
>>> prog.output(ep.exp(w), "y")
>>> verdict = judge(plan(prog.build(), 512).to_json())
>>> verdict.accepted, verdict.peak_bytes
(True, 512)
"""

from __future__ import annotations

import json
import math
from bisect import bisect_right
from dataclasses import dataclass

import numpy as np

from taskgraph.dtypes import TABLE as DTYPE_TABLE
from taskgraph.nodes import OP_KINDS

__all__ = ["Verdict", "judge"]


@dataclass(frozen=True, slots=True)
class Verdict:
    """The oracle's verdict: `accepted`, or the `node` (None: the whole plan) that breaks
    `rule` (its label in the module docstring: "D3", ...), as `reason` says; `peak_bytes`
    is the most device bytes held at once (up to that node, when rejected)."""

    accepted: bool
    node: int | None = None
    rule: str = ""
    reason: str = ""
    peak_bytes: int = 0


def judge(plan_json: str) -> Verdict:
    """Judge the plan whose JSON document (`MemGraph.to_json()`) is `plan_json`."""
    return _Replay(json.loads(plan_json)).run()


class _Broken(Exception):
    """`rule` is broken at `node` (None: by the plan as a whole), as `reason` says."""

    def __init__(self, node: int | None, rule: str, reason: str):
        super().__init__(reason)
        self.node = node
        self.rule = rule
        self.reason = reason


# -- the plan document, read ----------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _Task:
    """What the oracle needs of a task: from its entry in the TaskGraph document, with
    its bytes and what its op kind is (`taskgraph`'s tables of dtypes and ops)."""

    id: int
    kind: str  # the op kind: "input", "einsum", "view", "slice", "concat", ...
    inputs: tuple[int, ...]
    shape: tuple[int, ...]
    dtype: str
    attrs: dict
    block_kind: str | None  # a partitioned task's role ("block", "output", ...), or None
    nbytes: int
    is_view: bool  # its bytes are those of the task it views (its operand 0)
    computed: bool  # the device computes it (an apply, or what stands for one)
    workspace: int  # bytes its kernel needs while it runs (0: none)

    def describe(self) -> str:
        return f"%{self.id} ({self.kind} {self.dtype}[{','.join(map(str, self.shape))}])"


def _read_tasks(doc: dict) -> list[_Task]:
    tasks = []
    for entry in doc["tasks"]:
        shape, dtype, op = tuple(entry["shape"]), entry["dtype"], OP_KINDS[entry["op"]]
        block = entry.get("block")
        tasks.append(
            _Task(
                entry["id"],
                entry["op"],
                tuple(entry["inputs"]),
                shape,
                dtype,
                entry["attrs"],
                None if block is None else block["kind"],
                math.prod(shape) * DTYPE_TABLE[dtype].itemsize,
                op.aliases_input,
                op.is_compute,
                entry.get("workspace", 0),
            )
        )
    return tasks


# -- the arena, byte range by byte range ----------------------------------------------


@dataclass(frozen=True, slots=True)
class _Free:
    """Bytes no tensor holds; `released_by` is the free that released them last (None:
    never held)."""

    released_by: int | None = None


@dataclass(frozen=True, slots=True)
class _Held:
    """Bytes held by `tensor`, allocated by node `alloc` as part of region `region`
    (offset, size); `write` put the tensor's data there (None: not yet), and `reads`
    read it since."""

    tensor: int
    alloc: int
    region: tuple[int, int]
    write: int | None = None
    reads: tuple[int, ...] = ()


class _Arena:
    """The state of every byte of `[0, size)`: a sorted list of piece starts, each piece
    running to the next start, and the state of each piece."""

    def __init__(self, size: int):
        self.size = size
        self.starts: list[int] = [0]
        self.states: list[_Free | _Held] = [_Free()]

    def _cut(self, at: int) -> int:
        """Make a piece start at byte `at`; its index (len(pieces) at the end)."""
        if at >= self.size:
            return len(self.starts)
        i = bisect_right(self.starts, at) - 1
        if self.starts[i] == at:
            return i
        self.starts.insert(i + 1, at)
        self.states.insert(i + 1, self.states[i])
        return i + 1

    def states_in(self, offset: int, size: int) -> list[_Free | _Held]:
        """The states of the pieces that overlap bytes `[offset, offset + size)`."""
        first = bisect_right(self.starts, offset) - 1
        last = bisect_right(self.starts, offset + size - 1)
        return self.states[first:last]

    def set(self, offset: int, size: int, state: _Free | _Held) -> None:
        """Bytes `[offset, offset + size)` are now in `state`, all of them."""
        lo, hi = self._cut(offset), self._cut(offset + size)
        self.starts[lo:hi] = [offset]
        self.states[lo:hi] = [state]


# -- the replay -----------------------------------------------------------------------


class _Replay:
    """Judges one plan document (see the module docstring for the rules)."""

    def __init__(self, doc: dict):
        self.budget: int = doc["budget"]
        self.alignment: int = doc["alignment"]
        self.tasks = _read_tasks(doc["taskgraph"])
        self.outputs: dict[str, int] = doc["taskgraph"]["outputs"]
        self.table: dict[int, dict] = {entry["id"]: entry for entry in doc["storages"]}
        self.nodes: list[dict] = doc["nodes"]
        self.before = self._happens_before()
        self.arena = _Arena(self.budget)
        self.region_of: dict[int, tuple[int, int]] = {}  # tensor -> its region now
        self.held_bytes = 0
        self.peak = 0
        self.storage_writes: dict[int, list[int]] = {}  # storage -> nodes that wrote it
        self.storage_tensor: dict[int, int] = {}  # storage -> the task it holds
        self.assemblies: dict[int, _Assembly] = {}  # storage -> its sliced offloads
        self.computed: set[int] = set()
        self.inputs_seen: set[str] = set()
        self.outputs_seen: set[str] = set()
        self.links_seen: dict[int, int] = {}  # link -> the send or receive using it (P5)
        self.node: dict = {}
        self.tier: dict | None = doc.get("tier")  # P6
        self.occupying: dict[tuple, _Occupying] = {}  # (storage, offset, size) -> it, if live
        self.released: list[tuple[int, int, int]] = []  # (offset, end, release) of each one
        self.occupied: set[int] = set()  # storages that have occupied a slot
        self.spill_writes: dict[int, int] = {}  # storage -> its latest write
        self.host_held = 0

    # -- happens-before ---------------------------------------------------------------

    def _happens_before(self) -> list[int]:
        """For each node, the bitset of the nodes that happen before it: its dependencies
        and, recursively, theirs. (A dependency that is not an earlier node is ignored
        here; S1 rejects the node that names it.)"""
        before: list[int] = []
        for position, node in enumerate(self.nodes):
            bits = 0
            for dep in node.get("deps", ()):
                if isinstance(dep, int) and 0 <= dep < position:
                    bits |= before[dep] | (1 << dep)
            before.append(bits)
        return before

    def after(self, earlier: int | None, rule: str, why: str) -> None:
        """The current node must happen after node `earlier`, as `rule` says (`why` says
        which node that is)."""
        if earlier is not None and not (self.before[self.node["id"]] >> earlier) & 1:
            raise self.broken(rule, f"does not happen after n{earlier}, {why}")

    def broken(self, rule: str, reason: str) -> _Broken:
        """The current node (none: the plan as a whole) breaks `rule`, as `reason` says."""
        return _Broken(self.node.get("id"), rule, reason)

    # -- the run ----------------------------------------------------------------------

    def run(self) -> Verdict:
        kinds = {
            "input": self.on_input,
            "alloc": self.on_alloc,
            "apply": self.on_apply,
            "offload": self.on_offload,
            "reload": self.on_reload,
            "free": self.on_free,
            "output": self.on_output,
            "send": self.on_send,
            "recv": self.on_recv,
            "read": self.on_read,
            "write": self.on_write,
            "release": self.on_release,
        }
        try:
            self.check_tier_table()
            for position, node in enumerate(self.nodes):
                self.node = node
                self.check_structure(position)
                self.check_slot()
                kinds[node["kind"]]()
                if node["kind"] in ("offload", "reload", "output"):
                    self.tier_copy()
            self.node = {}
            self.check_whole_plan()
        except _Broken as err:
            return Verdict(False, err.node, err.rule, err.reason, self.peak)
        return Verdict(True, peak_bytes=self.peak)

    def check_structure(self, position: int) -> None:
        node = self.node
        if node["id"] != position:  # S1
            raise _Broken(position, "S1", f"id {node['id']} is not its position {position}")
        if any(not 0 <= dep < position for dep in node["deps"]):
            raise self.broken("S1", f"depends on {node['deps']}, not all earlier nodes")
        tensor = node.get("tensor")  # S2
        if not isinstance(tensor, int) or not 0 <= tensor < len(self.tasks):
            raise self.broken("S2", f"tensor {tensor} is not a task of the TaskGraph")
        if self.tasks[tensor].is_view:
            raise self.broken("S2", f"names the view %{tensor}, which holds no bytes")
        regions = [node["region"]] if "region" in node else []  # S3
        regions += [node["workspace"]] if "workspace" in node else []
        for offset, size in regions + list(node.get("reads", ())):
            if offset < 0 or size < 1 or offset + size > self.budget:
                raise self.broken("S3", f"region [{offset}, +{size}) is not inside the arena")
        if node["kind"] in ("input", "output") and ("region" in node) == ("storage" in node):
            raise self.broken("S3", "is on the host or on the device: one of storage and region")

    # -- device bytes -----------------------------------------------------------------

    def on_alloc(self) -> None:
        node, tensor = self.node, self.node["tensor"]
        offset, size = node["region"]
        if offset % self.alignment:  # S4
            raise self.broken("S4", f"offset {offset} is not a multiple of {self.alignment}")
        if size < self.tasks[tensor].nbytes:
            raise self.broken("S4", f"{size} bytes cannot hold {self.tasks[tensor].describe()}")
        self.at_element_boundary(tensor, offset)  # S5
        if tensor in self.region_of:  # D1
            raise self.broken("D1", f"%{tensor} already has region {self.region_of[tensor]}")
        for state in self.arena.states_in(offset, size):
            if isinstance(state, _Held):
                raise self.broken(
                    "D1", f"takes bytes %{state.tensor} holds (its region {state.region})"
                )
            self.after(state.released_by, "D1", "which released some of its bytes")
        self.arena.set(offset, size, _Held(tensor, node["id"], (offset, size)))
        self.region_of[tensor] = (offset, size)
        self.held_bytes += size  # D5
        self.peak = max(self.peak, self.held_bytes)
        if self.held_bytes > self.budget:
            raise self.broken("D5", f"{self.held_bytes} bytes held exceed the budget {self.budget}")

    def holder(self, tensor: int, region: list[int], what: str, rule: str) -> _Held:
        """The state of `region`'s bytes, which must all be held by `tensor`, allocated
        as exactly that region (D2, D3, D4). Such bytes are one piece of the arena map:
        pieces are cut only at the edges of regions that were free, or held, as a whole."""
        offset, size = region
        states = self.arena.states_in(offset, size)
        held = states[0]
        if (
            len(states) != 1
            or not isinstance(held, _Held)
            or (held.tensor, held.region) != (tensor, (offset, size))
        ):
            found = sorted(
                {f"%{s.tensor} at {s.region}" if isinstance(s, _Held) else "free" for s in states}
            )
            raise self.broken(rule, f"{what} %{tensor} at [{offset}, +{size}), which holds {found}")
        return held

    def write(self, tensor: int, region: list[int]) -> None:
        """The current node writes `tensor`'s data into `region` (D2)."""
        held = self.holder(tensor, region, "writes", "D2")
        if held.write is not None:
            raise self.broken("D2", f"writes %{tensor} again (n{held.write} wrote it)")
        self.after(held.alloc, "D2", f"the alloc of %{tensor}")
        self.arena.set(*region, _Held(tensor, held.alloc, held.region, self.node["id"]))

    def read(self, tensor: int, region: list[int]) -> None:
        """The current node reads `tensor`'s data from `region` (D3)."""
        held = self.holder(tensor, region, "reads", "D3")
        if held.write is None:
            raise self.broken("D3", f"reads %{tensor}, whose data nothing wrote")
        self.after(held.write, "D3", f"which wrote %{tensor}")
        reads = (*held.reads, self.node["id"])
        self.arena.set(*region, _Held(tensor, held.alloc, held.region, held.write, reads))

    def on_free(self) -> None:
        node, tensor = self.node, self.node["tensor"]
        held = self.holder(tensor, node["region"], "frees", "D4")  # D4
        self.after(held.alloc, "D4", f"the alloc of %{tensor}")
        self.after(held.write, "D4", f"which wrote %{tensor}")
        for reader in held.reads:
            self.after(reader, "D4", f"which reads %{tensor}")
        self.arena.set(*node["region"], _Free(node["id"]))
        del self.region_of[tensor]
        self.held_bytes -= node["region"][1]

    # -- the program ------------------------------------------------------------------

    def base(self, task_id: int) -> int:
        """The task whose bytes `task_id` occupies: itself, or the base of what it views."""
        while self.tasks[task_id].is_view:
            task_id = self.tasks[task_id].inputs[0]
        return task_id

    def input_slice(self, task_id: int, source: int | None = None) -> bool:
        """Whether task `task_id` is a Slice read straight from an Input (`source`, if
        given)."""
        task = self.tasks[task_id]
        if task.kind != "slice" or self.tasks[task.inputs[0]].kind != "input":
            return False
        return source is None or task.inputs[0] == source

    def on_input(self) -> None:
        node, task = self.node, self.tasks[self.node["tensor"]]
        name = node.get("name", "")
        if task.kind != "input" or task.attrs.get("name") != name:  # P1
            raise self.broken("P1", f'%{task.id} is not the input "{name}"')
        if name in self.inputs_seen:
            raise self.broken("P1", f'input "{name}" appears a second time')
        self.inputs_seen.add(name)
        if "storage" in node:
            self.fill_whole(node["storage"], task, "input")
        else:
            self.write(task.id, node["region"])

    def at_element_boundary(self, tensor: int, offset: int) -> None:
        """S5: task `tensor`, seen at `offset`, starts at a multiple of its element size."""
        task = self.tasks[tensor]
        element = DTYPE_TABLE[task.dtype].bits // 8
        if offset % element:
            raise self.broken(
                "S5", f"{task.describe()} at offset {offset}, not a multiple of {element}"
            )

    def on_apply(self) -> None:
        node, task = self.node, self.tasks[self.node["tensor"]]
        if task.kind == "input":  # P2
            raise self.broken("P2", f"computes the input %{task.id}")
        again = node.get("recompute", False)
        if again not in (True, False) or "recompute" in node and again is not True:
            raise self.broken("P4", f"has recompute mark {again!r}, not true")
        if again and task.id not in self.computed:
            raise self.broken("P4", f"recomputes %{task.id}, which no earlier apply computed")
        if not again and task.id in self.computed and not self.input_slice(task.id):
            raise self.broken("P2", f"computes %{task.id} a second time")
        reads = node.get("reads", [])
        if len(reads) != len(task.inputs):
            raise self.broken("P2", f"reads {len(reads)} regions for {len(task.inputs)} operands")
        for operand, region in zip(task.inputs, reads, strict=True):
            self.read(self.base(operand), region)
            self.at_element_boundary(operand, region[0])  # S5
        self.write(task.id, node["region"])
        self.use_workspace(task)
        self.computed.add(task.id)

    def use_workspace(self, task: _Task) -> None:
        """The apply holds its kernel's workspace while it runs, then frees it (D6)."""
        region = self.node.get("workspace")
        if region is None:
            if task.workspace:
                raise self.broken("D6", f"{task.describe()} needs a workspace; none is held")
            return
        offset, size = region
        if not task.workspace:
            raise self.broken("D6", f"holds a workspace, but {task.describe()} needs none")
        if size < task.workspace or offset % self.alignment:
            raise self.broken(
                "D6",
                f"workspace [{offset}, +{size}) is not {task.workspace} aligned bytes for "
                f"{task.describe()}",
            )
        for state in self.arena.states_in(offset, size):
            if isinstance(state, _Held):
                raise self.broken(
                    "D6", f"its workspace takes bytes %{state.tensor} holds ({state.region})"
                )
            self.after(state.released_by, "D6", "which released bytes of its workspace")
        held = self.held_bytes + size  # D5, while the apply runs
        self.peak = max(self.peak, held)
        if held > self.budget:
            raise self.broken("D5", f"{held} bytes held with its workspace exceed {self.budget}")
        self.arena.set(offset, size, _Free(self.node["id"]))

    def on_output(self) -> None:
        node, name = self.node, self.node.get("name", "")
        if name not in self.outputs:  # P3
            raise self.broken("P3", f'"{name}" is not a program output')
        if name in self.outputs_seen:
            raise self.broken("P3", f'output "{name}" appears a second time')
        self.outputs_seen.add(name)
        base = self.base(self.outputs[name])
        if node["tensor"] != base:
            raise self.broken("P3", f'output "{name}" is held by %{base}, not %{node["tensor"]}')
        if "region" in node:
            self.read(base, node["region"])
            return
        storage = node["storage"]  # H5
        assembly = self.assemblies.get(storage)
        if assembly is not None and assembly.root == base:
            assembly.complete(self)
            self.computed.update(assembly.concats)
            return
        writes = self.storage_writes.get(storage)
        if self.storage_tensor.get(storage) != base or not writes:
            raise self.broken("H5", f"host#{storage} does not hold %{base}")
        self.after(writes[0], "H5", f"which wrote host#{storage}")

    def on_send(self) -> None:
        """P5: an output on the device, sent to another device (one send per link: an
        output sent to several devices is sent several times, and may be on the host too)."""
        node, name = self.node, self.node.get("name", "")
        if name not in self.outputs:
            raise self.broken("P5", f'sends "{name}", which is not a program output')
        base = self.base(self.outputs[name])
        if node["tensor"] != base:
            raise self.broken("P5", f'output "{name}" is held by %{base}, not %{node["tensor"]}')
        self.read(base, node["region"])
        self.outputs_seen.add(name)
        self.use_link()

    def on_recv(self) -> None:
        """P5: an input put on the device, received from another device."""
        self.on_input()
        self.use_link()

    def use_link(self) -> None:
        link = self.node.get("link")
        if not isinstance(link, int) or isinstance(link, bool) or link < 0:
            raise self.broken("P5", f"names link {link!r}, not a link index")
        earlier = self.links_seen.setdefault(link, self.node["id"])
        if earlier != self.node["id"]:
            raise self.broken("P5", f"uses link#{link}, which n{earlier} uses already")

    def check_whole_plan(self) -> None:
        inputs = {t.attrs["name"] for t in self.tasks if t.kind == "input"}
        if inputs - self.inputs_seen:  # P1
            raise self.broken("P1", f"input(s) {sorted(inputs - self.inputs_seen)} never appear")
        missing = [t.id for t in self.tasks if t.computed and t.id not in self.computed]
        if missing:  # P2
            raise self.broken("P2", f"task(s) {missing[:5]} are never computed")
        missing_outputs = sorted(set(self.outputs) - self.outputs_seen)
        if missing_outputs:  # P3
            raise self.broken("P3", f"output(s) {missing_outputs} never appear")
        unwritten = sorted(set(self.table) - set(self.storage_tensor))
        if unwritten:  # H1
            raise self.broken(
                "H1", f"the storage table lists host#{unwritten[0]}, which nothing writes"
            )

    # -- host storages ----------------------------------------------------------------

    def entry(self, storage: int, kind: str, task: _Task) -> dict:
        """Storage `storage`'s table entry, which must say it is filled as `kind` says
        with `task` (H1)."""
        entry = self.table.get(storage)
        if entry is None:
            raise self.broken("H1", f"host#{storage} is not in the plan's table of storages")
        said = (entry["kind"], entry["tensor"], tuple(entry["shape"]), entry["dtype"])
        if said != (kind, task.id, task.shape, task.dtype) or entry["nbytes"] != task.nbytes:
            raise self.broken(
                "H1",
                f"host#{storage}'s entry {entry} does not describe {kind} {task.describe()}, "
                f"{task.nbytes} bytes",
            )
        return entry

    def bind(self, storage: int, task_id: int) -> None:
        """Storage `storage` holds task `task_id` (H2)."""
        held = self.storage_tensor.setdefault(storage, task_id)
        if held != task_id:
            raise self.broken("H2", f"host#{storage} holds %{held}, not %{task_id}")

    def fill_whole(self, storage: int, task: _Task, kind: str) -> None:
        """The current node (an input or a whole offload) fills `storage` with `task`."""
        self.bind(storage, task.id)
        self.entry(storage, kind, task)
        if storage in self.storage_writes:
            first = self.storage_writes[storage][0]
            raise self.broken("H2", f"host#{storage} is filled again (n{first} filled it)")
        self.storage_writes[storage] = [self.node["id"]]

    def on_offload(self) -> None:
        node, task = self.node, self.tasks[self.node["tensor"]]
        self.read(task.id, node["region"])
        if "into" not in node:
            if "box" in node:
                raise self.broken("H2", "a whole offload carries a box")
            self.fill_whole(node["storage"], task, "offload")
            return
        storage, root = node["storage"], node["into"]  # H4
        self.bind(storage, root)
        assembly = self.assemblies.get(storage)
        if assembly is None:
            assembly = self.assemblies[storage] = _Assembly.of(self, root, storage)
        entry = self.entry(storage, "assembly", self.tasks[root])
        assembly.fill(self, task, node.get("box"), entry)
        self.storage_writes.setdefault(storage, []).append(node["id"])

    def on_reload(self) -> None:
        node, task = self.node, self.tasks[self.node["tensor"]]
        storage = node["storage"]
        if storage in self.assemblies:  # H3
            raise self.broken("H3", f"reloads host#{storage}, an output assembled on the host")
        writes = self.storage_writes.get(storage)
        if not writes:
            raise self.broken("H3", f"reloads host#{storage}, which nothing wrote yet")
        held = self.storage_tensor[storage]
        box = node.get("box")
        if held == task.id:
            if box is not None:
                raise self.broken("H3", f"reloads all of host#{storage} but carries a box")
        elif self.input_slice(task.id, held):
            self.check_slice_box(storage, task, box)
            self.computed.add(task.id)
        else:
            raise self.broken("H3", f"reloads %{task.id} from host#{storage}, which holds %{held}")
        self.after(writes[0], "H3", f"which wrote host#{storage}")
        self.write(task.id, node["region"])

    def check_slice_box(self, storage: int, task: _Task, box: dict | None) -> None:
        """A sliced reload's box: the Slice `task`'s box of the input in `storage` (H3)."""
        if box is None:
            raise self.broken("H3", f"a sliced reload of %{task.id} carries no box")
        entry = self.table[storage]
        _box_inside(self, box, entry, "H3")
        if tuple(box["sizes"]) != task.shape or entry["dtype"] != task.dtype:
            raise self.broken(
                "H3", f"box {box} of host#{storage} is not the shape of {task.describe()}"
            )
        if list(box["starts"]) != list(task.attrs["starts"]):
            raise self.broken("H3", f"box {box} does not start where %{task.id} slices")

    # -- the host tier (P6) -----------------------------------------------------------

    def check_tier_table(self) -> None:
        """Before any node: places on disk inside their files, in files of the right kind,
        the spill places apart; none at all without a tier."""
        placed = [entry for entry in self.table.values() if "disk" in entry]
        if self.tier is None:
            if placed:
                raise self.broken("P6", f"host#{placed[0]['id']} is on disk, with no tier")
            return
        files = self.tier["files"]
        spill: list[tuple[int, int, int, int]] = []
        for entry in placed:
            file, offset = entry["disk"][:2]
            if not 0 <= file < len(files):
                raise self.broken("P6", f"host#{entry['id']} is in file#{file}: no such file")
            if offset < 0 or offset + entry["nbytes"] > files[file]["nbytes"]:
                raise self.broken("P6", f"host#{entry['id']} does not fit file#{file} at {offset}")
            kind = "checkpoint" if entry["kind"] == "input" else "spill"
            if files[file]["kind"] != kind:
                raise self.broken("P6", f"host#{entry['id']} is not in a {kind} file")
            if len(entry["disk"]) == 3:  # transposed: [file, offset, [rows, cols]]
                rows, cols = entry["disk"][2]
                if kind != "checkpoint":
                    raise self.broken("P6", f"host#{entry['id']} is transposed in a spill file")
                matrix = rows * cols * DTYPE_TABLE[entry["dtype"]].itemsize
                if rows < 1 or cols < 1 or matrix != entry["nbytes"]:
                    raise self.broken(
                        "P6", f"host#{entry['id']}'s transposed {rows}x{cols} is not its bytes"
                    )
            if kind == "spill":
                spill.append((file, offset, offset + entry["nbytes"], entry["id"]))
        for i, (file, start, end, sid) in enumerate(spill):
            for other, start2, end2, sid2 in spill[:i]:
                if file == other and start < end2 and start2 < end:
                    raise self.broken("P6", f"host#{sid} and host#{sid2} share bytes on disk")

    def check_slot(self) -> None:
        """A slot, or a read, write or release, only with a tier; a slot inside its arena."""
        node = self.node
        if self.tier is None:
            if "slot" in node or node["kind"] in ("read", "write", "release"):
                raise self.broken("P6", "names a host slot or moves a storage, with no tier")
            return
        if node["kind"] in ("read", "write", "release") and "slot" not in node:
            raise self.broken("P6", f"a {node['kind']} names no slot")
        if "slot" in node:
            offset, size = node["slot"]
            if offset < 0 or size < 1 or offset + size > self.tier["budget"]:
                raise self.broken("P6", f"slot [{offset}, +{size}) is not in the host arena")

    def tier_copy(self) -> None:
        """An offload, reload or output of a storage the tier holds names its slot; an
        offload fills it (or fills it again), the others use it."""
        node = self.node
        if self.tier is None:
            return
        storage = node.get("storage")
        entry = None if storage is None else self.table.get(storage)
        if entry is None or not _tier_holds(entry):
            if "slot" in node:
                raise self.broken("P6", "names a slot for what the tier does not hold")
            return
        if "slot" not in node:
            raise self.broken("P6", f"names no slot for host#{storage}, which the tier holds")
        if node["kind"] == "offload" and self.key(storage) not in self.occupying:
            if entry["kind"] == "assembly" and storage in self.occupied:
                raise self.broken("P6", f"fills host#{storage} afresh, losing its boxes")
            self.fill_slot(entry)
            return
        here = self.occupying_now(storage)
        if node["kind"] == "offload":
            here.fills.append(node["id"])
            return
        self.after_fills(here, storage)
        here.uses.append(node["id"])
        if node["kind"] == "output":
            here.output = node["id"]

    def key(self, storage: int) -> tuple:
        """The key of storage `storage`'s occupancy of the current node's slot."""
        return (storage, *self.node["slot"])

    def occupying_now(self, storage: int) -> _Occupying:
        """Storage `storage`'s occupancy of the current node's slot, which must be live."""
        here = self.occupying.get(self.key(storage))
        if here is None:
            raise self.broken("P6", f"host#{storage} is not in slot {self.node['slot']}")
        return here

    def after_fills(self, here: _Occupying, storage: int) -> None:
        for fill in here.fills:
            self.after(fill, "P6", f"which filled host#{storage}'s slot")

    def fill_slot(self, entry: dict) -> None:
        """The current node fills storage `entry` into its slot."""
        offset, size = self.node["slot"]
        if size < entry["nbytes"]:
            raise self.broken("P6", f"a slot of {size} bytes cannot hold host#{entry['id']}")
        for (sid, start, length), _ in self.occupying.items():
            if start < offset + size and offset < start + length:
                raise self.broken("P6", f"its slot overlaps host#{sid}'s, still occupied")
        for start, end, release in self.released:
            if start < offset + size and offset < end:
                self.after(release, "P6", "which released bytes of its slot")
        self.occupying[self.key(entry["id"])] = _Occupying((offset, size), [self.node["id"]], [])
        self.occupied.add(entry["id"])
        self.host_held += size
        if self.host_held > self.tier["budget"]:
            raise self.broken("P6", f"{self.host_held} host bytes held exceed the host budget")

    def tier_entry(self) -> dict:
        """The storage a read, write or release names: listed, of its tensor, on the tier."""
        storage, tensor = self.node.get("storage"), self.node["tensor"]
        entry = self.table.get(storage)
        if entry is None or entry["tensor"] != tensor or not _tier_holds(entry):
            raise self.broken("P6", f"host#{storage} is no storage of %{tensor} on the tier")
        return entry

    def on_read(self) -> None:
        entry = self.tier_entry()
        if "disk" not in entry:
            raise self.broken("P6", f"reads host#{entry['id']}, which has no place on disk")
        if self.tier["files"][entry["disk"][0]]["kind"] == "spill":
            write = self.spill_writes.get(entry["id"])
            if write is None:
                raise self.broken("P6", f"reads host#{entry['id']} before any write of it")
            self.after(write, "P6", f"which wrote host#{entry['id']} to the spill file")
        self.fill_slot(entry)

    def on_write(self) -> None:
        entry = self.tier_entry()
        if "disk" not in entry or self.tier["files"][entry["disk"][0]]["kind"] != "spill":
            raise self.broken("P6", f"writes host#{entry['id']}, which has no spill place")
        here = self.occupying_now(entry["id"])
        self.after_fills(here, entry["id"])
        here.uses.append(self.node["id"])
        self.spill_writes[entry["id"]] = self.node["id"]

    def on_release(self) -> None:
        entry = self.tier_entry()
        here = self.occupying_now(entry["id"])
        if here.output is not None:
            raise self.broken("P6", f"releases host#{entry['id']}, which n{here.output} keeps")
        self.after_fills(here, entry["id"])
        for use in here.uses:
            self.after(use, "P6", f"which used host#{entry['id']}'s slot")
        offset, size = here.slot
        self.released.append((offset, offset + size, self.node["id"]))
        del self.occupying[self.key(entry["id"])]
        self.host_held -= size


@dataclass
class _Occupying:
    """A storage in `slot` (offset, size) since node `fills[0]`: the nodes that filled it,
    those that used it since, and the host output that keeps it (if any)."""

    slot: tuple[int, int]
    fills: list[int]
    uses: list[int]
    output: int | None = None


def _tier_holds(entry: dict) -> bool:
    """P6: whether the tier holds a storage (by its table entry)."""
    return entry["kind"] != "input" or "disk" in entry


def _box_inside(replay: _Replay, box: dict, entry: dict, rule: str) -> None:
    """`box` has a start and a size per axis of storage `entry`, and lies inside it."""
    shape = entry["shape"]
    starts, sizes = box["starts"], box["sizes"]
    if not len(starts) == len(sizes) == len(shape) or not all(
        start >= 0 and size >= 1 and start + size <= dim
        for start, size, dim in zip(starts, sizes, shape, strict=True)
    ):
        raise replay.broken(rule, f"box {box} does not lie inside host#{entry['id']} {shape}")


@dataclass
class _Assembly:
    """Output `root` assembled in host storage `storage`: each leaf's box (by its base
    tensor), the Concats of the tree, which element is written, and by which offloads."""

    root: int
    storage: int
    leaves: dict[int, tuple[tuple[int, ...], tuple[int, ...]]]  # base -> (starts, sizes)
    concats: list[int]
    written: np.ndarray  # one flag per element of the output
    offloads: dict[int, int]  # leaf base -> the sliced offload that wrote it

    @classmethod
    def of(cls, replay: _Replay, root: int, storage: int) -> _Assembly:
        """Walk the tree of output Concats under `root`, placing each leaf (H4)."""
        tasks = replay.tasks

        def assembles(task_id: int) -> bool:
            return tasks[task_id].kind == "concat" and tasks[task_id].block_kind == "output"

        if not assembles(root):
            raise replay.broken("H4", f"%{root} is not a Concat that assembles a program output")
        leaves: dict[int, tuple[tuple[int, ...], tuple[int, ...]]] = {}
        concats: list[int] = []

        def place(task_id: int, starts: tuple[int, ...]) -> None:
            task = tasks[task_id]
            if not assembles(task_id):
                base = replay.base(task_id)
                if base in leaves:
                    raise replay.broken("H4", f"%{base} is two leaves of output %{root}")
                leaves[base] = (starts, task.shape)
                return
            concats.append(task_id)
            axis = task.attrs["axis"] % len(task.shape)
            offset = starts[axis]
            for operand in task.inputs:
                place(operand, starts[:axis] + (offset,) + starts[axis + 1 :])
                offset += tasks[operand].shape[axis]

        place(root, (0,) * len(tasks[root].shape))
        written = np.zeros(tasks[root].shape, dtype=bool)
        return cls(root, storage, leaves, concats, written, {})

    def fill(self, replay: _Replay, task: _Task, box: dict | None, entry: dict) -> None:
        """A sliced offload writes `task` into `box` of the storage (H4)."""
        if box is None:
            raise replay.broken("H4", f"a sliced offload into host#{self.storage} carries no box")
        _box_inside(replay, box, entry, "H4")
        starts, sizes = tuple(box["starts"]), tuple(box["sizes"])
        nbytes = math.prod(sizes) * DTYPE_TABLE[entry["dtype"]].itemsize
        if nbytes != task.nbytes or entry["dtype"] != task.dtype:
            raise replay.broken(
                "H4", f"box {box} of host#{self.storage} cannot hold {task.describe()}"
            )
        index = tuple(slice(s, s + n) for s, n in zip(starts, sizes, strict=True))
        if self.written[index].any():
            raise replay.broken("H4", f"box {box} of host#{self.storage} is written a second time")
        if task.id not in self.leaves:
            raise replay.broken("H4", f"%{task.id} is not a leaf of output %{self.root}")
        if self.leaves[task.id] != (starts, sizes):
            raise replay.broken("H4", f"%{task.id}'s box in output %{self.root} is not {box}")
        self.written[index] = True
        self.offloads[task.id] = replay.node["id"]

    def complete(self, replay: _Replay) -> None:
        """The host output of the assembly: every element written, before it (H5)."""
        if not self.written.all():
            missing = sorted(set(self.leaves) - set(self.offloads))
            raise replay.broken("H5", f"host#{self.storage} misses the boxes of {missing[:5]}")
        for leaf, offload in self.offloads.items():
            replay.after(offload, "H5", f"which wrote %{leaf} into host#{self.storage}")
