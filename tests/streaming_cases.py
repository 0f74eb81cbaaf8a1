"""Programs for the layer-streaming and bounds tests, and the budget at which they stream."""

from __future__ import annotations

import contextlib

import einpage as ep
from einpage.errors import InfeasibleBudgetError
from einpage.models import gpt2, llama
from memgraph.baselines import layer_streaming_plan, streaming_peak


def mlp(layers: int = 3, width: int = 512, batch: int = 64, scoped: bool = True):
    """x [batch, width] through `layers` of relu(h @ w_i) + h, then a head."""
    prog = ep.Program("mlp")
    h = prog.input("x", (batch, width))
    for i in range(layers):
        name = f"layers.{i}" if scoped else None
        with prog.scope(name) if scoped else contextlib.nullcontext():
            w = prog.input(f"w{i}", (width, width), role="weight")
            h = ep.relu(h @ w) + h
    with prog.scope("head") if scoped else contextlib.nullcontext():
        prog.output(h @ prog.input("head", (width, 8), role="weight"), "y")
    return prog.build()


PROGRAMS = {
    "mlp": lambda: mlp(),
    "mlp-unscoped": lambda: mlp(scoped=False),
    "llama-tiny": lambda: llama.prefill_program(llama.PRESETS["tiny"], 1, 8).build(),
    "llama-tiny-gqa": lambda: llama.prefill_program(llama.PRESETS["tiny-gqa"], 2, 4).build(),
    "gpt2-tiny": lambda: gpt2.prefill_program(gpt2.PRESETS["tiny"], 1, 8).build(),
}


def working_budget(tg) -> int:
    """The streaming peak, or the smallest budget that works when the arena fragments."""
    peak = streaming_peak(tg)[0]
    try:
        layer_streaming_plan(tg, peak, prefetch=0)
    except InfeasibleBudgetError as err:
        assert err.needed > peak
        return err.needed
    return peak
