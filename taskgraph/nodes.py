"""TaskGraph nodes: a closed set of op kinds and the `Task` record that carries one.

Op kinds (each an immutable record with the attributes of that kind):

* `Input`   – a program input (an activation, a weight or a state), with where it
  starts and the domain its values lie in.
* `Einsum`  – the one compute op: a generalized einsum (spec, join, agg).
* `Fill`    – a constant tensor: all `value`, or a causal mask pattern.
* `Gather`  – rows of a table picked by integer ids (an embedding lookup).
* `View`    – the same bytes with another shape (a reshape of a contiguous tensor).
* `Slice`   – a box-shaped region copied out of a tensor.
* `Concat`  – tensors joined along one axis.
* `ArgReduce` – the index (int64) of the largest or smallest element along the last axis.
* `KthLargest` – the k-th largest value along the last axis (a top-k threshold).
* `ScatterAdd` – rows summed into a table by integer ids (a gather's gradient).

A task may also carry a `Block` (`taskgraph.blocks`): its provenance when a pass
(partitioning) made it from a larger task – which original task, which region of its
output, and in what role (a block, a partial aggregate, an assembly copy, an assembled
output) – and facts (`taskgraph.facts`): what its tensor is (a KV page, the gradient or
the update of an input, ...), stated where it was made.

Every op knows how to check its operands and infer its output shape (`infer`), how
many FLOPs it costs (`flops`), how to describe itself on one line, and its JSON form
(`attributes`, `from_attributes`); `is_compute` and `aliases_input` say whether the
device runs it and whether it is another name for its operand's bytes.

Adding an op kind: a frozen dataclass here (listed in `OP_KINDS`), and its entry in
each per-kind table (`taskgraph.dispatch.OpTable`, checked complete at import): the
reference kernel (`taskgraph.evaluate.REFERENCE_KERNELS`, which the NumPy backend
runs too), the partition rule (`taskgraph.partition.rules.RULES`) and the CuPy kernel
(`runtime.cupy_backend.CupyKernels.HANDLERS`). `tests/test_op_coverage.py` then wants
a sample of it in its program.

FLOP convention: an einsum costs, per point of its iteration space (the product of
all index sizes, each index once: a trace `ii->` has n points), one FLOP per
arithmetic operation of its join (a plain einsum of k operands has k-1
multiplications) plus one for the aggregation when an index is reduced, and at least
one. So a matmul costs 2·m·n·k (a multiply-add is 2 FLOPs) and
an elementwise op 1 per element. Data-movement ops (fill, gather, slice, concat)
count 1 per output element; a view costs nothing; the last-axis selections (argreduce,
kth_largest) count 1 per operand element.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field, fields, replace
from typing import Any, ClassVar

from einpage_core.errors import DTypeError, GraphError, ShapeError, SpecError
from einpage_core.units import format_bytes
from taskgraph import dtypes
from taskgraph.blocks import BLOCK_KINDS, Block
from taskgraph.einsum import EinsumSpec
from taskgraph.expr import Expr, default_join
from taskgraph.expr import parse as parse_join
from taskgraph.facts import Fact

__all__ = [
    "Shape",
    "Operand",
    "Op",
    "Input",
    "Einsum",
    "Fill",
    "Gather",
    "View",
    "Slice",
    "Concat",
    "ArgReduce",
    "KthLargest",
    "ScatterAdd",
    "OP_KINDS",
    "is_input_slice",
    "Block",
    "BLOCK_KINDS",
    "AGGS",
    "ROLES",
    "LOCATIONS",
    "DOMAINS",
    "Task",
    "with_blocks",
]

Shape = tuple[int, ...]
AGGS = ("sum", "max", "min", "prod")
"""Aggregations over reduced einsum indices."""
ROLES = ("activation", "weight", "state")
"""What an input is: an activation (data of this run), a weight, or a state (e.g. an
optimizer's moments: read only at the update, so it starts on the host like a weight)."""
LOCATIONS = ("host", "device")
DOMAINS = ("real", "nonnegative", "positive", "fraction")
"""Where an input's values lie, as the program states it (what a random draw must
respect, e.g. `einpage run --random-inputs`): "real" any value (the default);
"nonnegative" x >= 0 (AdamW's second moment, a learning rate); "positive" x > 0 (for
integers x >= 1: a step count); "fraction" 0 <= x < 1, floats only (Adam's betas)."""


@dataclass(frozen=True, slots=True)
class Operand:
    """What an op needs to know of an operand: its shape and dtype."""

    shape: Shape
    dtype: str


def check_shape(shape: Any, what: str) -> Shape:
    """Return `shape` as a tuple of positive ints, or raise `ShapeError` naming `what`."""
    try:
        dims = tuple(shape)
    except TypeError:
        raise ShapeError(f"{what}: shape must be a sequence of ints, got {shape!r}") from None
    for dim in dims:
        if isinstance(dim, bool) or not isinstance(dim, int) and not hasattr(dim, "__index__"):
            raise ShapeError(f"{what}: shape {shape!r} has a non-integer dimension {dim!r}")
        if int(dim) <= 0:
            raise ShapeError(f"{what}: shape {tuple(shape)} has a non-positive dimension {dim}")
    return tuple(int(d) for d in dims)


def _given_shape(op: Op, shape: Shape | None) -> Shape:
    if shape is None:
        raise GraphError(f"{op.kind} needs an explicit output shape")
    return check_shape(shape, op.kind)


def _expect_arity(op: Op, operands: Sequence[Operand], count: int) -> None:
    if len(operands) != count:
        raise GraphError(f"{op.kind} takes {count} operand(s), got {len(operands)}")


class Op:
    """Base of the op records; subclasses are frozen slotted dataclasses."""

    __slots__ = ()
    kind: ClassVar[str]
    is_compute: ClassVar[bool] = True
    """A step the device executes (False for inputs, which arrive, and views, which alias)."""
    aliases_input: ClassVar[bool] = False
    """The output is operand 0's bytes under another shape: no memory and no work of its own."""
    optional_attributes: ClassVar[frozenset[str]] = frozenset()
    """Attributes that JSON may leave out (written by newer versions; the default then)."""

    def infer(
        self, operands: Sequence[Operand], shape: Shape | None, dtype: str | None
    ) -> tuple[Shape, str]:
        """Check the operands and return the output (shape, dtype).

        `shape` and `dtype` are what the caller asks for, or None: ops whose shape is
        not implied by their operands (input, fill, view, slice) need `shape`; for the
        others the builder checks that a requested shape matches the inferred one.
        """
        raise NotImplementedError

    def flops(self, operands: Sequence[Operand], shape: Shape) -> int:
        """FLOPs of one execution (see the module docstring for the convention)."""
        return math.prod(shape)

    def describe(self) -> str:
        """The op and its attributes as shown in a TaskGraph line, e.g. `einsum["ij,jk->ik"]`."""
        return self.kind

    def attributes(self) -> dict[str, Any]:
        """The op's attributes as JSON-ready values (the `kind` is stored beside them)."""
        return {}

    @classmethod
    def from_attributes(cls, attrs: dict[str, Any]) -> Op:
        """The op of this kind with the JSON attributes `attrs` (as `attributes` writes
        them; their names are checked by `op_from_attributes`), validated by the op."""
        return cls(**attrs)


@dataclass(frozen=True, slots=True)
class Input(Op):
    """A program input. `role` says what it is (`ROLES`), `location` where it starts
    (weights on the host by default), `domain` where its values lie (`DOMAINS`: data of
    the program, set where the input is made, e.g. "nonnegative" for AdamW's second
    moment; JSON written before it existed reads as "real")."""

    kind: ClassVar[str] = "input"
    is_compute: ClassVar[bool] = False
    optional_attributes: ClassVar[frozenset[str]] = frozenset({"domain"})
    name: str
    role: str = "activation"
    location: str = "device"
    domain: str = "real"

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise GraphError(f"input name must be a non-empty string, got {self.name!r}")
        if self.role not in ROLES:
            raise GraphError(f"input {self.name!r}: role must be one of {ROLES}, got {self.role!r}")
        if self.location not in LOCATIONS:
            raise GraphError(
                f"input {self.name!r}: location must be one of {LOCATIONS}, got {self.location!r}"
            )
        if self.domain not in DOMAINS:
            raise GraphError(
                f"input {self.name!r}: domain must be one of {DOMAINS}, got {self.domain!r}"
            )

    def infer(
        self, operands: Sequence[Operand], shape: Shape | None, dtype: str | None
    ) -> tuple[Shape, str]:
        _expect_arity(self, operands, 0)
        name = dtypes.canonical(dtype or "float32")
        if self.domain == "fraction" and not dtypes.is_float(name):
            raise DTypeError(
                f"input {self.name!r}: domain 'fraction' (0 <= x < 1) needs a float dtype, "
                f"got {name}"
            )
        return _given_shape(self, shape), name

    def flops(self, operands: Sequence[Operand], shape: Shape) -> int:
        return 0

    def describe(self) -> str:
        domain = "" if self.domain == "real" else f", {self.domain}"
        return f'input["{self.name}", {self.role}, {self.location}{domain}]'

    def attributes(self) -> dict[str, Any]:
        """The default domain "real" is left out: files say only what narrows it, and a
        file written before domains existed is written back byte for byte."""
        attrs = {"name": self.name, "role": self.role, "location": self.location}
        if self.domain != "real":
            attrs["domain"] = self.domain
        return attrs


@dataclass(frozen=True, slots=True)
class Einsum(Op):
    """`out[O] = agg over reduced indices of join(in0[I0], in1[I1], ...)`.

    `join` is None for the plain product `a * b * ...`; `agg` applies only when some
    index is reduced. An index repeated inside one operand's term reads that operand's
    diagonal (`"ii->i"`, `"iij,jk->ik"`); the iteration space has each index once.
    """

    kind: ClassVar[str] = "einsum"
    spec: EinsumSpec
    join: Expr | None = None
    agg: str = "sum"

    def __post_init__(self) -> None:
        if self.agg not in AGGS:
            raise SpecError(f"unknown agg {self.agg!r}; valid: {', '.join(AGGS)}")
        if self.join is not None:
            used = self.join.variables()
            if used and max(used) >= len(self.spec.inputs):
                raise SpecError(
                    f"join {str(self.join)!r} reads operand {max(used)} but spec "
                    f"{str(self.spec)!r} has {len(self.spec.inputs)} operand(s)"
                )

    @property
    def is_plain(self) -> bool:
        """A plain einsum: product join and sum aggregation (a contraction)."""
        return self.join is None and self.agg == "sum"

    @property
    def join_expr(self) -> Expr:
        """The join as an expression tree (the product when `join` is None)."""
        return self.join if self.join is not None else default_join(len(self.spec.inputs))

    def infer(
        self, operands: Sequence[Operand], shape: Shape | None, dtype: str | None
    ) -> tuple[Shape, str]:
        out_shape = self.spec.output_shape([o.shape for o in operands])
        for position, operand in enumerate(operands[1:], start=1):
            if operand.dtype != operands[0].dtype:
                raise DTypeError(
                    f"einsum {str(self.spec)!r}: operand {position} is {operand.dtype} but "
                    f"operand 0 is {operands[0].dtype}; cast explicitly (e.g. ops.cast)"
                )
        return out_shape, dtypes.canonical(dtype or operands[0].dtype)

    def flops(self, operands: Sequence[Operand], shape: Shape) -> int:
        points = self.spec.iteration_size([o.shape for o in operands])
        per_point = self.join_expr.count_ops() + (1 if self.spec.reduced else 0)
        return points * max(1, per_point)

    def describe(self) -> str:
        extra = ""
        if self.join is not None:
            extra += f', join="{self.join}"'
        if self.agg != "sum" and self.spec.reduced:
            extra += f", agg={self.agg}"
        return f'einsum["{self.spec}"{extra}]'

    def attributes(self) -> dict[str, Any]:
        return {
            "spec": str(self.spec),
            "join": None if self.join is None else str(self.join),
            "agg": self.agg,
        }

    @classmethod
    def from_attributes(cls, attrs: dict[str, Any]) -> Einsum:
        spec = EinsumSpec.parse(attrs["spec"])
        join = attrs["join"]
        parsed = None if join is None else parse_join(join, len(spec.inputs))
        return cls(spec, parsed, attrs["agg"])


@dataclass(frozen=True, slots=True)
class Fill(Op):
    """A constant tensor. `pattern="full"`: every element is `value`.

    `pattern="causal"`: over the last two axes (query q, key k), `value` where k > q
    and 0 elsewhere – the additive causal attention mask (use `value=-inf`).
    `origin` is the global position of element [0, ..., 0] (all zeros by default), so
    a block of a larger mask computes its own part.
    """

    kind: ClassVar[str] = "fill"
    value: float
    pattern: str = "full"
    origin: tuple[int, ...] = field(default=())

    PATTERNS: ClassVar[tuple[str, ...]] = ("full", "causal")

    def __post_init__(self) -> None:
        if self.pattern not in self.PATTERNS:
            raise GraphError(f"unknown fill pattern {self.pattern!r}; valid: {self.PATTERNS}")
        if isinstance(self.value, bool) or not isinstance(self.value, int | float):
            raise GraphError(f"fill value must be a number, got {self.value!r}")
        origin = tuple(self.origin)
        if not all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in origin):
            raise GraphError(f"fill origin must be non-negative ints, got {self.origin!r}")
        object.__setattr__(self, "value", float(self.value))
        object.__setattr__(self, "origin", origin)

    def infer(
        self, operands: Sequence[Operand], shape: Shape | None, dtype: str | None
    ) -> tuple[Shape, str]:
        _expect_arity(self, operands, 0)
        out_shape = _given_shape(self, shape)
        out_dtype = dtypes.canonical(dtype or "float32")
        if not dtypes.is_float(out_dtype):
            raise DTypeError(f"fill: dtype must be a float type, got {out_dtype}")
        if self.origin and len(self.origin) != len(out_shape):
            raise ShapeError(f"fill: origin {self.origin} does not match rank {len(out_shape)}")
        if self.pattern == "causal" and len(out_shape) < 2:
            raise ShapeError(f"fill: a causal mask needs rank >= 2, got shape {out_shape}")
        return out_shape, out_dtype

    def describe(self) -> str:
        origin = f", origin={list(self.origin)}" if any(self.origin) else ""
        return f"fill[{self.pattern}, {self.value}{origin}]"

    def attributes(self) -> dict[str, Any]:
        return {
            "value": _json_float(self.value),
            "pattern": self.pattern,
            "origin": list(self.origin),
        }

    @classmethod
    def from_attributes(cls, attrs: dict[str, Any]) -> Fill:
        value = attrs["value"]
        if isinstance(value, str) and value not in ("inf", "-inf", "nan"):
            raise GraphError(f"fill value must be a number or 'inf'/'-inf'/'nan', got {value!r}")
        return cls(float(value), attrs["pattern"], tuple(attrs["origin"]))


@dataclass(frozen=True, slots=True)
class Gather(Op):
    """`out[i..., rest...] = table[ids[i...], rest...]`: rows of `table` (operand 0) by `ids`."""

    kind: ClassVar[str] = "gather"

    def infer(
        self, operands: Sequence[Operand], shape: Shape | None, dtype: str | None
    ) -> tuple[Shape, str]:
        _expect_arity(self, operands, 2)
        table, ids = operands
        if ids.dtype not in dtypes.INT_DTYPES:
            raise DTypeError(f"gather: ids must be an integer dtype, got {ids.dtype}")
        if not table.shape:
            raise ShapeError("gather: the table must have at least one dimension")
        return ids.shape + table.shape[1:], table.dtype


@dataclass(frozen=True, slots=True)
class View(Op):
    """The operand's bytes reinterpreted with another shape of the same element count."""

    kind: ClassVar[str] = "view"
    is_compute: ClassVar[bool] = False
    aliases_input: ClassVar[bool] = True

    def infer(
        self, operands: Sequence[Operand], shape: Shape | None, dtype: str | None
    ) -> tuple[Shape, str]:
        _expect_arity(self, operands, 1)
        out_shape = _given_shape(self, shape)
        if math.prod(out_shape) != math.prod(operands[0].shape):
            raise ShapeError(
                f"view: cannot view shape {operands[0].shape} ({math.prod(operands[0].shape)} "
                f"elements) as {out_shape} ({math.prod(out_shape)} elements)"
            )
        return out_shape, operands[0].dtype

    def flops(self, operands: Sequence[Operand], shape: Shape) -> int:
        return 0


@dataclass(frozen=True, slots=True)
class Slice(Op):
    """`out = in[starts[0]:starts[0]+shape[0], ...]`: a box of the operand, copied."""

    kind: ClassVar[str] = "slice"
    starts: tuple[int, ...]

    def __post_init__(self) -> None:
        starts = tuple(self.starts)
        if not all(isinstance(x, int) and not isinstance(x, bool) for x in starts):
            raise GraphError(f"slice: starts must be ints, got {self.starts!r}")
        object.__setattr__(self, "starts", starts)

    def infer(
        self, operands: Sequence[Operand], shape: Shape | None, dtype: str | None
    ) -> tuple[Shape, str]:
        _expect_arity(self, operands, 1)
        out_shape = _given_shape(self, shape)
        source = operands[0].shape
        if len(self.starts) != len(source) or len(out_shape) != len(source):
            raise ShapeError(
                f"slice: starts {list(self.starts)} and shape {out_shape} must both have the "
                f"operand's rank {len(source)}"
            )
        for axis, (start, size, dim) in enumerate(zip(self.starts, out_shape, source, strict=True)):
            if start < 0 or start + size > dim:
                raise ShapeError(
                    f"slice: axis {axis} range [{start}, {start + size}) is outside the "
                    f"operand's extent {dim}"
                )
        return out_shape, operands[0].dtype

    def describe(self) -> str:
        return f"slice{list(self.starts)}"

    def attributes(self) -> dict[str, Any]:
        return {"starts": list(self.starts)}


@dataclass(frozen=True, slots=True)
class Concat(Op):
    """The operands joined along `axis`; all other dimensions must agree."""

    kind: ClassVar[str] = "concat"
    axis: int

    def __post_init__(self) -> None:
        if not isinstance(self.axis, int) or isinstance(self.axis, bool):
            raise GraphError(f"concat: axis must be an int, got {self.axis!r}")

    def infer(
        self, operands: Sequence[Operand], shape: Shape | None, dtype: str | None
    ) -> tuple[Shape, str]:
        if not operands:
            raise GraphError("concat needs at least one operand")
        first = operands[0]
        if not 0 <= self.axis < len(first.shape):
            raise ShapeError(
                f"concat: axis {self.axis} is out of range for rank {len(first.shape)}"
            )
        for position, operand in enumerate(operands[1:], start=1):
            if operand.dtype != first.dtype:
                raise DTypeError(
                    f"concat: operand {position} is {operand.dtype} but operand 0 is {first.dtype}"
                )
            other = tuple(d for i, d in enumerate(operand.shape) if i != self.axis)
            mine = tuple(d for i, d in enumerate(first.shape) if i != self.axis)
            if len(operand.shape) != len(first.shape) or other != mine:
                raise ShapeError(
                    f"concat along axis {self.axis}: operand {position} has shape "
                    f"{operand.shape}, incompatible with operand 0's {first.shape}"
                )
        total = sum(o.shape[self.axis] for o in operands)
        return first.shape[: self.axis] + (total,) + first.shape[self.axis + 1 :], first.dtype

    def describe(self) -> str:
        return f"concat[axis={self.axis}]"

    def attributes(self) -> dict[str, Any]:
        return {"axis": self.axis}


@dataclass(frozen=True, slots=True)
class ScatterAdd(Op):
    """`out[r - start, rest...] = sum of src[i..., rest...] over every i with ids[i...] == r`,
    for the rows r in `[start, start + out.shape[0])`; ids outside that range add nothing.

    Operands: `src` (operand 0, shape `ids.shape + rest`) and the integer `ids`
    (operand 1). The output shape `(rows, *rest)` is given by the caller (the table's
    rows are not implied by the operands). It is the gradient of a `Gather` with
    respect to its table (`start` 0, every id in range); `start` lets a partitioned
    block compute rows `[start, start + rows)` of a larger table.
    """

    kind: ClassVar[str] = "scatter_add"
    start: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.start, int) or isinstance(self.start, bool) or self.start < 0:
            raise GraphError(f"scatter_add: start must be an int >= 0, got {self.start!r}")

    def infer(
        self, operands: Sequence[Operand], shape: Shape | None, dtype: str | None
    ) -> tuple[Shape, str]:
        _expect_arity(self, operands, 2)
        src, ids = operands
        if ids.dtype not in dtypes.INT_DTYPES:
            raise DTypeError(f"scatter_add: ids must be an integer dtype, got {ids.dtype}")
        out_shape = _given_shape(self, shape)
        if not out_shape:
            raise ShapeError("scatter_add: the output needs a row axis (rank >= 1)")
        k = len(ids.shape)
        if src.shape[:k] != ids.shape or out_shape[1:] != src.shape[k:]:
            raise ShapeError(
                f"scatter_add: src {src.shape} must be ids {ids.shape} followed by the output's "
                f"row shape {out_shape[1:]} (output {out_shape})"
            )
        return out_shape, src.dtype

    def flops(self, operands: Sequence[Operand], shape: Shape) -> int:
        return max(1, math.prod(operands[0].shape))  # one addition per source element

    def describe(self) -> str:
        return f"scatter_add[start={self.start}]" if self.start else "scatter_add"

    def attributes(self) -> dict[str, Any]:
        return {"start": self.start}


def _last_axis_operand(op: Op, operands: Sequence[Operand]) -> Operand:
    """The one operand of an op that reduces the last axis, checked to have one."""
    _expect_arity(op, operands, 1)
    (operand,) = operands
    if not operand.shape:
        raise ShapeError(f"{op.kind}: the operand must have at least one dimension, got a scalar")
    return operand


@dataclass(frozen=True, slots=True)
class ArgReduce(Op):
    """`out[i...] = argmax_j in[i..., j]` (or argmin): the position of the largest
    (smallest) element along the operand's last axis, as int64 ids – a greedy next token
    from logits, ready for a `Gather`. Ties go to the first position (NumPy's rule).

    A reduction whose result is a position cannot be combined from partial results by
    a value aggregate, which is why it is its own op kind and not an einsum `agg`.
    """

    kind: ClassVar[str] = "argreduce"
    agg: str = "argmax"

    AGGS: ClassVar[tuple[str, ...]] = ("argmax", "argmin")

    def __post_init__(self) -> None:
        if self.agg not in self.AGGS:
            raise GraphError(f"unknown argreduce agg {self.agg!r}; valid: {', '.join(self.AGGS)}")

    def infer(
        self, operands: Sequence[Operand], shape: Shape | None, dtype: str | None
    ) -> tuple[Shape, str]:
        operand = _last_axis_operand(self, operands)
        if dtype is not None and dtypes.canonical(dtype) != "int64":
            raise DTypeError(f"{self.agg}: the ids are int64, got dtype {dtype!r}")
        return operand.shape[:-1], "int64"

    def flops(self, operands: Sequence[Operand], shape: Shape) -> int:
        return math.prod(operands[0].shape)  # one comparison per element

    def describe(self) -> str:
        return f"argreduce[{self.agg}]"

    def attributes(self) -> dict[str, Any]:
        return {"agg": self.agg}


@dataclass(frozen=True, slots=True)
class KthLargest(Op):
    """`out[i...]` = the `k`-th largest of `in[i..., :]` (k=1: the maximum), in the
    operand's dtype: the threshold of top-k sampling (keep the elements >= it)."""

    kind: ClassVar[str] = "kth_largest"
    k: int

    def __post_init__(self) -> None:
        if isinstance(self.k, bool) or not isinstance(self.k, int) or self.k <= 0:
            raise GraphError(f"kth_largest: k must be a positive int, got {self.k!r}")

    def infer(
        self, operands: Sequence[Operand], shape: Shape | None, dtype: str | None
    ) -> tuple[Shape, str]:
        operand = _last_axis_operand(self, operands)
        if self.k > operand.shape[-1]:
            raise ShapeError(
                f"kth_largest: k={self.k} exceeds the last axis' extent {operand.shape[-1]}"
            )
        if dtype is not None and dtypes.canonical(dtype) != operand.dtype:
            raise DTypeError(f"kth_largest: the result has the operand's dtype {operand.dtype}")
        return operand.shape[:-1], operand.dtype

    def flops(self, operands: Sequence[Operand], shape: Shape) -> int:
        return math.prod(operands[0].shape)  # a selection: linear in the elements

    def describe(self) -> str:
        return f"kth_largest[k={self.k}]"

    def attributes(self) -> dict[str, Any]:
        return {"k": self.k}


OP_KINDS: dict[str, type[Op]] = {
    cls.kind: cls
    for cls in (Input, Einsum, Fill, Gather, View, Slice, Concat, ScatterAdd, ArgReduce, KthLargest)
}
"""Every op kind by name."""


def is_input_slice(op: Op, source: Op | None) -> bool:
    """Whether `op`, reading `source` as its operand 0 (None: no operand), is a Slice of a
    program Input: a region of an input, which a planner may load straight from the
    input's host storage (a sliced reload), so its working set is its output alone.
    `TaskGraph.is_input_slice(task_id)` asks it of a task."""
    return isinstance(op, Slice) and isinstance(source, Input)


def _json_float(value: float) -> float | str:
    """Floats for JSON: infinities and NaN as the strings "inf", "-inf", "nan"."""
    if math.isfinite(value):
        return float(value)
    return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")


def op_from_attributes(kind: str, attrs: dict[str, Any]) -> Op:
    """Rebuild an op from its kind and JSON attributes (validated by the op itself)."""
    if kind not in OP_KINDS:
        raise GraphError(f"unknown op kind {kind!r}; valid: {', '.join(OP_KINDS)}")
    op = OP_KINDS[kind]
    expected = {f.name for f in fields(op)}
    if not expected - op.optional_attributes <= set(attrs) <= expected:
        optional = f" ({', '.join(sorted(op.optional_attributes))} optional)"
        raise GraphError(
            f"{kind} attributes must be exactly {sorted(expected)}"
            f"{optional if op.optional_attributes else ''}, got {sorted(attrs)}"
        )
    return op.from_attributes(attrs)


@dataclass(frozen=True, slots=True)
class Task:
    """One TaskGraph node: an op applied to earlier tasks' outputs.

    `id` is dense and equals the task's position; `inputs` are ids of earlier tasks
    (so insertion order is a topological order). `scope` is the name scope the task
    was built in (e.g. `"layers.3.attn"`), `label` a short human hint (e.g. `"q"`).
    `block` is the task's provenance when partitioning made it (None otherwise).
    `facts` say what the tensor is (`taskgraph.facts`: a KV page, the gradient of a
    weight, ...), as data: names, labels and scopes are for people. `workspace` is the
    device memory, in bytes, that the task's kernel needs besides its operands and its
    output (0: none), as the runtime declares it before planning
    (`runtime.declare_workspaces`); a plan gives it a region of the task's apply,
    transient: allocated for the apply only.
    """

    id: int
    op: Op
    inputs: tuple[int, ...]
    shape: Shape
    dtype: str
    flops: int = 0
    scope: str = ""
    label: str = ""
    block: Block | None = None
    facts: tuple[Fact, ...] = ()
    workspace: int = 0

    @property
    def kind(self) -> str:
        return self.op.kind

    @property
    def is_compute(self) -> bool:
        """Whether the device executes this task (see `Op.is_compute`)."""
        return self.op.is_compute

    @property
    def size(self) -> int:
        """Number of elements."""
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        """Bytes of the output tensor."""
        return self.size * dtypes.itemsize(self.dtype)

    @property
    def type_str(self) -> str:
        """`f32[64,512]`: dtype and shape as shown in listings."""
        return f"{dtypes.short(self.dtype)}[{','.join(map(str, self.shape))}]"

    def line(self) -> str:
        """One readable line: `%7 : f16[8,32,64,64] = einsum["bhqe,bhke->bhqk"](%5, %6)`,
        followed by the block in braces when there is one: `{block %3[0:8, 0:11, 0:64, 0:64]}`,
        the facts in brackets when there are some: `[gradient(of=%2)]`, and the kernel's
        workspace when it has one: `(workspace 2.0 MiB)`."""
        args = ", ".join(f"%{i}" for i in self.inputs)
        call = f"({args})" if self.inputs or self.kind not in ("input", "fill") else ""
        text = f"%{self.id} : {self.type_str} = {self.op.describe()}{call}"
        if self.block is not None:
            text += f"  {{{self.block.describe()}}}"
        if self.facts:
            text += f"  [{', '.join(fact.describe() for fact in self.facts)}]"
        if self.workspace:
            text += f"  (workspace {format_bytes(self.workspace)})"
        return text

    def __repr__(self) -> str:
        return f"<Task {self.line()}>"


def with_blocks(tasks: Sequence[Task], blocks: Sequence[Block | None]) -> tuple[Task, ...]:
    """`tasks` with their `block` fields set to `blocks` (one per task), checked.

    A task's block must describe a region of the task's own shape (`block.shape ==
    task.shape`); `GraphBuilder` validates everything else about the tasks.
    """
    if len(blocks) != len(tasks):
        raise GraphError(f"{len(blocks)} blocks given for {len(tasks)} tasks")
    result = []
    for task, block in zip(tasks, blocks, strict=True):
        if block is not None and not isinstance(block, Block):
            raise GraphError(f"task %{task.id}: block must be a Block, got {type(block).__name__}")
        if block is not None and block.shape != task.shape:
            raise GraphError(
                f"task %{task.id}: block {block.describe()} has shape {block.shape} but the "
                f"task's shape is {task.shape}"
            )
        result.append(task if task.block is block else replace(task, block=block))
    return tuple(result)
