"""The workloads of issue 26 placed on several devices, shared by `test_workloads.py`
(one process, `runtime.multi.run_devices`) and `test_ray_workloads.py` (a local Ray
instance, `runtime.ray_cluster`): LLaMA-tiny and GPT-2-tiny prefill, an unrolled
generation, a decode step over KV pages and a training step, each with its inputs and
the tolerance of its outputs against `taskgraph.evaluate` of the unsplit graph; plans at
each device's smallest budget (which force offloads); random layered programs
(`test_placement.layered_programs`) planned at random budgets between each device's
smallest and its resident peak.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import numpy as np
from strategies import TOLERANCE, program_inputs
from test_placement import training_case
from test_placement_driver import llama_case

from einpage.models import gpt2, llama
from einpage.models.generation import decode_inputs, generation_inputs
from memgraph import min_budget, read_budget
from memgraph.multi import MultiPlan, plan_devices, verify_multi
from memgraph.options import PlanOptions
from memgraph.placement import place
from taskgraph.facts import KVPage, fact_of
from taskgraph.partition import partition

HOST = PlanOptions(outputs="host")
PAGE_SIZE = 4


@dataclass(frozen=True)
class Workload:
    """A TaskGraph `tg`, its inputs and the relative tolerance of its float outputs
    (integer outputs, the chosen ids, must be equal)."""

    name: str
    tg: Any
    inputs: dict[str, np.ndarray]
    rtol: float = 1e-5


def _random_weights(shapes, seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {
        name: (
            rng.standard_normal(shape) * (0.3 if len(shape) > 1 else 0.1) + (len(shape) == 1)
        ).astype(np.float32)
        for name, shape in shapes.items()
    }


PREFILL_LAYERS = 4
"""Layers of the prefill cases: a pipeline needs a layer per device (Layer facts), and
the prefill cases run on up to 4 devices."""


def llama_prefill(seq: int = 8) -> Workload:
    cfg = replace(llama.PRESETS["tiny"], num_layers=PREFILL_LAYERS)
    tg, arrays = llama_case(cfg, seq=seq)
    return Workload("llama-prefill", tg, arrays)


def gpt2_prefill(seq: int = 8) -> Workload:
    cfg = replace(gpt2.PRESETS["tiny"], num_layers=PREFILL_LAYERS)
    weights = _random_weights(gpt2.weight_shapes(cfg), 1)
    tokens = np.random.default_rng(1).integers(0, cfg.vocab_size, (2, seq))
    tg = gpt2.prefill_program(cfg, 2, seq).build()
    return Workload("gpt2-prefill", tg, gpt2.prefill_inputs(cfg, tokens, weights))


def partitioned_prefill(seq: int = 8, limit: str = "24KiB") -> Workload:
    """LLaMA-tiny prefill partitioned into blocks of at most `limit` (weights read in
    slices, the logits assembled on the host)."""
    case = llama_prefill(seq)
    return Workload("llama-prefill-blocks", partition(case.tg, limit), case.inputs)


MODELS = {"llama": llama, "gpt2": gpt2}


def generation(model: str = "llama", prompt: int = 5, new: int = 3) -> Workload:
    """An unrolled greedy generation of `new` tokens after a prompt of `prompt` (output
    "ids": the chosen ids, which each step reads back through the embedding)."""
    family = MODELS[model]
    cfg = family.PRESETS["tiny"]
    weights = _random_weights(family.weight_shapes(cfg), 2)
    tokens = np.random.default_rng(3).integers(0, cfg.vocab_size, (2, prompt))
    tg = family.generation_program(cfg, 2, prompt, new).build()
    inputs = generation_inputs(family.FAMILY, cfg, tokens, new, weights=weights)
    return Workload(f"{model}-generation", tg, inputs)


def decode_step(pages: int = 2, length: int = 5) -> Workload:
    """One LLaMA-tiny decode step over a cache of `pages` pages of `PAGE_SIZE` positions,
    `length` of them filled (random keys and values)."""
    cfg = llama.PRESETS["tiny"]
    tg = llama.decode_program(cfg, 2, pages, page_size=PAGE_SIZE).build()
    filled = pages * PAGE_SIZE + 1
    rng = np.random.default_rng(4)
    inputs = program_inputs(tg, 4)  # the pages (and anything else) random
    inputs.update(_random_weights(llama.weight_shapes(cfg), 4))
    inputs.update(llama.position_inputs(cfg, filled))
    previous = rng.integers(0, cfg.vocab_size, 2)
    inputs.update(decode_inputs(previous, length, pages, PAGE_SIZE))
    assert sorted(inputs) == sorted(tg.inputs), sorted(set(inputs) ^ set(tg.inputs))
    return Workload("llama-decode", tg, inputs)


def training_step() -> Workload:
    """A LLaMA-tiny training step with SGD and momentum (`test_placement.training_case`):
    the loss, the updated weights and the optimizer's states."""
    tg, inputs = training_case()
    return Workload("llama-training", tg, inputs, rtol=1e-4)


def kv_pages(tg) -> dict[int, KVPage]:
    """The inputs of `tg` that state a `KVPage`, by task id."""
    return {i: fact_of(tg[i], KVPage) for i in tg.inputs.values() if fact_of(tg[i], KVPage)}


# -- plans -------------------------------------------------------------------------------


def smallest_plans(tg, devices: int) -> tuple[MultiPlan, MultiPlan]:
    """`tg` placed on `devices` devices and planned at each device's smallest budget,
    verified; and the same placement planned at each device's resident peak."""
    placed = place(tg, devices)
    mp = plan_devices(placed, devices, [min_budget(part.tg)[0] for part in placed.parts])
    verify_multi(mp)
    return mp, plan_devices(placed, devices, "100%")


def moved(mg) -> int:
    """Bytes a plan copies between the host and its device or drops."""
    s = mg.stats
    return s.offload_bytes + s.reload_bytes + s.drop_bytes


def assert_forced_to_move(mp: MultiPlan, roomy: MultiPlan) -> None:
    """Every device keeps to its budget, no budget exceeds the device's resident peak,
    and the plans as a whole copy more bytes, and some device more often, than at the
    resident peaks: the budgets force traffic. (A pipeline's last stage, which holds
    only the head, often has nothing to gain from a smaller budget: it is not required
    to move more on its own.)"""
    for plan, at_peak in zip(mp.plans, roomy.plans, strict=True):
        assert plan.mg.stats.peak_bytes <= plan.budget <= at_peak.budget, plan.device
    assert sum(moved(p.mg) for p in mp.plans) > sum(moved(p.mg) for p in roomy.plans)
    more = [
        p.device
        for p, r in zip(mp.plans, roomy.plans, strict=True)
        if p.mg.stats.offload_count + p.mg.stats.reload_count
        > r.mg.stats.offload_count + r.mg.stats.reload_count
    ]
    assert more, "no device copies more often at its smallest budget than at its peak"


def random_budgets(placed, tight: float) -> list[int]:
    """Per device, `tight` of the way from its smallest budget to its resident peak."""
    budgets = []
    for part in placed.parts:
        low, high = min_budget(part.tg)[0], read_budget(part.tg, "100%", HOST).nbytes
        budgets.append(max(low, int(low + tight * (high - low))))
    return budgets


def assert_close(got: dict, want: dict, rtol: float) -> None:
    """The same output names; float outputs within `rtol` (absolute: `rtol` times the
    largest magnitude of the reference), integer outputs equal."""
    assert sorted(got) == sorted(want)
    for name, expected in want.items():
        value = np.asarray(got[name])
        assert value.shape == expected.shape and value.dtype == expected.dtype, name
        if np.issubdtype(expected.dtype, np.integer):
            np.testing.assert_array_equal(value, expected, err_msg=name)
        else:
            scale = float(np.max(np.abs(expected))) if expected.size else 0.0
            np.testing.assert_allclose(
                value, expected, rtol=rtol, atol=rtol * max(scale, 1.0), err_msg=name
            )


def tolerance_of(tg) -> float:
    """The tolerance of a random program's outputs: that of its widest float dtype."""
    names = {tg[i].dtype for i in tg.outputs.values()}
    return max(TOLERANCE.get(str(name), 1e-4) for name in names)


# -- tensor parallelism --------------------------------------------------------------------


def llama_gqa_prefill(kv_heads: int = 2, seq: int = 8) -> Workload:
    """LLaMA-tiny prefill with grouped-query attention: `kv_heads` KV groups of two query
    heads each (tensor parallelism splits the groups: `kv_heads` devices at most)."""
    cfg = replace(
        llama.PRESETS["tiny"],
        num_layers=PREFILL_LAYERS,
        num_heads=2 * kv_heads,
        num_kv_heads=kv_heads,
        name=f"llama-tiny-gqa{kv_heads}",
    )
    tg, arrays = llama_case(cfg, seq=seq)
    return Workload(f"llama-gqa{kv_heads}-prefill", tg, arrays)


def smallest_placed_plans(placed) -> tuple[MultiPlan, MultiPlan]:
    """`placed` (a `PlacedGraph` of any strategy) planned at each device's smallest budget
    and at each device's resident peak, both verified."""
    devices = placed.devices
    mp = plan_devices(placed, devices, [min_budget(part.tg)[0] for part in placed.parts])
    roomy = plan_devices(placed, devices, "100%")
    verify_multi(mp)
    verify_multi(roomy)
    return mp, roomy
