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
  count t (1 on the first step, as torch's after its increment) as the program input
  "step", so one program serves every step.

>>> import einpage as ep
>>> prog = ep.Program()
>>> w = prog.input("w", (4,), role="weight")
>>> opt = SGD(lr=0.1)
>>> new = opt.update(prog, w, ep.scale(w, 2.0), {}, opt.scalars(prog, "float32"))
>>> new.weight.shape, new.states
((4,), {})
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from einpage.program import Program, Tensor
from einpage_core.errors import ProgramError
from taskgraph import dtypes

__all__ = ["Optimizer", "SGD", "AdamW", "Updated", "OPTIMIZERS", "update_dtype"]


def update_dtype(dtype: str) -> str:
    """The dtype an update runs in for a model in `dtype`: float32, or float64 for a
    float64 model; never a 16-bit float, whose rounding would swallow the small updates
    of training (`einpage.models.training`: mixed precision).

    >>> update_dtype("bfloat16"), update_dtype("float32"), update_dtype("float64")
    ('float32', 'float32', 'float64')
    """
    return "float64" if dtypes.canonical(dtype) == "float64" else "float32"


@dataclass(frozen=True)
class Updated:
    """The result of one weight's update: the new weight and its new states by name."""

    weight: Tensor
    states: dict[str, Tensor] = field(default_factory=dict)


def _check_number(owner: str, name: str, value: float, low: float, high: float | None) -> None:
    ok = isinstance(value, int | float) and not isinstance(value, bool)
    if not ok or value < low or (high is not None and value >= high):
        bound = f"[{low}, {high})" if high is not None else f">= {low}"
        raise ProgramError(f"{owner}: {name} must be a number in {bound}, got {value!r}")


class Optimizer:
    """The interface: `states` (names of the per-weight state tensors), `scalars` (the
    per-step numbers computed once per program) and `update` (one weight's step)."""

    states: tuple[str, ...] = ()
    counts_steps: bool = False
    """Whether the program has the input "step" (the step number t, 1 first)."""

    def state_domain(self, state: str) -> str:
        """Where the values of the state `state` lie (`taskgraph.nodes.DOMAINS`), stated on
        its input: "real" unless the update keeps it narrower."""
        return "real"

    def scalars(self, prog: Program, dtype: str) -> dict[str, Tensor]:
        """Tensors every weight's update shares (made once, before the backward pass)."""
        return {}

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
    gradient, as torch's SGD) and Nesterov momentum."""

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

    def update(
        self,
        prog: Program,
        weight: Tensor,
        grad: Tensor,
        states: Mapping[str, Tensor],
        scalars: Mapping[str, Tensor],
    ) -> Updated:
        # Operands: a = the gradient, b = the weight, c = the momentum buffer.
        direction = f"(a + {self.weight_decay!r} * b)" if self.weight_decay else "a"
        if not self.momentum:
            join = f"b - {self.lr!r} * {direction}"
            return Updated(prog.einsum("...,...->...", grad, weight, join=join, label="sgd"))
        m = self.momentum
        buffer = prog.einsum(
            "...,...,...->...",
            grad,
            weight,
            states["momentum_buffer"],
            join=f"{m!r} * c + {direction}",
            label="sgd.momentum",
        )
        if self.nesterov:  # the decayed gradient plus momentum times the new buffer
            join = f"b - {self.lr!r} * ({direction} + {m!r} * c)"
            new = prog.einsum("...,...,...->...", grad, weight, buffer, join=join, label="sgd")
        else:
            join = f"a - {self.lr!r} * b"
            new = prog.einsum("...,...->...", weight, buffer, join=join, label="sgd")
        return Updated(new, {"momentum_buffer": buffer})


@dataclass(frozen=True)
class AdamW(Optimizer):
    """Adam with decoupled weight decay and bias correction, as `torch.optim.AdamW`:

    m' = b1 m + (1 - b1) g,  v' = b2 v + (1 - b2) g²,
    w' = w (1 - lr wd) - lr / (1 - b1^t) · m' / (sqrt(v') / sqrt(1 - b2^t) + eps).
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

    def scalars(self, prog: Program, dtype: str) -> dict[str, Tensor]:
        """From the input "step" (t): `lr / (1 - b1^t)` and `1 / sqrt(1 - b2^t)`."""
        b1, b2 = self.betas
        with prog.scope("optim"):
            step = prog.input("step", (), dtype, domain="positive")
            size = prog.einsum("->", step, join=f"{self.lr!r} / (1.0 - {b1!r} ** a)")
            correction = prog.einsum("->", step, join=f"rsqrt(1.0 - {b2!r} ** a)")
        return {"step_size": size, "correction": correction}

    def update(
        self,
        prog: Program,
        weight: Tensor,
        grad: Tensor,
        states: Mapping[str, Tensor],
        scalars: Mapping[str, Tensor],
    ) -> Updated:
        b1, b2 = self.betas
        spec = "...,...->..."
        m = prog.einsum(
            spec, states["exp_avg"], grad, join=f"{b1!r} * a + {1 - b1!r} * b", label="adamw.m"
        )
        v = prog.einsum(
            spec,
            states["exp_avg_sq"],
            grad,
            join=f"{b2!r} * a + {1 - b2!r} * b * b",
            label="adamw.v",
        )
        keep = 1.0 - self.lr * self.weight_decay
        join = f"a * {keep!r} - d * b / (sqrt(c) * e + {self.eps!r})"
        new = prog.einsum(
            "...,...,...,,->...",
            weight,
            m,
            v,
            scalars["step_size"],
            scalars["correction"],
            join=join,
            label="adamw",
        )
        return Updated(new, {"exp_avg": m, "exp_avg_sq": v})


OPTIMIZERS: dict[str, type[Optimizer]] = {"sgd": SGD, "adamw": AdamW}
"""Optimizers by name."""
