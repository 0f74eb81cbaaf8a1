"""The planner's options (`PlanOptions`), validated once, and the values each may take."""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Any

from einpage_core.errors import PlanError
from memgraph.allocator import DEFAULT_ALIGNMENT, alignment_problem
from memgraph.cost import CostModel, get_cost_model
from memgraph.eviction import get_policy
from memgraph.orders import get_order

__all__ = ["PlanOptions", "OUTPUTS", "INPUTS", "PLACEMENTS", "RECOMPUTES"]

OUTPUTS = ("device", "host")
"""Where program outputs end: resident on the device, or offloaded to host storage."""
INPUTS = ("auto", "host")
"""Where inputs start: "auto" follows each `Input.location` (device ones while they fit)."""
PLACEMENTS = ("room", "best_fit", "lifetime")
"""Where allocations without eviction go: "room" (best fit, unless that leaves no room
for the next step that reads the tensor, see `memgraph.horizon`), plain "best_fit", or
"lifetime" (next to the neighbour whose last use is nearest, the arena's ends counting
as never freed: `Horizon.fit_by_lifetime`)."""
RECOMPUTES = ("auto", "never")
"""What an eviction of a tensor with no host copy may do: "auto" drops it and recomputes
it before its next use where that is cheaper than offloading and reloading it (see
`memgraph.recompute`); "never" always offloads it."""


@dataclass(frozen=True)
class PlanOptions:
    """The planner's options (see `memgraph.plan`), validated; `info()` is their JSON form.

    >>> PlanOptions(eviction="lru").info()["eviction"]
    'lru'
    """

    order: str | tuple[int, ...] = "program"
    eviction: str = "belady"
    lookahead: int = 64
    lookahead_seconds: float | str | None = "auto"
    cost_model: str | CostModel = "h100-pcie5"
    alignment: int = DEFAULT_ALIGNMENT
    outputs: str = "device"
    inputs: str = "auto"
    placement: str = "room"
    schedule_transfers: bool = False
    recompute: str = "auto"
    hide_reloads: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.order, str):
            object.__setattr__(self, "order", tuple(self.order))
        else:
            get_order(self.order)
        get_policy(self.eviction)
        get_cost_model(self.cost_model)
        if isinstance(self.lookahead, bool) or not isinstance(self.lookahead, int):
            raise PlanError(f"lookahead must be a number of steps >= 0, got {self.lookahead!r}")
        if self.lookahead < 0:
            raise PlanError(f"lookahead must be a number of steps >= 0, got {self.lookahead}")
        seconds = self.lookahead_seconds
        if not (seconds is None or seconds == "auto" or _is_nonnegative_number(seconds)):
            raise PlanError(
                f"lookahead_seconds must be 'auto', None or seconds >= 0, got {seconds!r}"
            )
        problem = alignment_problem(self.alignment)
        if problem is not None:
            raise PlanError(problem)
        if self.outputs not in OUTPUTS:
            raise PlanError(f"outputs must be one of {OUTPUTS}, got {self.outputs!r}")
        if self.inputs not in INPUTS:
            raise PlanError(f"inputs must be one of {INPUTS}, got {self.inputs!r}")
        if self.placement not in PLACEMENTS:
            raise PlanError(f"placement must be one of {PLACEMENTS}, got {self.placement!r}")
        if not isinstance(self.schedule_transfers, bool):
            raise PlanError(
                f"schedule_transfers must be True or False, got {self.schedule_transfers!r}"
            )
        if not isinstance(self.hide_reloads, bool):
            raise PlanError(f"hide_reloads must be True or False, got {self.hide_reloads!r}")
        if self.recompute not in RECOMPUTES:
            raise PlanError(f"recompute must be one of {RECOMPUTES}, got {self.recompute!r}")

    @classmethod
    def from_keywords(
        cls, options: dict[str, Any], where: str, others: tuple[str, ...] = ()
    ) -> PlanOptions:
        """`PlanOptions(**options)`, refusing a name that is no option with a `PlanError`
        naming what `where` takes (its own keywords `others` and the planner's)."""
        known = [f.name for f in fields(cls)]
        unknown = [name for name in options if name not in known]
        if unknown:
            raise PlanError(
                f"{where} has no option {', '.join(map(repr, unknown))}; it takes "
                f"{', '.join([*others, *known])}"
            )
        return cls(**options)

    def info(self) -> dict[str, Any]:
        cost = get_cost_model(self.cost_model)
        return {
            "order": self.order if isinstance(self.order, str) else "custom",
            "eviction": self.eviction,
            "lookahead": self.lookahead,
            "lookahead_seconds": self.lookahead_seconds,
            "cost_model": cost.name,
            "alignment": self.alignment,
            "outputs": self.outputs,
            "inputs": self.inputs,
            "placement": self.placement,
            "schedule_transfers": self.schedule_transfers,
            "recompute": self.recompute,
            "hide_reloads": self.hide_reloads,
        }


def _is_nonnegative_number(value: Any) -> bool:
    return (
        isinstance(value, int | float)
        and not isinstance(value, bool)
        and math.isfinite(value)
        and value >= 0
    )
