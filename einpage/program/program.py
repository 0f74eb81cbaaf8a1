"""`Program`: the builder users write tensor programs with, and `Tensor`, its handles.

A program is a list of generalized einsums (and a few structural ops) over named
inputs. `Program.build()` returns the `TaskGraph` the planner and the evaluator use.

>>> prog = Program("tiny")
>>> x = prog.input("x", (4, 8))
>>> w = prog.input("w", (8, 2), role="weight")
>>> y = prog.einsum("bd,df->bf", x, w)
>>> y
<Tensor %2 : f32[4,2] = einsum["bd,df->bf"](%0, %1)>
>>> prog.output(y, "y")
>>> prog.build()
<TaskGraph 'tiny' tasks=3 inputs=2 outputs=1 flops=128 FLOP inputs_size=192 B>
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import opt_einsum

from einpage_core.errors import ProgramError, ShapeError, SpecError
from taskgraph import dtypes
from taskgraph.builder import GraphBuilder
from taskgraph.einsum import EinsumSpec, normalize
from taskgraph.expr import parse as parse_join
from taskgraph.facts import Fact, Layer
from taskgraph.graph import TaskGraph
from taskgraph.nodes import (
    AGGS,
    DOMAINS,
    LOCATIONS,
    ROLES,
    Concat,
    Einsum,
    Fill,
    Gather,
    Input,
    Op,
    ScatterAdd,
    Slice,
    Task,
    View,
    check_shape,
)

__all__ = ["Program", "Tensor", "PATH_OPTIMIZERS"]

PATH_OPTIMIZERS = tuple(opt_einsum.paths._PATH_OPTIONS)
"""Names accepted by `Program.einsum(..., optimize=...)` (opt_einsum's path optimizers)."""


def _ops() -> Any:
    """The op library, imported on first use (it imports this module)."""
    from einpage.program import ops

    return ops


class Tensor:
    """A handle on one tensor of a `Program`: its task id, shape and dtype.

    Arithmetic operators build einsums (`a + b`, `a * 2`, `a @ b`, `-a`), with NumPy
    broadcasting; `a[1:3, :]` slices; see `einpage.program.ops` for the rest.
    """

    __slots__ = ("program", "id", "shape", "dtype")

    def __init__(self, program: Program, task_id: int, shape: tuple[int, ...], dtype: str):
        self.program = program
        self.id = task_id
        self.shape = shape
        self.dtype = dtype

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def size(self) -> int:
        """Number of elements."""
        return self.task.size

    @property
    def nbytes(self) -> int:
        return self.task.nbytes

    @property
    def task(self) -> Task:
        """The TaskGraph task that produces this tensor (ids as built, before pruning)."""
        return self.program._builder.tasks[self.id]

    def __repr__(self) -> str:
        return f"<Tensor {self.task.line()}>"

    # Operators delegate to the op library.
    def __add__(self, other: Any) -> Tensor:
        return _ops().add(self, other)

    def __radd__(self, other: Any) -> Tensor:
        return _ops().add(other, self)

    def __sub__(self, other: Any) -> Tensor:
        return _ops().sub(self, other)

    def __rsub__(self, other: Any) -> Tensor:
        return _ops().sub(other, self)

    def __mul__(self, other: Any) -> Tensor:
        return _ops().mul(self, other)

    def __rmul__(self, other: Any) -> Tensor:
        return _ops().mul(other, self)

    def __truediv__(self, other: Any) -> Tensor:
        return _ops().div(self, other)

    def __rtruediv__(self, other: Any) -> Tensor:
        return _ops().div(other, self)

    def __neg__(self) -> Tensor:
        return _ops().neg(self)

    def __matmul__(self, other: Tensor) -> Tensor:
        return _ops().matmul(self, other)

    def __getitem__(self, key: Any) -> Tensor:
        return _ops().getitem(self, key)

    def __bool__(self) -> bool:
        raise ProgramError("a Tensor has no truth value: it is a symbolic handle, not data")

    @property
    def T(self) -> Tensor:  # noqa: N802  (NumPy's name)
        return _ops().transpose(self)

    def reshape(self, *shape: Any) -> Tensor:
        return _ops().reshape(self, shape[0] if len(shape) == 1 else shape)

    def astype(self, dtype: Any) -> Tensor:
        return _ops().cast(self, dtype)

    def sum(self, axis: Any = None, keepdims: bool = False) -> Tensor:
        return _ops().reduce_sum(self, axis, keepdims)

    def max(self, axis: Any = None, keepdims: bool = False) -> Tensor:
        return _ops().reduce_max(self, axis, keepdims)

    def mean(self, axis: Any = None, keepdims: bool = False) -> Tensor:
        return _ops().mean(self, axis, keepdims)


class Program:
    """Builds a tensor program: inputs, generalized einsums, structural ops, outputs."""

    def __init__(self, name: str = "program"):
        if not isinstance(name, str) or not name:
            raise ProgramError(f"Program(name): the name must be a non-empty string, got {name!r}")
        self._builder = GraphBuilder(name)
        self._scopes: list[str] = []
        self._layer: int | None = None

    @property
    def name(self) -> str:
        return self._builder.name

    def __repr__(self) -> str:
        b = self._builder
        return (
            f"<Program {self.name!r} tasks={len(b.tasks)} inputs={len(b.input_names)} "
            f"outputs={len(b.outputs)}>"
        )

    # -- scopes ------------------------------------------------------------------

    @contextlib.contextmanager
    def scope(self, name: str) -> Iterator[None]:
        """Name the tasks built inside, e.g. `with prog.scope("layers.0"):` (scopes nest with
        dots); renderers and reports group tasks by scope."""
        if not isinstance(name, str) or not name:
            raise ProgramError(f"scope name must be a non-empty string, got {name!r}")
        self._scopes.append(name)
        try:
            yield
        finally:
            self._scopes.pop()

    @property
    def current_scope(self) -> str:
        return ".".join(self._scopes)

    @contextlib.contextmanager
    def layer(self, index: int) -> Iterator[None]:
        """Declare the weights of decoder layer `index`: every weight input (role
        "weight", also the quantized inputs of `einpage.program.quantize`) declared
        inside states the fact `taskgraph.facts.Layer(index)`, which a pipeline
        placement reads to keep a layer on one device. A weight declared once and read
        again later (by a later generation step) keeps the fact of the layer that
        declared it. Layers do not nest; names, scopes and order are untouched.

        >>> prog = Program()
        >>> with prog.layer(3):
        ...     w = prog.input("w", (4,), role="weight")
        ...     x = prog.input("x", (4,))
        >>> w.task.facts, x.task.facts
        ((Layer(index=3),), ())
        """
        if isinstance(index, bool) or not isinstance(index, int) or index < 0:
            raise ProgramError(f"layer index must be an int >= 0, got {index!r}")
        if self._layer is not None:
            raise ProgramError(
                f"layer {index} inside layer {self._layer}: layers do not nest (a weight "
                f"belongs to one layer)"
            )
        self._layer = index
        try:
            yield
        finally:
            self._layer = None

    @property
    def current_layer(self) -> int | None:
        """The index of the layer being declared (`layer`), or None outside one."""
        return self._layer

    # -- building blocks ---------------------------------------------------------

    def _add(
        self,
        op: Op,
        inputs: Sequence[Tensor],
        shape: Any = None,
        dtype: Any = None,
        label: str = "",
    ) -> Tensor:
        ids = tuple(self._own(t).id for t in inputs)
        task_id = self._builder.add(op, ids, shape, dtype, self.current_scope, label)
        task = self._builder.tasks[task_id]
        return Tensor(self, task_id, task.shape, task.dtype)

    def _own(self, tensor: Any) -> Tensor:
        if not isinstance(tensor, Tensor):
            raise ProgramError(f"expected a Tensor of this program, got {type(tensor).__name__}")
        if tensor.program is not self:
            raise ProgramError(
                f"{tensor!r} belongs to program {tensor.program.name!r}, not {self.name!r}"
            )
        return tensor

    def input(
        self,
        name: str,
        shape: Sequence[int],
        dtype: Any = "float32",
        role: str = "activation",
        location: str | None = None,
        domain: str = "real",
    ) -> Tensor:
        """Declare an input. `role` is "activation", "weight" or "state" (e.g. an optimizer's
        moments); `location` is where it starts ("host" or "device"), by default the host
        for weights and states and the device for activations; `domain` is where its
        values lie (`taskgraph.nodes.DOMAINS`: "real", "nonnegative", "positive" or
        "fraction"), which random inputs respect. A weight declared inside `layer(i)`
        states the fact `Layer(i)`."""
        if role not in ROLES:
            raise ProgramError(f"input {name!r}: role must be one of {ROLES}, got {role!r}")
        if location is None:
            location = "device" if role == "activation" else "host"
        if location not in LOCATIONS:
            raise ProgramError(
                f"input {name!r}: location must be one of {LOCATIONS}, got {location!r}"
            )
        if name in self._builder.input_names:
            raise ProgramError(f"an input named {name!r} already exists")
        shape = check_shape(shape, f"input {name!r}")
        if domain not in DOMAINS:
            raise ProgramError(f"input {name!r}: domain must be one of {DOMAINS}, got {domain!r}")
        op = Input(name, role, location, domain)
        tensor = self._add(op, (), shape, dtypes.canonical(dtype))
        if role == "weight" and self._layer is not None:
            self._builder.add_facts(tensor.id, (Layer(self._layer),))
        return tensor

    def fact(self, tensor: Tensor, fact: Fact) -> Tensor:
        """State what `tensor` is – `fact`, one of `taskgraph.facts` (a KV page, the update
        of an input, an optimizer state, ...) – where the program makes it; returns the
        tensor. This is how a program says it: passes, reports and workloads read the
        fact, never a name, a label or a scope, which are for people. A fact naming
        another tensor takes its id (`Tensor.id`), which must be an earlier tensor.

        >>> from taskgraph.facts import OptimizerState
        >>> prog = Program()
        >>> w = prog.input("w", (4,), role="weight")
        >>> m = prog.fact(prog.input("m", (4,), role="state"), OptimizerState(w.id, "momentum"))
        >>> m
        <Tensor %1 : f32[4] = input["m", state, host]  [optimizer_state(of=%0, state=momentum)]>
        """
        self._builder.add_facts(self._own(tensor).id, (fact,))
        return tensor

    def output(self, tensor: Tensor, name: str) -> None:
        """Mark `tensor` as the output `name`."""
        if name in self._builder.outputs:
            raise ProgramError(f"an output named {name!r} already exists")
        self._builder.output(self._own(tensor).id, name)

    def input_tensor(self, name: str) -> Tensor:
        """The tensor of the input `name` (declared earlier with `input`)."""
        for task in self._builder.tasks:
            if isinstance(task.op, Input) and task.op.name == name:
                return Tensor(self, task.id, task.shape, task.dtype)
        raise ProgramError(f"no input named {name!r}")

    def pop_output(self, name: str) -> Tensor:
        """Unmark the output `name` and return its tensor, to build on it: a training step
        takes a model's "logits" to compute a loss instead of returning them."""
        if name not in self._builder.outputs:
            known = ", ".join(map(repr, self._builder.outputs)) or "none"
            raise ProgramError(f"no output named {name!r}; outputs: {known}")
        task = self._builder.tasks[self._builder.outputs.pop(name)]
        return Tensor(self, task.id, task.shape, task.dtype)

    def backward(
        self,
        loss: Tensor,
        wrt: Sequence[Tensor],
        on_gradient: Callable[[Tensor, Tensor], None] | None = None,
    ) -> list[Tensor]:
        """Append the backward pass: the gradients of `loss` (a float tensor of one element)
        with respect to each tensor of `wrt` (inputs or any float tensors), in order.

        `on_gradient(tensor, gradient)` is called as soon as a gradient is final – its
        last contribution added – and may build on it (an optimizer update), so that the
        update comes right after the gradient in the program (and in a plan's order).
        Gradient tasks keep the scope of the task they differentiate and are labelled
        `grad.<label>`. See `taskgraph.autodiff` for the rules.

        >>> import einpage as ep
        >>> prog = ep.Program()
        >>> w = prog.input("w", (3,), role="weight")
        >>> loss = ep.reduce_sum(w * w)
        >>> (g,) = prog.backward(loss, [w])
        >>> prog.output(g, "dw")
        >>> import numpy as np, taskgraph
        >>> taskgraph.evaluate(prog.build(), {"w": np.array([1, 2, 3], "float32")})["dw"]
        array([2., 4., 6.], dtype=float32)
        """
        from taskgraph.autodiff import backward

        loss = self._own(loss)
        tensors = [self._own(t) for t in wrt]

        def tensor(task_id: int) -> Tensor:
            task = self._builder.tasks[task_id]
            return Tensor(self, task_id, task.shape, task.dtype)

        def finished(task_id: int, grad_id: int) -> None:
            if on_gradient is not None:
                on_gradient(tensor(task_id), tensor(grad_id))

        grads = backward(self._builder, loss.id, [t.id for t in tensors], finished)
        return [tensor(grads[t.id]) for t in tensors]

    def einsum(
        self,
        spec: str,
        *operands: Tensor,
        join: str | None = None,
        agg: str = "sum",
        dtype: Any = None,
        optimize: str = "greedy",
        memory_limit: int | None = None,
        label: str = "",
    ) -> Tensor:
        """A generalized einsum: `out[O] = agg over reduced indices of join(a[I0], b[I1], ...)`.

        `spec` follows `numpy.einsum` (`"ij,jk->ik"`, implicit output, `...`, size-1
        broadcasting, an index repeated in one operand for its diagonal: `"ii->i"`,
        `"ii"`, `"aab,bc->ac"`); `join` is a scalar expression over `a, b, c, ...`
        (default: their product); `agg` is one of sum, max, min, prod. `dtype` casts the
        result. A plain einsum of two or more operands first takes the diagonals of
        operands that repeat an index, each as a task of its own (`"aab->ab"`), so the
        contraction that follows is an ordinary one; with three or more operands, that is
        split into pairwise steps along an opt_einsum path (`optimize`, `memory_limit`).
        A generalized einsum (a join or another agg) reads its diagonals in its one task.
        """
        if not operands:
            raise SpecError(f"einsum {spec!r} needs at least one operand")
        tensors = [self._own(t) for t in operands]
        if agg not in AGGS:
            raise SpecError(f"unknown agg {agg!r}; valid: {', '.join(AGGS)}")
        normalized = normalize(spec, [t.shape for t in tensors])
        tensors = [
            self._drop_axes(t, drop) if drop else t
            for t, drop in zip(tensors, normalized.squeeze, strict=True)
        ]
        parsed = None if join is None else parse_join(join, len(tensors))
        spec = normalized.spec
        plain = parsed is None and agg == "sum"
        if plain and len(tensors) >= 2 and spec.has_diagonal:
            spec, tensors = self._take_diagonals(spec, tensors)
        if plain and len(tensors) >= 3:
            return self._contract_path(spec, tensors, dtype, optimize, memory_limit, label)
        return self._add(Einsum(spec, parsed, agg), tensors, None, dtype, label)

    def _take_diagonals(
        self, spec: EinsumSpec, tensors: list[Tensor]
    ) -> tuple[EinsumSpec, list[Tensor]]:
        """Each operand that repeats an index replaced by a task reading its diagonal,
        keeping the indices another operand or the output needs (the rest are summed
        there: `"iij,jk->ik"` becomes `"iij->ij"` then `"ij,jk->ik"`; `"iij,k->k"`
        becomes `"iij->"`, a trace)."""
        terms, taken = list(spec.inputs), list(tensors)
        for position, term in enumerate(spec.inputs):
            if len(set(term)) == len(term):
                continue
            elsewhere = "".join(terms[:position] + terms[position + 1 :]) + spec.output
            kept = "".join(c for c in dict.fromkeys(term) if c in elsewhere)
            diagonal = EinsumSpec((term,), kept)
            taken[position] = self._add(Einsum(diagonal), (tensors[position],), label="diagonal")
            terms[position] = kept
        return EinsumSpec(tuple(terms), spec.output), taken

    def _drop_axes(self, tensor: Tensor, axes: Sequence[int]) -> Tensor:
        shape = tuple(d for i, d in enumerate(tensor.shape) if i not in axes)
        return self._add(View(), (tensor,), shape)

    def _contract_path(
        self,
        spec: EinsumSpec,
        tensors: list[Tensor],
        dtype: Any,
        optimize: str,
        memory_limit: int | None,
        label: str,
    ) -> Tensor:
        if optimize not in PATH_OPTIMIZERS:
            raise ProgramError(
                f"unknown optimize={optimize!r}; valid: {', '.join(PATH_OPTIMIZERS)}"
            )
        try:
            _, info = opt_einsum.contract_path(
                str(spec),
                *[t.shape for t in tensors],
                shapes=True,
                optimize=optimize,
                memory_limit=memory_limit,
            )
        except (RuntimeError, ValueError) as err:
            raise ProgramError(
                f"einsum {str(spec)!r}: opt_einsum found no path with "
                f"optimize={optimize!r}, memory_limit={memory_limit}: {err}"
            ) from None
        current = list(tensors)
        steps = info.contraction_list
        result = current[0]
        for number, step in enumerate(steps):
            contract_inds, einsum_str = step[0], step[2]
            taken = [current.pop(i) for i in contract_inds]
            last = number == len(steps) - 1
            result = self._pairwise(
                EinsumSpec.parse(einsum_str), taken, dtype if last else None, label if last else ""
            )
            current.append(result)
        return result

    def _pairwise(self, spec: EinsumSpec, tensors: list[Tensor], dtype: Any, label: str) -> Tensor:
        """Add one path step as plain einsums of at most two operands (left to right)."""
        terms, tensors = list(spec.inputs), list(tensors)
        while len(terms) > 2:
            needed = "".join(terms[2:]) + spec.output
            kept = "".join(c for c in dict.fromkeys(terms[0] + terms[1]) if c in needed)
            step = EinsumSpec((terms[0], terms[1]), kept)
            tensors[:2] = [self._add(Einsum(step), tensors[:2])]
            terms[:2] = [kept]
        return self._add(Einsum(EinsumSpec(tuple(terms), spec.output)), tensors, None, dtype, label)

    def fill(
        self,
        shape: Sequence[int],
        value: float,
        dtype: Any = "float32",
        pattern: str = "full",
        label: str = "",
    ) -> Tensor:
        """A constant tensor: all `value`, or with `pattern="causal"` a causal mask over the
        last two axes (`value` where key > query, 0 elsewhere)."""
        return self._add(
            Fill(float(value), pattern),
            (),
            check_shape(shape, "fill"),
            dtypes.canonical(dtype),
            label,
        )

    def gather(self, table: Tensor, ids: Tensor, label: str = "") -> Tensor:
        """Rows of `table` picked by the integer tensor `ids`: shape ids.shape + table.shape[1:]."""
        return self._add(Gather(), (table, ids), label=label)

    def scatter_add(self, src: Tensor, ids: Tensor, rows: int, label: str = "") -> Tensor:
        """A table of `rows` rows where row r is the sum of the rows of `src` whose id is r:
        `src` has shape `ids.shape + rest`, the result `(rows, *rest)`; ids outside
        [0, rows) add nothing. The gradient of `gather` with respect to its table."""
        src = self._own(src)
        ids = self._own(ids)
        shape = (rows, *src.shape[ids.ndim :])
        return self._add(ScatterAdd(), (src, ids), check_shape(shape, "scatter_add"), label=label)

    def view(self, tensor: Tensor, shape: Sequence[int], label: str = "") -> Tensor:
        """The same elements with another shape (no copy); one dimension may be -1."""
        tensor = self._own(tensor)
        shape = [shape] if isinstance(shape, int) else list(shape)
        if shape.count(-1) > 1:
            raise ShapeError(f"view: at most one dimension may be -1, got {tuple(shape)}")
        if -1 in shape:
            known = 1
            for d in shape:
                known *= d if d != -1 else 1
            if known <= 0 or tensor.size % known:
                raise ShapeError(f"view: cannot view shape {tensor.shape} as {tuple(shape)}")
            shape[shape.index(-1)] = tensor.size // known
        return self._add(View(), (tensor,), check_shape(shape, "view"), label=label)

    def slice(
        self, tensor: Tensor, starts: Sequence[int], shape: Sequence[int], label: str = ""
    ) -> Tensor:
        """The box `tensor[starts[i] : starts[i] + shape[i], ...]`, copied."""
        return self._add(Slice(tuple(starts)), (tensor,), check_shape(shape, "slice"), label=label)

    def concat(self, tensors: Sequence[Tensor], axis: int = 0, label: str = "") -> Tensor:
        """The tensors joined along `axis`."""
        tensors = [self._own(t) for t in tensors]
        if not tensors:
            raise ProgramError("concat needs at least one tensor")
        ndim = tensors[0].ndim
        if not -ndim <= axis < ndim:
            raise ShapeError(f"concat: axis {axis} is out of range for rank {ndim}")
        return self._add(Concat(axis % ndim), tensors, label=label)

    # -- result ------------------------------------------------------------------

    def build(self, prune: bool = True) -> TaskGraph:
        """The TaskGraph of this program. With `prune`, tasks that no output depends on are
        dropped (inputs are always kept) and ids renumbered densely, the ids facts name
        too (a fact about a dropped tensor, e.g. the gradient of a task no output needs,
        is dropped with it)."""
        graph = self._builder.build()
        if not graph.outputs:
            raise ProgramError(f"program {self.name!r} has no outputs; call prog.output(t, name)")
        if not prune:
            return graph
        live = set(graph.outputs.values()) | set(graph.inputs.values())
        for task in reversed(graph.tasks):
            if task.id in live:
                live.update(task.inputs)
        builder = GraphBuilder(self.name)
        new_id: dict[int, int] = {}
        for task in graph.tasks:
            if task.id in live:
                facts = [fact.renumbered(new_id) for fact in task.facts]
                new_id[task.id] = builder.add(
                    task.op,
                    [new_id[i] for i in task.inputs],
                    task.shape,
                    task.dtype,
                    task.scope,
                    task.label,
                    [fact for fact in facts if fact is not None],
                )
        for name, task_id in graph.outputs.items():
            builder.output(new_id[task_id], name)
        return builder.build()
