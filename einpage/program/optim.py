"""Optimizer updates as einsums over a weight, its gradient and its state tensors.

An optimizer is a small frozen record of hyperparameters with one method,
`update(prog, weight, grad, states, scalars)`, that writes the step of one weight as
elementwise einsums and returns the new weight and the new states. The states are
inputs of the program (role "state": they start on the host and are read only by the
update) whose new values are outputs, so a step's outputs are the next step's inputs.
Both follow PyTorch's `torch.optim` step for step, to rounding:

* `SGD(lr, momentum, weight_decay, nesterov)`: `torch.optim.SGD` without dampening;
  state "momentum_buffer" (zeros before the first step) when momentum is used.
* `AdamW(lr, betas, eps, weight_decay)`: `torch.optim.AdamW` with bias correction;
  states "exp_avg" and "exp_avg_sq" (zeros before the first step), and the step
  count t (1 on the first step, as torch's after its increment) as the int64 program
  input "step", so one program serves every step.

The hyperparameters are inputs of the program too, not numbers written into its joins:
`hyperparameters()` lists them (`Hyperparameter`: the input `optim.lr`, ...) and
`inputs(step, dtype)` gives their values, so a learning-rate schedule runs one plan
with other inputs (`dataclasses.replace(opt, lr=...)` for each step). They are scalars
of the update's dtype (`update_dtype`: float32, or float64 for a float64 model) whatever
the model's, with their domains stated. What shapes the program stays in the record:
which states exist (SGD's momentum buffer only when `momentum` is not 0) and Nesterov.

>>> import einpage as ep
>>> prog = ep.Program()
>>> w = prog.input("w", (4,), role="weight")
>>> opt = SGD(lr=0.1)
>>> new = opt.update(prog, w, ep.scale(w, 2.0), {}, opt.scalars(prog, "float32"))
>>> prog.output(new.weight, "new")
>>> new.weight.shape, new.states, sorted(prog.build().inputs)
((4,), {}, ['optim.lr', 'optim.weight_decay', 'w'])
>>> opt.inputs(step=1, dtype="float32")
{'optim.lr': array(0.1, dtype=float32), 'optim.weight_decay': array(0., dtype=float32)}
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np

from einpage.program.program import Program, Tensor
from einpage_core.errors import InputError, ProgramError
from taskgraph import dtypes

__all__ = [
    "Optimizer",
    "SGD",
    "AdamW",
    "Updated",
    "Hyperparameter",
    "OPTIMIZERS",
    "STEP",
    "update_dtype",
]

STEP = "step"
"""The input holding the step number t (int64, 1 on the first step) of an optimizer that
counts steps (AdamW's bias correction)."""


def update_dtype(dtype: str) -> str:
    """The dtype an update runs in for a model in `dtype`: float32, or float64 for a
    float64 model; never a 16-bit float, whose rounding would swallow the small updates
    of training (`einpage.workloads.training`: mixed precision).

    >>> update_dtype("bfloat16"), update_dtype("float32"), update_dtype("float64")
    ('float32', 'float32', 'float64')
    """
    return "float64" if dtypes.canonical(dtype) == "float64" else "float32"


@dataclass(frozen=True)
class Updated:
    """The result of one weight's update: the new weight and its new states by name."""

    weight: Tensor
    states: dict[str, Tensor] = field(default_factory=dict)


@dataclass(frozen=True)
class Hyperparameter:
    """One per-step number of an optimizer: `name` ("lr"), its `value` in the record and
    the `domain` of its values (`taskgraph.nodes.DOMAINS`); the program reads it as the
    scalar input `input_name` ("optim.lr")."""

    name: str
    value: float
    domain: str

    @property
    def input_name(self) -> str:
        return f"optim.{self.name}"


def _check_number(owner: str, name: str, value: float, low: float, high: float | None) -> None:
    ok = isinstance(value, int | float) and not isinstance(value, bool)
    if not ok or value < low or (high is not None and value >= high):
        bound = f"[{low}, {high})" if high is not None else f">= {low}"
        raise ProgramError(f"{owner}: {name} must be a number in {bound}, got {value!r}")


class Optimizer:
    """The interface: `states` (names of the per-weight state tensors), `hyperparameters`
    (the per-step numbers, inputs of the program), `scalars` (the tensors every update
    shares, computed once per program) and `update` (one weight's step)."""

    states: tuple[str, ...] = ()
    counts_steps: bool = False
    """Whether the program has the input "step" (`STEP`: the step number t, 1 first)."""

    def state_domain(self, state: str) -> str:
        """Where the values of the state `state` lie (`taskgraph.nodes.DOMAINS`), stated on
        its input: "real" unless the update keeps it narrower."""
        return "real"

    def hyperparameters(self) -> tuple[Hyperparameter, ...]:
        """The numbers the program reads as inputs, with this record's values."""
        return ()

    def inputs(self, step: int, dtype: str) -> dict[str, np.ndarray]:
        """The values of the program inputs `scalars(prog, dtype)` made: each
        hyperparameter as a scalar of `dtype` (the update's), and "step" = `step` (int64,
        1 on the first) for an optimizer that counts steps."""
        values = {h.input_name: np.array(h.value, dtype) for h in self.hyperparameters()}
        if self.counts_steps:
            if isinstance(step, bool) or not isinstance(step, int | np.integer) or step < 1:
                raise InputError(
                    f"{type(self).__name__}: step must be an integer >= 1 (1 on the first "
                    f"step), got {step!r}"
                )
            values[STEP] = np.array(step, "int64")
        return values

    def scalars(self, prog: Program, dtype: str) -> dict[str, Tensor]:
        """The inputs of the hyperparameters (scope "optim", scalars of `dtype`, the
        update's) and the tensors every weight's update shares, by name (made once,
        before the backward pass)."""
        with prog.scope("optim"):
            return {
                h.name: prog.input(h.input_name, (), dtype, domain=h.domain)
                for h in self.hyperparameters()
            }

    def update(
        self,
        prog: Program,
        weight: Tensor,
        grad: Tensor,
        states: Mapping[str, Tensor],
        scalars: Mapping[str, Tensor],
    ) -> Updated:
        raise NotImplementedError


@dataclass(frozen=True)
class SGD(Optimizer):
    """Stochastic gradient descent with optional momentum, weight decay (added to the
    gradient, as torch's SGD) and Nesterov momentum. Hyperparameter inputs: `optim.lr`,
    `optim.weight_decay` and, with momentum, `optim.momentum`."""

    lr: float = 1e-3
    momentum: float = 0.0
    weight_decay: float = 0.0
    nesterov: bool = False

    def __post_init__(self) -> None:
        _check_number("SGD", "lr", self.lr, 0.0, None)
        _check_number("SGD", "momentum", self.momentum, 0.0, None)
        _check_number("SGD", "weight_decay", self.weight_decay, 0.0, None)
        if self.nesterov and self.momentum == 0.0:
            raise ProgramError("SGD: nesterov needs a momentum > 0")

    @property
    def states(self) -> tuple[str, ...]:  # type: ignore[override]
        return ("momentum_buffer",) if self.momentum else ()

    def hyperparameters(self) -> tuple[Hyperparameter, ...]:
        found = [
            Hyperparameter("lr", self.lr, "nonnegative"),
            Hyperparameter("weight_decay", self.weight_decay, "nonnegative"),
        ]
        if self.momentum:
            found.append(Hyperparameter("momentum", self.momentum, "nonnegative"))
        return tuple(found)

    def update(
        self,
        prog: Program,
        weight: Tensor,
        grad: Tensor,
        states: Mapping[str, Tensor],
        scalars: Mapping[str, Tensor],
    ) -> Updated:
        # Operands: a = the gradient, b = the weight, then the momentum buffer (c) and the
        # scalars; the decayed gradient is a + weight_decay * b.
        lr, decay = scalars["lr"], scalars["weight_decay"]
        if not self.momentum:
            join = "b - c * (a + d * b)"
            new = prog.einsum("...,...,,->...", grad, weight, lr, decay, join=join, label="sgd")
            return Updated(new)
        momentum = scalars["momentum"]
        buffer = prog.einsum(
            "...,...,...,,->...",
            grad,
            weight,
            states["momentum_buffer"],
            momentum,
            decay,
            join="d * c + (a + e * b)",
            label="sgd.momentum",
        )
        if self.nesterov:  # the decayed gradient plus momentum times the new buffer
            new = prog.einsum(
                "...,...,...,,,->...",
                grad,
                weight,
                buffer,
                lr,
                decay,
                momentum,
                join="b - d * ((a + e * b) + f * c)",
                label="sgd",
            )
        else:
            new = prog.einsum("...,...,->...", weight, buffer, lr, join="a - c * b", label="sgd")
        return Updated(new, {"momentum_buffer": buffer})


@dataclass(frozen=True)
class AdamW(Optimizer):
    """Adam with decoupled weight decay and bias correction, as `torch.optim.AdamW`:

    m' = b1 m + (1 - b1) g,  v' = b2 v + (1 - b2) g²,
    w' = w (1 - lr wd) - lr / (1 - b1^t) · m' / (sqrt(v') / sqrt(1 - b2^t) + eps).

    Hyperparameter inputs: `optim.lr`, `optim.beta1`, `optim.beta2`, `optim.eps`,
    `optim.weight_decay`; and the step t, `step`.
    """

    lr: float = 1e-3
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 1e-2

    states = ("exp_avg", "exp_avg_sq")
    counts_steps = True

    def __post_init__(self) -> None:
        _check_number("AdamW", "lr", self.lr, 0.0, None)
        _check_number("AdamW", "eps", self.eps, 0.0, None)
        _check_number("AdamW", "weight_decay", self.weight_decay, 0.0, None)
        if len(self.betas) != 2:
            raise ProgramError(f"AdamW: betas must be two numbers, got {self.betas!r}")
        for beta in self.betas:
            _check_number("AdamW", "betas", beta, 0.0, 1.0)

    def state_domain(self, state: str) -> str:
        """The second moment `exp_avg_sq`, a mean of squares, is never negative."""
        return "nonnegative" if state == "exp_avg_sq" else "real"

    def hyperparameters(self) -> tuple[Hyperparameter, ...]:
        b1, b2 = self.betas
        return (
            Hyperparameter("lr", self.lr, "nonnegative"),
            Hyperparameter("beta1", b1, "fraction"),
            Hyperparameter("beta2", b2, "fraction"),
            Hyperparameter("eps", self.eps, "nonnegative"),
            Hyperparameter("weight_decay", self.weight_decay, "nonnegative"),
        )

    def scalars(self, prog: Program, dtype: str) -> dict[str, Tensor]:
        """The hyperparameters and, from the input "step" (t, cast to `dtype`: exact up to
        2^24 in float32): "step_size" `lr / (1 - b1^t)`, "correction" `1 / sqrt(1 - b2^t)`
        and "keep" `1 - lr wd` (the decay's factor)."""
        found = super().scalars(prog, dtype)
        lr, b1, b2, wd = found["lr"], found["beta1"], found["beta2"], found["weight_decay"]
        with prog.scope("optim"):
            step = prog.input(STEP, (), "int64", domain="positive")
            t = prog.einsum("->", step, dtype=dtype, label="t")
            found["step_size"] = prog.einsum(
                ",,->", lr, b1, t, join="a / (1.0 - b ** c)", label="step_size"
            )
            found["correction"] = prog.einsum(
                ",->", b2, t, join="rsqrt(1.0 - a ** b)", label="correction"
            )
            found["keep"] = prog.einsum(",->", lr, wd, join="1.0 - a * b", label="keep")
        return found

    def update(
        self,
        prog: Program,
        weight: Tensor,
        grad: Tensor,
        states: Mapping[str, Tensor],
        scalars: Mapping[str, Tensor],
    ) -> Updated:
        spec = "...,...,->..."
        m = prog.einsum(
            spec,
            states["exp_avg"],
            grad,
            scalars["beta1"],
            join="c * a + (1.0 - c) * b",
            label="adamw.m",
        )
        v = prog.einsum(
            spec,
            states["exp_avg_sq"],
            grad,
            scalars["beta2"],
            join="c * a + (1.0 - c) * b * b",
            label="adamw.v",
        )
        new = prog.einsum(
            "...,...,...,,,,->...",
            weight,
            m,
            v,
            scalars["keep"],
            scalars["step_size"],
            scalars["correction"],
            scalars["eps"],
            join="a * d - e * b / (sqrt(c) * f + g)",
            label="adamw",
        )
        return Updated(new, {"exp_avg": m, "exp_avg_sq": v})


OPTIMIZERS: dict[str, type[Optimizer]] = {"sgd": SGD, "adamw": AdamW}
"""Optimizers by name."""
