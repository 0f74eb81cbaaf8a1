"""Gradient test helpers: a TaskGraph run with PyTorch (for `torch.autograd`), random
differentiable programs, and central finite differences on the reference evaluator."""

from __future__ import annotations

import math

import numpy as np
import torch
import torch.nn.functional as F  # noqa: N812
from hypothesis import strategies as st
from strategies import join_trees

import einpage as ep
import taskgraph
from taskgraph import TaskGraph
from taskgraph.expr import BinOp, Call, Const, Expr, Var

_CALLS = {
    "neg": lambda x: -x,
    "exp": torch.exp,
    "log": torch.log,
    "sqrt": torch.sqrt,
    "rsqrt": torch.rsqrt,
    "tanh": torch.tanh,
    "sigmoid": torch.sigmoid,
    "silu": F.silu,
    "gelu": lambda x: F.gelu(x, approximate="tanh"),
    "relu": torch.relu,
    "abs": torch.abs,
    "floor": torch.floor,
    "max": torch.maximum,
    "min": torch.minimum,
    "where": lambda c, x, y: torch.where(c != 0, x, y),
}
_BINARY = {
    "+": lambda x, y: x + y,
    "-": lambda x, y: x - y,
    "*": lambda x, y: x * y,
    "/": lambda x, y: x / y,
    "**": lambda x, y: x**y,
    "<": lambda x, y: x < y,
    "<=": lambda x, y: x <= y,
    ">": lambda x, y: x > y,
    ">=": lambda x, y: x >= y,
    "==": lambda x, y: x == y,
    "!=": lambda x, y: x != y,
}


def _join(expr: Expr, operands: list[torch.Tensor], like: torch.Tensor) -> torch.Tensor:
    """A join evaluated with torch ops (PyTorch's own derivative rules)."""
    if isinstance(expr, Var):
        return operands[expr.index]
    if isinstance(expr, Const):
        return torch.tensor(expr.value, dtype=like.dtype)
    if isinstance(expr, BinOp):
        value = _BINARY[expr.op](
            _join(expr.left, operands, like), _join(expr.right, operands, like)
        )
        return value.to(like.dtype) if value.dtype == torch.bool else value
    assert isinstance(expr, Call)
    return _CALLS[expr.fn](*(_join(a, operands, like) for a in expr.args))


def _einsum(task, operands: list[torch.Tensor]) -> torch.Tensor:
    spec = task.op.spec
    order = spec.indices
    sizes = spec.index_sizes([tuple(a.shape) for a in operands])
    aligned = []
    for term, array in zip(spec.inputs, operands, strict=True):
        if len(set(term)) < len(term):  # a repeated index reads the diagonal
            distinct = "".join(dict.fromkeys(term))
            array, term = torch.einsum(f"{term}->{distinct}", array), distinct
        present = [c for c in order if c in term]
        moved = array.permute([term.index(c) for c in present]) if term else array
        aligned.append(moved.reshape([sizes[c] if c in term else 1 for c in order]))
    full = tuple(sizes[c] for c in order)
    value = _join(task.op.join_expr, aligned, operands[0]).expand(full)
    reduced = tuple(range(len(spec.output), len(order)))
    if not reduced:
        return value.to(getattr(torch, task.dtype))
    agg = task.op.agg
    if agg == "sum":
        value = value.sum(dim=reduced)
    elif agg in ("max", "min"):
        value = (value.amax if agg == "max" else value.amin)(dim=reduced)
    else:  # prod over several axes: flatten them (torch.prod takes one dim)
        value = value.reshape(*value.shape[: len(spec.output)], -1).prod(dim=-1)
    return value.to(getattr(torch, task.dtype))


def torch_run(tg: TaskGraph, inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Every output of `tg` computed with torch ops on `inputs` (differentiable)."""
    values: dict[int, torch.Tensor] = {}
    for task in tg.tasks:
        op, args = task.op, [values[i] for i in task.inputs]
        kind = task.kind
        if kind == "input":
            value = inputs[op.name]
        elif kind == "einsum":
            value = _einsum(task, args)
        elif kind == "fill":
            value = torch.from_numpy(taskgraph.evaluate_task(task, [], "float64").copy())
        elif kind == "gather":
            value = args[0][args[1]]
        elif kind == "view":
            value = args[0].reshape(task.shape)
        elif kind == "slice":
            value = args[0][
                tuple(slice(s, s + n) for s, n in zip(op.starts, task.shape, strict=True))
            ]
        elif kind == "concat":
            value = torch.cat(args, dim=op.axis)
        else:
            raise AssertionError(kind)
        values[task.id] = value
    return {name: values[i] for name, i in tg.outputs.items()}


def torch_gradients(
    tg: TaskGraph, arrays: dict[str, np.ndarray], loss: str, wrt: list[str]
) -> dict[str, np.ndarray]:
    """`torch.autograd.grad` of output `loss` with respect to the inputs `wrt`, float64."""
    inputs = {}
    for name, array in arrays.items():
        tensor = torch.from_numpy(np.asarray(array))
        if name in wrt:
            tensor = tensor.to(torch.float64).requires_grad_(True)
        inputs[name] = tensor
    value = torch_run(tg, inputs)[loss].sum()
    if not value.requires_grad:  # the loss does not depend on them
        return {name: np.zeros(arrays[name].shape) for name in wrt}
    grads = torch.autograd.grad(value, [inputs[n] for n in wrt], allow_unused=True)
    return {
        name: (np.zeros(arrays[name].shape) if g is None else g.detach().numpy())
        for name, g in zip(wrt, grads, strict=True)
    }


def finite_differences(
    tg: TaskGraph, arrays: dict[str, np.ndarray], loss: str, name: str, step: float = 1e-6
) -> np.ndarray:
    """Central differences of output `loss` with respect to input `name`, float64."""
    base = {k: np.array(v, copy=True) for k, v in arrays.items()}
    x = base[name]
    result = np.zeros(x.shape)
    for index in np.ndindex(x.shape):
        saved = x[index]
        values = []
        for delta in (step, -step):
            x[index] = saved + delta
            values.append(float(taskgraph.evaluate(tg, base, "float64")[loss].sum()))
        x[index] = saved
        result[index] = (values[0] - values[1]) / (2 * step)
    return result


# -- random differentiable programs --------------------------------------------------


class GradCase:
    """A random program with a scalar output "loss", its float64 inputs and the inputs
    to differentiate with respect to; shown as the graph's listing."""

    def __init__(self, tg: TaskGraph, arrays: dict[str, np.ndarray], wrt: list[str]):
        self.tg, self.arrays, self.wrt = tg, arrays, wrt

    def __repr__(self) -> str:
        return f"\nwrt {self.wrt}\n{self.tg}"


class _Builder:
    """A random program being drawn: a pool of (tensor, term) over shared letters."""

    def __init__(self, draw):
        self.draw = draw
        self.sizes = {c: draw(st.integers(1, 3)) for c in "ijkl"}
        self.unused = list("mnopqrstuvwxyz")
        self.rng = np.random.default_rng(draw(st.integers(0, 2**16)))
        self.prog = ep.Program("grad-case")
        self.arrays: dict[str, np.ndarray] = {}
        self.pool: list[tuple[ep.Tensor, str]] = []

    def term(self) -> str:
        letters = self.draw(st.lists(st.sampled_from("ijkl"), max_size=3, unique=True))
        return "".join(letters)

    def fresh(self, size: int) -> str:
        letter = self.unused.pop(0)
        self.sizes[letter] = size
        return letter

    def shape(self, term: str) -> tuple[int, ...]:
        return tuple(self.sizes[c] for c in term)

    def add_input(self) -> None:
        term = self.term()
        name = f"x{len(self.arrays)}"
        self.arrays[name] = self.rng.standard_normal(self.shape(term))
        self.pool.append((self.prog.input(name, self.shape(term), "float64"), term))

    def add_einsum(self) -> None:
        draw = self.draw
        picked = [draw(st.sampled_from(self.pool)) for _ in range(draw(st.integers(1, 3)))]
        used = sorted(set("".join(term for _, term in picked)))
        extra = [c for c in "ijkl" if c not in used and draw(st.integers(0, 4)) == 0]
        out = "".join(draw(st.permutations(used + extra))[: draw(st.integers(0, len(used)))])
        if any(c not in used for c in out):  # a broadcast index: an operand of ones binds it
            ones = self.prog.fill(self.shape("".join(extra)), 1.0, "float64")
            picked.append((ones, "".join(extra)))
        spec = ",".join(term for _, term in picked) + "->" + out
        join = None if draw(st.booleans()) else draw(join_trees(len(picked), depth=2))[0]
        agg = draw(st.sampled_from(["sum", "sum", "max", "min", "prod"]))
        tensor = self.prog.einsum(spec, *[t for t, _ in picked], join=join, agg=agg)
        self.pool.append((tensor, out))

    def add_structural(self) -> None:
        draw = self.draw
        tensor, term = draw(st.sampled_from(self.pool))
        if not term or len(self.unused) < 2:
            return
        kind = draw(st.sampled_from(["view", "slice", "concat", "gather"]))
        prog = self.prog
        if kind == "view":
            self.pool.append((prog.view(tensor, (tensor.size,)), self.fresh(tensor.size)))
        elif kind == "slice":
            start = draw(st.integers(0, tensor.shape[-1] - 1))
            size = draw(st.integers(1, tensor.shape[-1] - start))
            part = prog.slice(tensor, (0,) * (len(term) - 1) + (start,), (*tensor.shape[:-1], size))
            self.pool.append((part, term[:-1] + self.fresh(size)))
        elif kind == "concat":
            others = [t for t, other in self.pool if other == term]
            joined = prog.concat([tensor, draw(st.sampled_from(others))], axis=0)
            self.pool.append((joined, self.fresh(joined.shape[0]) + term[1:]))
        elif kind == "gather":
            count = draw(st.integers(1, 3))
            name = f"ids{len(self.arrays)}"
            self.arrays[name] = self.rng.integers(0, tensor.shape[0], (count,))
            ids = prog.input(name, (count,), "int64")
            self.pool.append((prog.gather(tensor, ids), self.fresh(count) + term[1:]))


@st.composite
def grad_cases(draw):
    """A random differentiable float64 program: einsums with random joins and aggs over
    shared indices (reuse and broadcasts included), views, slices, concats and gathers
    now and then, and a scalar "loss" summing every tensor nothing reads, each weighed by
    random numbers. The inputs to differentiate are drawn among those the loss reads."""
    b = _Builder(draw)
    for _ in range(draw(st.integers(1, 3))):
        b.add_input()
    for _ in range(draw(st.integers(1, 6))):
        if draw(st.integers(0, 3)) == 0:
            b.add_structural()
        else:
            b.add_einsum()
    read = {i for tensor, _ in b.pool for i in tensor.task.inputs}
    sinks = [(t, term) for t, term in b.pool if t.id not in read and t.dtype == "float64"]
    parts = []
    for k, (tensor, term) in enumerate(sinks):
        name = f"weights{k}"
        b.arrays[name] = b.rng.standard_normal(tensor.shape)
        w = b.prog.input(name, tensor.shape, "float64")
        parts.append(b.prog.einsum(f"{term},{term}->", tensor, w))
    loss = parts[0]
    for part in parts[1:]:
        loss = loss + part
    b.prog.output(loss, "loss")
    tg = b.prog.build()
    needed = {tg.outputs["loss"]}
    for task in reversed(tg.tasks):
        if task.id in needed:
            needed.update(task.inputs)
    names = [n for n, i in tg.inputs.items() if n.startswith("x") and i in needed]
    names = names or [n for n in tg.inputs if n.startswith("x")]
    wrt = draw(st.lists(st.sampled_from(names), min_size=1, unique=True))
    return GradCase(tg, b.arrays, wrt)


def loss_scale(case: GradCase) -> float:
    """The size of the loss, to see a case is not overflowing."""
    value = taskgraph.evaluate(case.tg, case.arrays)["loss"]
    return float(np.abs(value)) if math.isfinite(float(value)) else math.inf
