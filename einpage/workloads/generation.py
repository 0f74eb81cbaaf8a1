"""Planning a generation two ways under one budget, running the plans, and what they cost.

* **Unrolled** (`UnrolledPlan`): the prefill and every decode step in one program
  (`einpage.models.generation.generation_program`), planned once by `einpage.compile`.
  The planner sees every future use of every weight and KV page – Belady over the whole
  generation – so what stays resident is chosen across steps, and the ids of each step
  feed the next on the device.
* **Step plans** (`StepPlans`): a prefill plan, then decode plans reused across steps:
  one per length bucket (`decode_program`: a cache of up to `pages` pages, rounded up
  to `bucket_pages`; the positions and the mask of filled positions are inputs) and
  chunk size (`chunk_steps` consecutive steps per run, default 1). One
  `runtime.Session` holds every plan and runs the loop: one arena (the largest plan's),
  one host buffer, the weights and the position tables staged once for all plans. The
  pages live in host memory between runs, where the loop writes each run's new keys and
  values into their pages; a page is staged when a plan first needs it and again only
  after a run wrote it. Inside a run the plan pages the KV cache and the weights under
  the budget like any tensors, but nothing stays on the device from one run to the
  next: every run reads its pages and the weights it does not hold from host memory
  again. Planning cost grows with the number of (bucket, chunk size) pairs and the
  chunk length, not with the number of steps.

Which to use: unrolled when the program fits in planning time (it keeps a fixed set of
weights and the most reused pages resident across steps, and needs no host round trip
per token); step plans for generations too long to unroll, with chunks as long as
planning time allows, at the price of re-reading from host memory, every run, whatever
does not fit in one run's plan. The README's "Measured" section quantifies both
(`benchmarks/generation.py`).

On several devices (`Planning(devices=N)`): each program of either way is placed by
pipeline (`einpage.compile_devices`, each device under the budget read against its own
graph): the unrolled program as a `DevicesPlan`; the prefill and each decode program as
a `DevicesStepPlans`, whose step loop is `StepPlans`'s, each run across the devices with
one session per device over its share of every plan (the KV pages in host memory between
runs, each staged on its layer's device). Both run in one process or on Ray actors.

Budgets: both ways share one reading (`read_generation_budget`). `"N%"` is of the
resident peak of the plans themselves (the unrolled plan's, or the largest step plan's:
at 100% nothing moves); `"N%streaming"` is of the streaming minimum of one token (the
larger of the prefill's and the last decode step's), the same bytes both ways. Each
plan's `budget` says which reference point it was read against.

How to plan is one record, `Planning`: the way, the step plans' buckets and chunks, the
cost model the plans are made and simulated for, and `einpage.compile`'s options. It
checks itself when made, so `plan_generation` takes it as it is.

`GenerationStats` reports the simulated time on a cost model, tokens/s, and the bytes
each way moves: weights streamed and KV pages paged (reloaded and offloaded), in total
and per generated token.
"""

from __future__ import annotations

import copy
import math
import os
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, fields, replace
from types import MappingProxyType
from typing import Any

import numpy as np

import memgraph
import runtime
from einpage.models.base import ModelConfig, ModelFamily, checkpoint_places
from einpage.models.decode import Sampling
from einpage.models.errors import GenerationBudgetError, GenerationError
from einpage.models.generation import (
    DEFAULT_PAGE_SIZE,
    check_generation,
    check_lengths,
    check_quant,
    check_tokens,
    decode_inputs,
    decode_program,
    generation_inputs,
    generation_program,
    quant_by_weight,
)
from einpage.pipeline import COMPILE_KEYWORDS, Compiled
from einpage.pipeline import compile as compile_program
from einpage.pipeline.devices import (
    AUTO,
    DEVICES_KEYWORDS,
    RUNNERS,
    CompiledDevices,
    budgets_line,
    compile_devices,
)
from einpage.program.program import Program
from einpage.program.quantize import Quantization, quantize_each
from einpage_core.errors import EinpageError, InfeasibleBudgetError, UnsupportedError
from einpage_core.units import format_bytes
from memgraph import CostModel, MemGraph, NodeKind
from memgraph.budgets import PERCENT, BudgetReading, read_budget
from memgraph.multi import DeviceBudgetError, MultiPlan
from memgraph.peer import SENDS
from memgraph.placement import STRATEGIES
from runtime.hostmem import SharedHost
from taskgraph import dtypes
from taskgraph.facts import KVEntries, KVPage, chosen_ids, fact_of, first_needing, is_kv_page
from taskgraph.graph import TaskGraph
from taskgraph.nodes import Input

__all__ = [
    "WAYS",
    "Planning",
    "PLANNING_OPTIONS",
    "GenerationSpec",
    "Transfers",
    "GenerationStats",
    "GenerationOutput",
    "UnrolledPlan",
    "StepPlans",
    "Chunk",
    "chunks_of",
    "plan_generation",
    "read_generation_budget",
    "token_programs",
    "steps_of",
    "STEP_OPTIONS",
    "DEVICES_OPTIONS",
    "DevicesPlan",
    "DevicesStepPlans",
    "ON_DEVICES",
    "DevicesNotBuiltError",
    "weight_devices",
    "RUNNERS_ORDER",
    "DeviceStats",
]

WAYS = ("unrolled", "steps")
"""The ways to plan a generation: one unrolled plan, or step plans per length bucket."""

PLANNER_OPTIONS = tuple(f.name for f in fields(memgraph.PlanOptions) if f.name != "cost_model")
"""The planner's options a `Planning` passes on (`memgraph.PlanOptions`; the cost model
is a field of the record itself)."""

_NOT_PLANNING = ("budget", "host_budget", "checkpoint", "spill")

PLANNING_OPTIONS = (*(k for k in COMPILE_KEYWORDS if k not in _NOT_PLANNING), *PLANNER_OPTIONS)
"""The names `Planning.options` takes: `einpage.compile`'s own keywords but the budget and
the host tier's (partition, verify, max_blocks, progress), then the planner's."""

DEFAULT_COST_MODEL = "h100-pcie5"
"""The machine plans are made and simulated for unless a `Planning` names another."""


DEVICES_OPTIONS = (
    *(k for k in DEVICES_KEYWORDS if k not in ("budget", "devices", "strategy", "sends")),
    *PLANNER_OPTIONS,
)
"""The names `Planning.options` takes with `devices` > 1: `einpage.compile_devices`'s own
keywords but the budget, the devices, the strategy and the sends (partition, verify), then
the planner's."""


class DevicesNotBuiltError(GenerationError, UnsupportedError):
    """A generation asked of several devices in a way that is not built: the "streams"
    mode (each device runs its nodes one at a time); the message names the modes that
    are."""


def _positive_int(what: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise GenerationError(f"Planning: {what} must be a positive int, got {value!r}")


@dataclass(frozen=True)
class Planning:
    """How a generation is planned, checked once when made (`GenerationError` naming the
    field, the value and what is valid), then trusted by `plan_generation`:

    * `way`: one of `WAYS` – "unrolled" (one plan) or "steps" (a prefill plan and decode
      plans reused across steps);
    * `bucket_pages`, `chunk_steps`: step plans serve length buckets of `bucket_pages`
      pages and chunks of `chunk_steps` consecutive steps (positive ints; the unrolled
      way has neither);
    * `cost_model`: the machine (`memgraph.COST_MODELS`) the planner times prefetches
      for and the stats simulate;
    * `options`: `einpage.compile`'s keywords (`PLANNING_OPTIONS`: partition, verify,
      max_blocks, progress, and the planner's – order, eviction, lookahead, ...); the
      planner's are checked here by `memgraph.PlanOptions`, `einpage.compile` checks its
      own. Step plans send their outputs to the host (`STEP_OPTIONS`) unless `options`
      says otherwise;
    * `devices`: the devices the generation is placed on (a positive int; 1: one plan
      made by `einpage.compile`). With more than one, each program – the unrolled one
      (a `DevicesPlan`), or the prefill and each decode program of step plans (a
      `DevicesStepPlans`) – is placed by `strategy` (`einpage.compile_devices`; by
      default a pipeline: the layers' weights cut into `devices` contiguous groups),
      each device planned under
      the budget read against its own graph; `options` are then `DEVICES_OPTIONS` (no
      progress bars or max_blocks);
    * `strategy`: how several devices share the work (`memgraph.placement.STRATEGIES`):
      "pipeline" (the default: consecutive layers per device), "tensor" (each device
      its share of every layer's heads and MLP columns) or, for the unrolled way,
      "auto" (each planned, the fastest on `cost_model` kept). Step plans take one
      strategy for all their plans: each device stages its weights once for them all.
    * `sends`: how tensors travel between several devices (`memgraph.peer.SENDS`): "host"
      (the default: staged through host memory) or "direct" (device to device wherever
      `memgraph.peer.direct_sends` proves it safe; for every plan, unrolled or step).
    * `host_budget`, `spill`, `checkpoint`: host memory planned as a budget too
      (`einpage.compile`'s keywords of the same names, `memgraph.tiers`): within
      `host_budget` (bytes, a size string, a percentage), the weights read where they are
      in the safetensors `checkpoint` (a `save_pretrained` folder: the family's Hugging
      Face layout, `einpage.models.base.checkpoint_places`; `generate` gives its model's
      folder), what does not fit written to a spill file in the folder `spill` during the
      run. Built for one device, the unrolled way (a plan with a host tier runs alone in
      its session, so step plans cannot share one).

    >>> Planning(way="steps", chunk_steps=8, options={"eviction": "lru"}).compile_options()
    {'outputs': 'host', 'eviction': 'lru', 'cost_model': 'h100-pcie5'}
    """

    way: str = "unrolled"
    bucket_pages: int = 1
    chunk_steps: int = 1
    cost_model: str | CostModel = DEFAULT_COST_MODEL
    options: Mapping[str, Any] = field(default_factory=dict, hash=False)
    devices: int = 1
    strategy: str = "pipeline"
    sends: str = "host"
    host_budget: int | str | None = None
    spill: str | os.PathLike[str] | None = None
    checkpoint: str | os.PathLike[str] | None = None

    @property
    def tiered(self) -> bool:
        """Whether host memory is planned too (a host budget, spill folder or checkpoint)."""
        return any(x is not None for x in (self.host_budget, self.spill, self.checkpoint))

    def __post_init__(self) -> None:
        if self.way not in WAYS:
            raise GenerationError(f"Planning: way must be one of {WAYS}, got {self.way!r}")
        _positive_int("bucket_pages", self.bucket_pages)
        _positive_int("chunk_steps", self.chunk_steps)
        _positive_int("devices", self.devices)
        strategies = (*STRATEGIES, AUTO)
        if self.strategy not in strategies:
            raise GenerationError(
                f"Planning: strategy must be one of {strategies}, got {self.strategy!r}"
            )
        if self.strategy != "pipeline" and self.devices == 1:
            raise GenerationError(
                f"Planning: strategy={self.strategy!r} places a generation on several "
                "devices: give devices=N (N > 1) too"
            )
        if self.sends not in SENDS:
            raise GenerationError(f"Planning: sends must be one of {SENDS}, got {self.sends!r}")
        if self.sends != "host" and self.devices == 1:
            raise GenerationError(
                f"Planning: sends={self.sends!r} sends tensors between several devices: give "
                "devices=N (N > 1) too"
            )
        if self.strategy == AUTO and self.way == "steps":
            raise GenerationError(
                "Planning: strategy='auto' would choose a placement for each step plan on "
                "its own, but each device stages its weights once for every plan: give "
                "strategy='pipeline' or 'tensor' with way='steps', or plan the unrolled way"
            )
        if not isinstance(self.options, Mapping):
            raise GenerationError(
                f"Planning: options must be a mapping of einpage.compile's keywords, got "
                f"{type(self.options).__name__}"
            )
        for name in self.options:
            if name == "cost_model":
                raise GenerationError(
                    "Planning: the cost model is a field of its own: give "
                    f"Planning(cost_model={self.options[name]!r}), not in options"
                )
            if name == "budget":
                raise GenerationError(
                    "Planning: the budget is an argument of generate and plan_generation, "
                    "not an option"
                )
            if name not in PLANNING_OPTIONS:
                raise GenerationError(
                    f"Planning: options has no {name!r}; it takes {', '.join(PLANNING_OPTIONS)}"
                )
            if self.devices > 1 and name not in DEVICES_OPTIONS:
                raise GenerationError(
                    f"Planning: options {name!r} is einpage.compile's, not taken with "
                    f"devices={self.devices} (einpage.compile_devices plans them); it takes "
                    f"{', '.join(DEVICES_OPTIONS)}"
                )
        self._check_tier()
        planner = {k: v for k, v in self.options.items() if k in PLANNER_OPTIONS}
        try:
            memgraph.PlanOptions(**planner, cost_model=self.cost_model)
        except EinpageError as err:
            raise GenerationError(f"Planning: {err}") from err
        object.__setattr__(self, "options", MappingProxyType(dict(self.options)))

    def _check_tier(self) -> None:
        """The host tier's fields: of the right types, and only where built."""
        if self.host_budget is not None and (
            isinstance(self.host_budget, bool) or not isinstance(self.host_budget, int | str)
        ):
            raise GenerationError(
                f"Planning: host_budget must be bytes or a size string ('16GiB', '50%'), got "
                f"{self.host_budget!r}"
            )
        for name in ("spill", "checkpoint"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, str | os.PathLike):
                raise GenerationError(
                    f"Planning: {name} must be a path, got {type(value).__name__}"
                )
        if not self.tiered:
            return
        given = ", ".join(
            f"{n}=" for n in ("host_budget", "spill", "checkpoint") if getattr(self, n) is not None
        )
        if self.devices > 1:
            raise GenerationError(
                f"Planning: {given} plans host memory for one device; a host tier on "
                f"{self.devices} devices is not built"
            )
        if self.way != "unrolled":
            raise GenerationError(
                f"Planning: {given} plans host memory for the unrolled way: a plan with a "
                "host tier runs alone in its session, which step plans share (not built); "
                "give way='unrolled'"
            )

    def compile_options(self, step_plans: bool | None = None) -> dict[str, Any]:
        """The keywords every plan's `einpage.compile` gets: `STEP_OPTIONS` when planning
        step plans (by default when `way` is "steps"), then `options`, then the cost
        model, and the host budget and spill folder when given (the checkpoint's places
        are found against the program: `plan_generation`)."""
        steps = self.way == "steps" if step_plans is None else step_plans
        tier = {
            name: value
            for name, value in (("host_budget", self.host_budget), ("spill", self.spill))
            if value is not None
        }
        return {
            **(STEP_OPTIONS if steps else {}),
            **self.options,
            "cost_model": self.cost_model,
            **tier,
        }

    def devices_options(self) -> dict[str, Any]:
        """The keywords `einpage.compile_devices` gets with `devices` > 1: `options`, then
        the cost model, the strategy and the sends (every device is planned with its
        outputs sent to the host, then links made direct as `sends` says)."""
        return {
            **self.options,
            "cost_model": self.cost_model,
            "strategy": self.strategy,
            "sends": self.sends,
        }

    def planner_options(self, step_plans: bool | None = None) -> memgraph.PlanOptions:
        """The planner's part of `compile_options`, as `memgraph.PlanOptions`."""
        chosen = self.compile_options(step_plans)
        return memgraph.PlanOptions(
            **{k: v for k, v in chosen.items() if k not in COMPILE_KEYWORDS}
        )


def moved_keywords(
    call: str, keywords: Mapping[str, Any], homes: Mapping[str, str], takes: str
) -> None:
    """`GenerationError` for keywords `call` no longer takes (none: nothing to say): each
    of `homes` (a keyword of its old signature) says where it went – `homes[name]` is
    the new spelling, `{v}` standing for the value given –; any other is no keyword of
    `call`, which `takes` lists."""
    moved = [f"{n}= is now {homes[n].format(v=repr(v))}" for n, v in keywords.items() if n in homes]
    unknown = [name for name in keywords if name not in homes]
    said = []
    if moved:
        said.append("its options moved into records: " + "; ".join(moved))
    if unknown:
        said.append(f"it has no keyword {', '.join(map(repr, unknown))} (it takes {takes})")
    if said:
        raise GenerationError(f"{call}: {'; and '.join(said)}")


def planning_homes(argument: str) -> dict[str, str]:
    """Where the planning keywords of the old `generate`/`plan_generation` went: into the
    `Planning` given as `argument` ("plan=" for generate, "" for plan_generation's third
    argument)."""
    homes = {}
    for name in ("way", "bucket_pages", "chunk_steps", "cost_model", "devices"):
        homes[name] = f"{argument}Planning({name}={{v}})"
    for name in PLANNING_OPTIONS:
        homes[name] = f"{argument}Planning(options={{{{{name!r}: {{v}}}}}})"
    return homes


@dataclass(frozen=True)
class GenerationSpec:
    """What a generation plan is for: the model, the shapes, the KV cache's page size and
    how tokens are chosen; `quant` (a `Quantization`, "int8" or "int4"; None: float
    weights) stores the weights the model quantizes in fewer bits
    (`einpage.program.quantize`), or a mapping gives the weights it names their own
    `Quantization`s (a GGUF file's: `GGUFModel.quantization()`); `lengths` (one per
    sequence, each at most `prompt_len`; None: every prompt is `prompt_len` long) makes
    a ragged batch, its prompts left padded to `prompt_len` (`ragged`). Checked once,
    here (`check_generation`: `GenerationError` naming the bad value); `generate` and
    `plan_generation` take it as it is."""

    family: ModelFamily
    cfg: ModelConfig
    batch: int
    prompt_len: int
    new_tokens: int
    dtype: str = "float32"
    page_size: int = DEFAULT_PAGE_SIZE
    sampling: Sampling | None = None
    logits: bool = False
    quant: Quantization | Mapping[str, Quantization] | None = None
    lengths: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        dtype = check_generation(
            self.family,
            self.cfg,
            self.batch,
            self.prompt_len,
            self.new_tokens,
            self.dtype,
            self.page_size,
            self.sampling,
        )
        object.__setattr__(self, "dtype", dtype)
        object.__setattr__(self, "quant", check_quant(self.quant))
        quant_by_weight(self.cfg, self.quant)  # a mapping's names are the program's
        if self.lengths is not None:
            lengths = check_lengths(self.lengths, self.prompt_len, self.batch)
            ragged = min(lengths) < self.prompt_len
            object.__setattr__(self, "lengths", lengths if ragged else None)

    @property
    def ragged(self) -> bool:
        """Whether the prompts have different lengths (left padded to `prompt_len`)."""
        return self.lengths is not None

    @property
    def pads(self) -> tuple[int, ...] | None:
        """Each sequence's left padding (None when not ragged)."""
        if self.lengths is None:
            return None
        return tuple(self.prompt_len - n for n in self.lengths)

    def program_weights(self, weights: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """The weight inputs of the spec's programs from float `weights` (keyed by
        `cfg.weight_shapes()`): as they are, or with `quant` quantized, each weight by its
        own `Quantization` (`quantize_each`: `{name}.q`, `{name}.scale` and, with
        minimums, `{name}.min`, scales in the spec's dtype)."""
        if self.quant is None:
            return dict(weights)
        return quantize_each(self.cfg, weights, self.weight_quants, dtype=self.dtype)

    @property
    def weight_quants(self) -> dict[str, Quantization]:
        """Each quantized weight and its `Quantization` (`quant_by_weight`; empty when
        the weights are float)."""
        return quant_by_weight(self.cfg, self.quant)

    @property
    def tokens(self) -> int:
        """Tokens generated: batch * new_tokens."""
        return self.batch * self.new_tokens

    @property
    def positions(self) -> int:
        """Positions the generation fills: the prompt's, then every new token's but the
        last (which is chosen, never fed back): prompt_len + new_tokens - 1."""
        return self.prompt_len + self.new_tokens - 1

    def gumbel(self, seed: int | None = None) -> np.ndarray | None:
        """The sampling noise [new_tokens, batch, vocab] of the sampling's seed, or of
        `seed` when given (None when greedy): standard Gumbel draws in step order, the
        same for both ways of planning."""
        if self.sampling is None:
            return None
        if seed is not None:  # checked as the sampling's own
            seed = replace(self.sampling, seed=seed).seed
        rng = np.random.default_rng(self.sampling.seed if seed is None else seed)
        shape = (self.new_tokens, self.batch, self.cfg.vocab_size)
        return rng.gumbel(size=shape).astype(self.dtype)

    def generation_program(
        self, new_tokens: int | None = None, cache_outputs: bool = False
    ) -> Program:
        return generation_program(
            self.family,
            self.cfg,
            self.batch,
            self.prompt_len,
            self.new_tokens if new_tokens is None else new_tokens,
            self.dtype,
            page_size=self.page_size,
            sampling=self.sampling,
            logits=self.logits,
            cache_outputs=cache_outputs,
            quant=self.quant,
            ragged=self.ragged,
        )

    def decode_program(self, pages: int, steps: int = 1) -> Program:
        return decode_program(
            self.family,
            self.cfg,
            self.batch,
            pages,
            self.dtype,
            steps=steps,
            page_size=self.page_size,
            sampling=self.sampling,
            logits=self.logits,
            positions=self.positions,
            quant=self.quant,
            ragged=self.ragged,
        )


# -- what plans cost ---------------------------------------------------------------------


def transfer_kind(tg: TaskGraph, task_id: int) -> str:
    """What a transferred tensor is: "weight", "kv" (a KV page: `taskgraph.facts.KVPage`)
    or "activation"."""
    if tg.is_input_slice(task_id):
        task_id = tg[task_id].inputs[0]
    task = tg[tg.storage_root(task_id)]
    if isinstance(task.op, Input) and task.op.role == "weight":
        return "weight"
    return "kv" if is_kv_page(task) else "activation"


@dataclass(frozen=True)
class Transfers:
    """Bytes a plan moves between host and device (tensor bytes, as `PlanStats` counts),
    by what moves: weights streamed in, KV pages reloaded and offloaded, other tensors."""

    weight_reload: int = 0
    kv_reload: int = 0
    kv_offload: int = 0
    other_reload: int = 0
    other_offload: int = 0

    @classmethod
    def of(cls, mg: MemGraph) -> Transfers:
        """The transfers of `mg`; a step plan's KV outputs (`taskgraph.facts.KVEntries`:
        its keys and values for the host cache) count as KV pages."""
        tg = mg.taskgraph
        kv_outputs = {tg.storage_root(i) for i in tg.outputs.values() if fact_of(tg[i], KVEntries)}
        counts: dict[str, dict[str, int]] = {"reload": {}, "offload": {}}
        for node in mg.nodes:
            if node.kind not in (NodeKind.RELOAD, NodeKind.OFFLOAD):
                continue
            kind = transfer_kind(tg, node.tensor)
            if tg.storage_root(node.tensor) in kv_outputs:
                kind = "kv"
            side = counts[node.kind.value]
            side[kind] = side.get(kind, 0) + tg[node.tensor].nbytes
        reload, offload = counts["reload"], counts["offload"]
        return cls(
            weight_reload=reload.get("weight", 0),
            kv_reload=reload.get("kv", 0),
            kv_offload=offload.get("kv", 0),
            other_reload=reload.get("activation", 0),
            other_offload=offload.get("activation", 0) + offload.get("weight", 0),
        )

    def __add__(self, other: Transfers) -> Transfers:
        return Transfers(*(a + b for a, b in zip(self.values(), other.values(), strict=True)))

    def values(self) -> tuple[int, ...]:
        return (
            self.weight_reload,
            self.kv_reload,
            self.kv_offload,
            self.other_reload,
            self.other_offload,
        )

    @property
    def kv_paged(self) -> int:
        """KV page bytes moved either way."""
        return self.kv_reload + self.kv_offload

    @property
    def total(self) -> int:
        return sum(self.values())


@dataclass(frozen=True)
class GenerationStats:
    """What a generation plan costs: `planning_seconds` (building the programs and
    compiling them), the simulated seconds of the whole generation on `cost_model`
    (prefill and every decode step), and its `transfers`. `plans`, `tasks`, `nodes`:
    how many plans, and their tasks and MemGraph nodes in all."""

    way: str
    tokens: int
    planning_seconds: float
    simulated_seconds: float
    cost_model: str
    transfers: Transfers
    plans: int
    tasks: int
    nodes: int
    devices: int = 1
    """The devices the plans run on; with more than one (a `DevicesPlan` or a
    `DevicesStepPlans`), `tasks` and `nodes` count every device's graph and plan (a
    replicated task once per device that makes it), `transfers` are every device's
    host<->device bytes summed (a link's tensor counted where it leaves its source and
    where it enters its target), and `simulated_seconds` is all devices together
    (`memgraph.simulate_multi`: the last device's end; for step plans, summed over the
    runs as on one device)."""

    @property
    def tokens_per_s(self) -> float:
        """Generated tokens (batch * new_tokens) per simulated second."""
        return self.tokens / self.simulated_seconds if self.simulated_seconds > 0 else math.inf

    @property
    def weight_bytes_per_token(self) -> float:
        return self.transfers.weight_reload / self.tokens

    @property
    def kv_bytes_per_token(self) -> float:
        return self.transfers.kv_paged / self.tokens

    def as_dict(self) -> dict[str, Any]:
        return {
            "way": self.way,
            "tokens": self.tokens,
            "planning_seconds": self.planning_seconds,
            "simulated_seconds": self.simulated_seconds,
            "tokens_per_s": self.tokens_per_s,
            "cost_model": self.cost_model,
            "weight_bytes_per_token": self.weight_bytes_per_token,
            "kv_bytes_per_token": self.kv_bytes_per_token,
            "transfers": dict(zip(_TRANSFER_NAMES, self.transfers.values(), strict=True)),
            "plans": self.plans,
            "tasks": self.tasks,
            "nodes": self.nodes,
            "devices": self.devices,
        }

    def rows(self) -> list[tuple[str, str]]:
        """(label, value) rows for a table."""
        t = self.transfers
        plans = f"{self.plans} ({self.way}): {self.tasks:,} tasks, {self.nodes:,} nodes"
        simulated = f"simulated ({self.cost_model})"
        summed = ""
        if self.devices > 1:
            plans = (
                f"{self.plans} ({self.way}) on {self.devices} devices: {self.tasks:,} tasks, "
                f"{self.nodes:,} nodes (all devices')"
            )
            simulated = f"simulated ({self.cost_model}, {self.devices} devices together)"
            summed = f", summed over {self.devices} devices"
        return [
            ("plans", plans),
            ("planning", f"{self.planning_seconds:.2f} s"),
            (
                simulated,
                f"{self.simulated_seconds * 1e3:.2f} ms, {self.tokens_per_s:,.1f} tokens/s",
            ),
            (
                "weights streamed",
                f"{format_bytes(t.weight_reload)} ({format_bytes(self.weight_bytes_per_token)}"
                f" per token{summed})",
            ),
            (
                "KV pages paged",
                f"{format_bytes(t.kv_reload)} in, {format_bytes(t.kv_offload)} out "
                f"({format_bytes(self.kv_bytes_per_token)} per token{summed})",
            ),
        ]


_TRANSFER_NAMES = ("weight_reload", "kv_reload", "kv_offload", "other_reload", "other_offload")


@dataclass(frozen=True)
class GenerationOutput:
    """A run's result: the new ids [batch, new_tokens], each step's logits [batch,
    new_tokens, vocab] when the plan outputs them, and the run reports of its sessions."""

    ids: np.ndarray
    logits: np.ndarray | None = None
    reports: tuple[Any, ...] = field(default=(), repr=False)


def _planning_seconds(compiled: Compiled) -> float:
    return sum(s for stage, s in compiled.timings.items() if stage != "verifying")


def _simulate(mg: MemGraph, cost_model: str) -> float:
    return memgraph.simulate(mg, cost_model).makespan


def _check_prompt(spec: GenerationSpec, tokens: Any) -> np.ndarray:
    ids = check_tokens(tokens, spec.cfg.vocab_size)
    if ids.shape != (spec.batch, spec.prompt_len):
        raise GenerationError(
            f"the prompt has shape {ids.shape}, the plan is for [batch, prompt_len] = "
            f"{[spec.batch, spec.prompt_len]}"
        )
    return ids


def steps_of(tg: TaskGraph) -> list[int | None]:
    """For each task of an unrolled generation, the step it serves: the first step whose
    choice of ids (`taskgraph.facts.ChosenIds`) needs it – 0 for the prefill, t for decode
    step t – or None when no choice does (what only the outputs read). Read from the
    graph's facts and edges, not from scopes."""
    return first_needing(tg, chosen_ids(tg))


def _step_of(tg: TaskGraph, task: int | None) -> str:
    """Which part of an unrolled generation a task belongs to (`steps_of`)."""
    if task is None:
        return "the whole generation"
    if isinstance(tg[task].op, Input):
        return "the inputs"
    step = steps_of(tg)[task]
    if step is None:
        return "the outputs"
    return "prefill" if step == 0 else f"step {step}"


def _compile(
    tg: TaskGraph, budget: Any, plan: str, step: str | None, options: Mapping[str, Any]
) -> tuple[Compiled, float]:
    """`einpage.compile` of `tg`, timed; an infeasible budget raises
    `GenerationBudgetError` naming the plan, the step and the task."""
    try:
        compiled = compile_program(tg, budget, **options)
    except InfeasibleBudgetError as err:
        where = _step_of(tg, err.task) if step is None else step
        line = (
            ""
            if err.task is None
            else f" (task {tg[err.task].line()}, scope {tg[err.task].scope!r})"
        )
        raise GenerationBudgetError(
            f"the {plan} plan of {tg.name!r} does not fit the budget at {where}{line}:\n{err}",
            err.budget,
            err.needed,
            err.task,
            where,
            plan,
        ) from err
    return compiled, _planning_seconds(compiled)


RUN_BYTES_PER_NODE = 1024
"""Host memory a session takes per node of its plans for its own bookkeeping (the
schedule, the interpreter's views; measured about 300 B on the tiny presets), counted
by `host_bytes` with a margin."""


def _session_host_bytes(plans: list[MemGraph], backend: runtime.Backend) -> int:
    """Host memory one session over `plans` allocates on `backend`: its host buffer (as
    `runtime.Session` lays it out: every input's home once, the largest plan's scratch),
    its bookkeeping (`RUN_BYTES_PER_NODE`) and, where the arena and the kernels are in
    host memory (NumPy), the arena (the largest plan's) and the largest result a kernel
    computes before storing it (in its compute dtype: float32 for 16-bit floats)."""
    staging = backend.host_staging
    shared = SharedHost.of(plans, staging, backend.in_place_min if staging else None)
    need = shared.promise + RUN_BYTES_PER_NODE * sum(len(mg) for mg in plans)
    if backend.arena_on_host:
        need += max(mg.budget for mg in plans)
        need += max(
            (
                _kernel_scratch(mg.taskgraph, t)
                for mg in plans
                for t in mg.taskgraph
                if t.is_compute
            ),
            default=0,
        )
    return need


def _kernel_scratch(tg: TaskGraph, task: Any) -> int:
    """Host memory the NumPy kernel of `task` allocates besides the arena: its result in
    the compute dtype and a copy, in it, of each operand stored in another dtype (a
    bfloat16 or float16 embedding table is widened to float32 for the LM head)."""

    def wide(t: Any) -> int:
        return t.size * dtypes.itemsize(dtypes.compute_dtype(t.dtype))

    operands = {tg.storage_root(i) for i in task.inputs}
    widened = sum(wide(tg[i]) for i in operands if dtypes.compute_dtype(tg[i].dtype) != tg[i].dtype)
    return wide(task) + widened


def _input_bytes(spec: GenerationSpec, tg: TaskGraph) -> int:
    """Host memory of a run's inputs besides the weights (the prompt, the position
    tables, the sampling noise, in the dtype, and the noise's float64 draw)."""
    held = sum(
        tg[i].nbytes
        for i in tg.inputs.values()
        if not (isinstance(tg[i].op, Input) and tg[i].op.role == "weight")
    )
    noise = 0 if spec.sampling is None else 8 * spec.new_tokens * spec.batch * spec.cfg.vocab_size
    return held + noise


class UnrolledPlan:
    """The whole generation as one plan (module docstring). `compiled` is
    `einpage.compile`'s result; `planning_seconds` includes building the program;
    `planning` is how it was planned (its cost model is the stats' by default)."""

    way = "unrolled"

    def __init__(
        self,
        spec: GenerationSpec,
        compiled: Compiled,
        planning_seconds: float,
        planning: Planning | None = None,
    ):
        self.spec = spec
        self.compiled = compiled
        self.planning_seconds = planning_seconds
        self.planning = Planning() if planning is None else planning

    @property
    def budget(self) -> BudgetReading:
        """How the budget was read (`read_generation_budget`)."""
        return self.compiled.budget

    def __repr__(self) -> str:
        return f"<UnrolledPlan {self.compiled.program.name!r}: {len(self.plan)} nodes>"

    @property
    def plan(self) -> MemGraph:
        return self.compiled.plan

    @property
    def plans(self) -> dict[str, Compiled]:
        """Every plan by name (one here)."""
        return {"unrolled": self.compiled}

    def host_bytes(self, backend: runtime.Backend) -> int:
        """Host memory a run on `backend` allocates besides the weights it is given: the
        session's host buffer and arena (NumPy) and the inputs (`run` checks nothing
        itself: a caller that must not run out of memory compares this first)."""
        return _session_host_bytes([self.plan], backend) + _input_bytes(
            self.spec, self.compiled.program
        )

    def stats(self, cost_model: str | CostModel | None = None) -> GenerationStats:
        """What the plan costs on `cost_model` (by default the one it was planned for); a
        plan with a host tier over a disk too (the cost model's, else
        `memgraph.cost.DEFAULT_DISK`), which the stats' cost model names
        ("h100-pcie5+nvme-pcie4")."""
        cost_model = self.planning.cost_model if cost_model is None else cost_model
        sim = memgraph.simulate(self.plan, cost_model)
        return GenerationStats(
            way=self.way,
            tokens=self.spec.tokens,
            planning_seconds=self.planning_seconds,
            simulated_seconds=sim.makespan,
            cost_model=sim.cost_model.name if self.plan.tier is not None else cost_model,
            transfers=Transfers.of(self.plan),
            plans=1,
            tasks=len(self.compiled.graph),
            nodes=len(self.plan),
        )

    def run(
        self,
        weights: Mapping[str, np.ndarray],
        tokens: Any,
        *,
        seed: int | None = None,
        backend: Any = "numpy",
        mode: str | None = None,
        run_seed: int = 0,
        direct_io: bool = False,
    ) -> GenerationOutput:
        """Generate from the prompt `tokens` [batch, prompt_len] with the program's
        `weights` (but those a plan with a host tier reads from its checkpoint itself:
        `runtime.tiers.disk_inputs`, refused if given; its spill file goes to the folder
        it was compiled with, its disk bytes move with O_DIRECT when `direct_io`:
        `runtime.Session`); `seed` draws the sampling noise (None: the spec's
        `Sampling.seed`; a plan can be run again with other noise), `run_seed` orders a
        random-mode run."""
        spec = self.spec
        ids = _check_prompt(spec, tokens)
        inputs = generation_inputs(
            spec.family, spec.cfg, ids, spec.new_tokens, spec.dtype, weights, spec.gumbel(seed),
            spec.lengths,
        )  # fmt: skip
        spill = self.compiled.spill
        with runtime.Session(
            self.plan, backend, mode=mode, spill=spill, direct_io=direct_io
        ) as session:
            out = session.run(inputs, seed=run_seed)
            return GenerationOutput(out["ids"], out.get("logits"), (session.last,))


@dataclass(frozen=True)
class DeviceStats:
    """One device's share of a `DevicesPlan` (`DevicesPlan.device_stats`; of step plans:
    `DevicesStepPlans.device_stats`, which says how it sums the runs): its budget as
    read against its graph and its plan's peak (bytes), its host<->device `transfers`
    (a link's tensor counted as it leaves or enters this device), when its last node ends
    in the simulation of all devices together (`finish_seconds`), its tasks and nodes,
    and the bytes it receives and sends through links."""

    device: int
    budget: int
    peak_bytes: int
    transfers: Transfers
    finish_seconds: float
    tasks: int
    nodes: int
    received_bytes: int
    sent_bytes: int


RUNNERS_ORDER = {None: "ready", "sequential": "ready", "random": "random"}
"""The order each device of a `DevicesPlan` or a `DevicesStepPlans` runs its ready nodes
in, by `Running.mode`: insertion order, or random (a missing dependency shows as a wrong
answer)."""


def _check_runner(what: str, runner: str) -> str:
    """`runner` if it is one of `RUNNERS`, else a `GenerationError` naming `what` runs."""
    if runner not in RUNNERS:
        raise GenerationError(
            f"a {what} runs on one of {', '.join(map(repr, RUNNERS))}, got {runner!r}"
        )
    return runner


def _placed_cost(
    compiled: CompiledDevices, cost_model: str | CostModel
) -> tuple[float, Transfers]:
    """One run of a placed plan: all devices simulated together
    (`memgraph.simulate_multi`), every device's transfers summed."""
    transfers = Transfers()
    for plan in compiled.plan.plans:
        transfers = transfers + Transfers.of(plan.mg)
    return compiled.simulate(cost_model).makespan, transfers


def _placed_size(compiled: CompiledDevices) -> tuple[int, int]:
    """A placed plan's tasks and MemGraph nodes, every device's."""
    mgs = [plan.mg for plan in compiled.plan.plans]
    return sum(len(mg.taskgraph) for mg in mgs), sum(len(mg) for mg in mgs)


class DevicesPlan:
    """The unrolled generation placed on several devices (`Planning.devices` > 1):
    `compiled` is `einpage.compile_devices`'s result (the pipeline placement, a plan per
    device under its own budget, the links between them, verified as a whole);
    `planning_seconds` includes building the program. The ids each step chooses go back
    to the device of the embedding through links, as any tensor read on another device.
    It runs in one process (`runtime.multi.run_devices`: a thread and an arena per
    device) or on Ray (`runtime.ray_cluster.run_on_ray`: an actor per device), as
    `runner` says ("local" unless `on(runner)` made it otherwise)."""

    way = "unrolled"

    def __init__(
        self,
        spec: GenerationSpec,
        compiled: CompiledDevices,
        planning_seconds: float,
        planning: Planning | None = None,
        runner: str = "local",
    ):
        self.spec = spec
        self.compiled = compiled
        self.planning_seconds = planning_seconds
        self.planning = Planning(devices=compiled.devices) if planning is None else planning
        self.runner = _check_runner("DevicesPlan", runner)

    def on(self, runner: str) -> DevicesPlan:
        """The same plan, run on `runner` (`einpage.pipeline.RUNNERS`: "local" or "ray")."""
        return DevicesPlan(self.spec, self.compiled, self.planning_seconds, self.planning, runner)

    @property
    def devices(self) -> int:
        return self.compiled.devices

    @property
    def budgets(self) -> tuple[BudgetReading, ...]:
        """Each device's budget, as read against that device's graph."""
        return self.compiled.budgets

    @property
    def budget(self) -> str:
        """The budgets, one line: "device 0: ...; device 1: ..." (each read against its
        own device's graph)."""
        return budgets_line(self.budgets)

    @property
    def plan(self) -> MultiPlan:
        return self.compiled.plan

    @property
    def plans(self) -> dict[str, CompiledDevices]:
        """Every plan by name (one here: the placed plan, a MemGraph per device)."""
        return {"unrolled": self.compiled}

    @property
    def device_plans(self) -> list[MemGraph]:
        """Each device's MemGraph, by device."""
        return [p.mg for p in self.plan.plans]

    def __repr__(self) -> str:
        nodes = sum(len(mg) for mg in self.device_plans)
        return (
            f"<DevicesPlan {self.compiled.program.name!r}: {self.devices} devices, "
            f"{len(self.plan.links)} links, {nodes} nodes, runner {self.runner!r}>"
        )

    def host_bytes(self, backend: runtime.Backend) -> int:
        """Host memory a run on `backend` allocates besides the weights it is given: each
        device's session (its host buffer and, on NumPy, its arena: `UnrolledPlan`'s
        count, per device) and the inputs once."""
        sessions = sum(_session_host_bytes([mg], backend) for mg in self.device_plans)
        return sessions + _input_bytes(self.spec, self.compiled.program)

    def stats(self, cost_model: str | CostModel | None = None) -> GenerationStats:
        """What the plan costs on `cost_model` (by default the one it was planned for):
        every device simulated together (`memgraph.simulate_multi`, links included), the
        transfers of every device summed (`GenerationStats.devices` says how)."""
        cost_model = self.planning.cost_model if cost_model is None else cost_model
        seconds, transfers = _placed_cost(self.compiled, cost_model)
        tasks, nodes = _placed_size(self.compiled)
        return GenerationStats(
            way=self.way,
            tokens=self.spec.tokens,
            planning_seconds=self.planning_seconds,
            simulated_seconds=seconds,
            cost_model=cost_model,
            transfers=transfers,
            plans=1,
            tasks=tasks,
            nodes=nodes,
            devices=self.devices,
        )

    def device_stats(self, cost_model: str | CostModel | None = None) -> list[DeviceStats]:
        """Each device's share (`DeviceStats`), simulated on `cost_model` (by default the
        one it was planned for), all devices together; `stats` is their sum (and the
        makespan, the largest `finish_seconds`)."""
        cost_model = self.planning.cost_model if cost_model is None else cost_model
        sim = self.compiled.simulate(cost_model)
        links = self.plan.links
        return [
            DeviceStats(
                device=p.device,
                budget=p.budget,
                peak_bytes=p.mg.stats.peak_bytes,
                transfers=Transfers.of(p.mg),
                finish_seconds=sim.per_device[p.device].makespan,
                tasks=len(p.mg.taskgraph),
                nodes=len(p.mg),
                received_bytes=sum(k.nbytes for k in links if k.target == p.device),
                sent_bytes=sum(k.nbytes for k in links if k.source == p.device),
            )
            for p in self.plan.plans
        ]

    def run(
        self,
        weights: Mapping[str, np.ndarray],
        tokens: Any,
        *,
        seed: int | None = None,
        backend: Any = "numpy",
        mode: str | None = None,
        run_seed: int = 0,
        timeout: float | None = None,
    ) -> GenerationOutput:
        """Generate from the prompt `tokens` with the program's `weights` on every
        device, on `self.runner`; arguments as `UnrolledPlan.run`. `backend` is each
        device's, by name; `mode` None or "sequential" runs each device's ready nodes in
        insertion order, "random" in a random order (`run_seed`); "streams" is not built
        for several devices. `timeout`: the most seconds a device waits for a link (the
        runner's default when None). The output has no run reports (the runners return
        the outputs only)."""
        options = _devices_run_options(self.devices, backend, mode, run_seed, timeout)
        spec = self.spec
        ids = _check_prompt(spec, tokens)
        inputs = generation_inputs(
            spec.family, spec.cfg, ids, spec.new_tokens, spec.dtype, weights, spec.gumbel(seed),
            spec.lengths,
        )  # fmt: skip
        out = self.compiled.run(inputs, runner=self.runner, **options)
        return GenerationOutput(out["ids"], out.get("logits"), ())


class _HostPages:
    """The KV cache in host memory between step plans: per layer, K and V pages
    [batch, kv heads, page_size, head_dim], zero where not yet written, by (layer, part,
    page). Which tensor of a plan is which is read from its facts
    (`taskgraph.facts.KVEntries` for the keys and values a plan returns, `KVPage` for
    the pages a decode plan reads), never from names."""

    def __init__(self, spec: GenerationSpec, head_shape: tuple[int, ...], pages: int):
        self.page_size = spec.page_size
        shape = (*head_shape[:-2], spec.page_size, head_shape[-1])
        self.pages = {
            (i, part, j): np.zeros(shape, spec.dtype)
            for i in range(spec.cfg.num_layers)
            for part in "kv"
            for j in range(pages)
        }

    def write(self, tg: TaskGraph, out: Mapping[str, np.ndarray], start: int) -> set[int]:
        """Copy the keys and values [..., n, e] that the plan of `tg` returned in `out`
        (its outputs stating `KVEntries`) into the positions from `start`; returns the
        pages written."""
        touched: set[int] = set()
        for name, task_id in tg.outputs.items():
            entries = fact_of(tg[task_id], KVEntries)
            if entries is None:
                continue
            values = out[name]
            for offset in range(values.shape[-2]):
                page, slot = divmod(start + offset, self.page_size)
                self.pages[entries.layer, entries.part, page][..., slot, :] = values[..., offset, :]
                touched.add(page)
        return touched

    def inputs(self, tg: TaskGraph, pages: Iterator[int] | range | set[int]) -> dict[str, Any]:
        """The page inputs of `tg` (those stating `KVPage`) whose page is numbered in
        `pages`, by input name, every layer."""
        wanted = set(pages)
        found = {}
        for name, task_id in tg.inputs.items():
            page = fact_of(tg[task_id], KVPage)
            if page is not None and page.page in wanted:
                found[name] = self.pages[page.layer, page.part, page.page]
        return found

    @staticmethod
    def page_numbers(tg: TaskGraph, pages: range) -> dict[str, int]:
        """The page inputs of `tg` whose page is numbered in `pages`: each name's page
        number (plans may name one page differently: only facts say which it is)."""
        found = {}
        for name, task_id in tg.inputs.items():
            page = fact_of(tg[task_id], KVPage)
            if page is not None and page.page in pages:
                found[name] = page.page
        return found


def _kv_entries(tg: TaskGraph) -> list[int]:
    """The outputs of `tg` that hand keys or values to the step loop (`KVEntries`)."""
    return [i for i in tg.outputs.values() if fact_of(tg[i], KVEntries)]


@dataclass(frozen=True)
class Chunk:
    """Decode steps `first` .. `first + steps - 1` (1-based after the prefill's token),
    run by one plan: `length` cache positions when it starts, `pages` in its bucket."""

    first: int
    steps: int
    length: int
    pages: int

    @property
    def key(self) -> tuple[int, int]:
        """The plan it needs: (pages, steps)."""
        return self.pages, self.steps

    @property
    def name(self) -> str:
        """ "decode (pages P)", or "decode (pages P, steps S)" for a chunk of steps."""
        return decode_name(*self.key)


def _ceil(a: int, b: int) -> int:
    return -(-a // b)


def decode_name(pages: int, steps: int) -> str:
    return f"decode (pages {pages})" if steps == 1 else f"decode (pages {pages}, steps {steps})"


def chunks_of(spec: GenerationSpec, bucket_pages: int, chunk_steps: int) -> list[Chunk]:
    """The decode steps of `spec` cut into chunks of `chunk_steps` (the last may be
    shorter), each served by the bucket of its first step's cache length: that length's
    pages, rounded up to a multiple of `bucket_pages` (the chunk's own new positions are
    computed in the plan, not read from pages)."""
    chunks = []
    for first in range(1, spec.new_tokens, chunk_steps):
        length = spec.prompt_len + first - 1
        pages = _ceil(_ceil(length, spec.page_size), bucket_pages) * bucket_pages
        steps = min(chunk_steps, spec.new_tokens - first)
        chunks.append(Chunk(first, steps, length, pages))
    return chunks


class StepPlans:
    """A prefill plan and decode plans reused across steps (module docstring): one per
    (length bucket, chunk size), keyed `(pages, steps)` in `decoders`; `chunks` says
    which decode steps each run covers."""

    way = "steps"

    def __init__(
        self,
        spec: GenerationSpec,
        prefill: Compiled,
        decoders: Mapping[tuple[int, int], Compiled],
        chunks: list[Chunk],
        planning_seconds: float,
        planning: Planning | None = None,
    ):
        self.spec = spec
        self.prefill = prefill
        self.decoders = dict(decoders)
        self.chunks = list(chunks)
        self.planning_seconds = planning_seconds
        self.planning = Planning(way="steps") if planning is None else planning

    def __repr__(self) -> str:
        return f"<StepPlans {self.spec.cfg.name!r}: prefill + {sorted(self.decoders)}>"

    @property
    def budget(self) -> BudgetReading:
        """How the budget every step plan shares was read (`read_generation_budget`)."""
        return self.prefill.budget

    @property
    def plans(self) -> dict[str, Compiled]:
        """Every plan by name: "prefill", then "decode (pages P[, steps S])"."""
        named = {"prefill": self.prefill}
        named.update({decode_name(*key): c for key, c in sorted(self.decoders.items())})
        return named

    def host_bytes(self, backend: runtime.Backend) -> int:
        """Host memory a run on `backend` allocates besides the weights it is given: its
        one session over every plan (host buffer, bookkeeping, NumPy's arena), the KV pages
        kept in host memory between plans, and the inputs (as `UnrolledPlan.host_bytes`)."""
        plans = [self.prefill, *self.decoders.values()]
        inputs = max(_input_bytes(self.spec, c.program) for c in plans)
        return self._sessions_bytes(backend) + self._cache_pages() * self._page_bytes() + inputs

    def _sessions_bytes(self, backend: runtime.Backend) -> int:
        """Host memory of the session(s) that run the plans: one over every plan."""
        return _session_host_bytes(list(self.session_plans.values()), backend)

    def serving(self, chunks: Sequence[Chunk]) -> StepPlans:
        """The same plans serving only `chunks` (the stats of a loop that ended early)."""
        shorter = copy.copy(self)
        shorter.chunks = list(chunks)
        return shorter

    @property
    def devices(self) -> int:
        """The devices the plans run on: one."""
        return 1

    @property
    def session_plans(self) -> dict[Any, MemGraph]:
        """The plans one `runtime.Session` runs the generation with: "prefill", then each
        decode plan by its key `(pages, steps)`."""
        return {"prefill": self.prefill.plan, **{k: c.plan for k, c in self.decoders.items()}}

    def _cache_pages(self) -> int:
        """Pages per layer and part (K or V) the host cache holds (`run`)."""
        needed = _ceil(self.spec.prompt_len + self.spec.new_tokens, self.spec.page_size)
        return max([needed, *(c.pages for c in self.chunks)])

    def _page_bytes(self) -> int:
        """Bytes of every layer's K and V page of one page index."""
        tg = self.prefill.program
        head = tg[_kv_entries(tg)[0]]  # [batch, kv heads, prompt_len, head_dim]
        per_page = head.nbytes // head.shape[-2] * self.spec.page_size
        return 2 * self.spec.cfg.num_layers * per_page

    def stats(self, cost_model: str | CostModel | None = None) -> GenerationStats:
        """The prefill's cost plus each chunk's, by its plan, on `cost_model` (by default
        the one it was planned for)."""
        cost_model = self.planning.cost_model if cost_model is None else cost_model
        seconds, transfers = self._cost(self.prefill, cost_model)
        per_plan = {key: self._cost(c, cost_model) for key, c in self.decoders.items()}
        for chunk in self.chunks:
            chunk_seconds, chunk_transfers = per_plan[chunk.key]
            seconds += chunk_seconds
            transfers = transfers + chunk_transfers
        sizes = [self._size(c) for c in (self.prefill, *self.decoders.values())]
        return GenerationStats(
            way=self.way,
            tokens=self.spec.tokens,
            planning_seconds=self.planning_seconds,
            simulated_seconds=seconds,
            cost_model=cost_model,
            transfers=transfers,
            plans=len(sizes),
            tasks=sum(tasks for tasks, _ in sizes),
            nodes=sum(nodes for _, nodes in sizes),
            devices=self.devices,
        )

    @staticmethod
    def _cost(compiled: Compiled, cost_model: str | CostModel) -> tuple[float, Transfers]:
        """One run of a plan: its simulated seconds and its transfers."""
        return _simulate(compiled.plan, cost_model), Transfers.of(compiled.plan)

    @staticmethod
    def _size(compiled: Compiled) -> tuple[int, int]:
        """A plan's tasks and MemGraph nodes."""
        return len(compiled.graph), len(compiled.plan)

    def run(
        self,
        weights: Mapping[str, np.ndarray],
        tokens: Any,
        *,
        seed: int | None = None,
        backend: Any = "numpy",
        mode: str | None = None,
        run_seed: int = 0,
        until: Callable[[np.ndarray], bool] | None = None,
    ) -> GenerationOutput:
        """Generate with the step loop (module docstring): one session over every plan,
        the weights and position tables staged once; arguments as `UnrolledPlan.run`.
        `until(new_ids)`, called with the new ids [batch, n] so far after the prefill and
        after each chunk, ends the loop early when it returns True (every sequence has
        stopped: `einpage.workloads.stop`); the output then has the ids made so far."""

        def one_session() -> _SessionSteps:
            return _SessionSteps(runtime.Session(self.session_plans, backend, mode=mode))

        return _step_loop(self, one_session, weights, tokens, seed, run_seed, until)


class _SessionSteps:
    """The step loop's runs on one device: each a run of one `runtime.Session` over every
    plan (its reports kept); closed with the loop."""

    def __init__(self, session: runtime.Session):
        self.session = session
        self.reports: list[Any] = []

    def __enter__(self) -> _SessionSteps:
        return self

    def __exit__(self, *exc: object) -> None:
        self.session.close()

    def stage(self, arrays: Mapping[str, Any]) -> None:
        self.session.stage(arrays)

    def run(self, inputs: Mapping[str, Any], plan: Any, seed: int) -> dict[str, np.ndarray]:
        out = self.session.run(inputs, plan=plan, seed=seed)
        self.reports.append(self.session.last)
        return out


class _DevicesSteps:
    """The step loop's runs on several devices: each a run of every device's share of
    one plan (`runtime.multi.LocalDevices` or `runtime.ray_cluster.RayDevices`: a
    session per device over its share of every plan, kept across steps); its runners
    report no sessions. `seed` orders nothing here: each device's order was seeded when
    the devices were made."""

    def __init__(self, devices: Any):
        self.devices = devices
        self.reports: list[Any] = []

    def __enter__(self) -> _DevicesSteps:
        return self

    def __exit__(self, *exc: object) -> None:
        self.devices.close()

    def stage(self, arrays: Mapping[str, Any]) -> None:
        self.devices.stage(arrays)

    def run(self, inputs: Mapping[str, Any], plan: Any, seed: int) -> dict[str, np.ndarray]:
        return self.devices.run(inputs, plan=plan)


def _step_loop(
    plans: StepPlans,
    open_steps: Callable[[], _SessionSteps | _DevicesSteps],
    weights: Mapping[str, np.ndarray],
    tokens: Any,
    seed: int | None,
    run_seed: int,
    until: Callable[[np.ndarray], bool] | None,
) -> GenerationOutput:
    """The step loop of `plans` (one device's or several's: `StepPlans.run`), each run
    made by what `open_steps()` opens (`stage(arrays)` once for every plan, `run(inputs,
    plan, seed)` -> the plan's original outputs): the prefill, then each chunk's decode
    plan, the KV pages kept in host memory between runs (`_HostPages`: written from the
    outputs stating `KVEntries`, read by the page inputs stating `KVPage`); a page is
    staged when a plan first needs it and again only after a run wrote it."""
    spec = plans.spec
    ids = _check_prompt(spec, tokens)
    gumbel = spec.gumbel(seed)
    first = None if gumbel is None else gumbel[:1]
    prompt = generation_inputs(spec.family, spec.cfg, ids, 1, spec.dtype, None, first, spec.lengths)
    positions = spec.family.position_inputs(spec.cfg, spec.positions, spec.dtype)
    prefill = plans.prefill.program
    with open_steps() as steps:
        steps.stage(weights)
        out = steps.run(prompt, "prefill", run_seed)
        cache = _HostPages(spec, prefill[_kv_entries(prefill)[0]].shape, plans._cache_pages())
        cache.write(prefill, out, 0)
        chosen = [out["ids"]]
        logits = [out["logits"]] if spec.logits else []
        if plans.chunks:
            steps.stage(positions)  # the decode plans' tables, for every position
        staged: dict[str, int] = {}  # page inputs staged current: their page
        for chunk in plans.chunks:
            if until is not None and until(np.concatenate(chosen, axis=1)):
                break
            tg = plans.decoders[chunk.key].program
            pages = cache.page_numbers(tg, range(chunk.pages))
            fresh = {name: page for name, page in pages.items() if name not in staged}
            steps.stage(cache.inputs(tg, set(fresh.values())))
            staged |= fresh
            step = decode_inputs(
                chosen[-1][:, -1], chunk.length, chunk.pages, spec.page_size, spec.dtype,
                chunk.steps, spec.pads,
            )  # fmt: skip
            if gumbel is not None:
                step["gumbel"] = gumbel[chunk.first : chunk.first + chunk.steps]
            out = steps.run(step, chunk.key, run_seed + chunk.first)
            touched = cache.write(tg, out, chunk.length)  # staged again when next read
            staged = {name: page for name, page in staged.items() if page not in touched}
            chosen.append(out["ids"])
            if spec.logits:
                logits.append(out["logits"])
    ids_out = np.concatenate(chosen, axis=1)
    logits_out = np.concatenate(logits, axis=1) if spec.logits else None
    return GenerationOutput(ids_out, logits_out, tuple(steps.reports))


class DevicesStepPlans(StepPlans):
    """Step plans placed on several devices (`Planning(way="steps", devices=N)`): the
    prefill and each decode plan (`prefill`, `decoders`: `einpage.compile_devices`'s
    results, each program placed by pipeline, a plan per device under its own budget,
    the links between them, verified as a whole), the weights on the same devices in
    every plan (`_plan_devices` checks it). The step loop is `StepPlans`'s: each device
    holds one session over its share of every plan (weights and position tables staged
    once per device, only those its graphs read), each step runs dependency-driven
    across the devices with its links, and the KV pages live in host memory between
    steps, each page staged on the device whose graph reads it (its layer's). It runs in
    one process (`runtime.multi.LocalDevices`: a thread and an arena per device) or on
    Ray (`runtime.ray_cluster.RayDevices`: an actor per device holding every plan's
    share, reused across steps), as `runner` says ("local" unless `on(runner)` made it
    otherwise)."""

    def __init__(
        self,
        spec: GenerationSpec,
        prefill: CompiledDevices,
        decoders: Mapping[tuple[int, int], CompiledDevices],
        chunks: list[Chunk],
        planning_seconds: float,
        planning: Planning | None = None,
        runner: str = "local",
    ):
        if planning is None:
            planning = Planning(way="steps", devices=prefill.devices)
        super().__init__(spec, prefill, decoders, chunks, planning_seconds, planning)
        self.runner = _check_runner("DevicesStepPlans", runner)

    def on(self, runner: str) -> DevicesStepPlans:
        """The same plans, run on `runner` (`einpage.pipeline.RUNNERS`: "local" or "ray")."""
        return DevicesStepPlans(
            self.spec, self.prefill, self.decoders, self.chunks, self.planning_seconds,
            self.planning, runner,
        )  # fmt: skip

    @property
    def devices(self) -> int:
        return self.prefill.devices

    @property
    def budgets(self) -> dict[str, tuple[BudgetReading, ...]]:
        """Each plan's budgets by plan name (`plans`), one per device, as read against
        that device's graph of that plan."""
        return {name: c.budgets for name, c in self.plans.items()}

    @property
    def budget(self) -> str:
        """The budgets, one line: each plan's, "device 0: ...; device 1: ..."."""
        return " | ".join(
            f"{name}: {budgets_line(readings)}" for name, readings in self.budgets.items()
        )

    @property
    def session_plans(self) -> dict[Any, MultiPlan]:
        """The plans each device's session holds its share of: "prefill", then each
        decode plan by its key `(pages, steps)`."""
        return {"prefill": self.prefill.plan, **{k: c.plan for k, c in self.decoders.items()}}

    def __repr__(self) -> str:
        links = sum(len(mp.links) for mp in self.session_plans.values())
        return (
            f"<DevicesStepPlans {self.spec.cfg.name!r}: prefill + {sorted(self.decoders)} on "
            f"{self.devices} devices, {links} links, runner {self.runner!r}>"
        )

    def _sessions_bytes(self, backend: runtime.Backend) -> int:
        """Each device's session over its share of every plan (`StepPlans`'s count, per
        device)."""
        plans = list(self.session_plans.values())
        return sum(
            _session_host_bytes([mp.plans[d].mg for mp in plans], backend)
            for d in range(self.devices)
        )

    _cost = staticmethod(_placed_cost)  # one run: all devices simulated together
    _size = staticmethod(_placed_size)

    def device_stats(self, cost_model: str | CostModel | None = None) -> list[DeviceStats]:
        """Each device's share (`DeviceStats`) of the whole loop, simulated on
        `cost_model` (by default the one it was planned for): per device, the largest
        budget and peak of its plans, its tasks and nodes in every plan, and over the
        runs (the prefill, then each chunk's plan) its transfers and links' bytes summed;
        each run starts when the one before has ended on every device, so a device's
        `finish_seconds` is the makespans of the runs before the last plus its own end
        in the last (the largest is `stats().simulated_seconds`)."""
        cost_model = self.planning.cost_model if cost_model is None else cost_model
        keyed = {"prefill": self.prefill, **self.decoders}
        sims = {key: c.simulate(cost_model) for key, c in keyed.items()}
        runs = ["prefill", *(chunk.key for chunk in self.chunks)]
        before = sum(sims[key].makespan for key in runs[:-1])
        stats = []
        for d in range(self.devices):
            shares = [keyed[key].plan.plans[d] for key in keyed]
            transfers = Transfers()
            received = sent = 0
            for key in runs:
                mp = keyed[key].plan
                transfers = transfers + Transfers.of(mp.plans[d].mg)
                received += sum(k.nbytes for k in mp.links if k.target == d)
                sent += sum(k.nbytes for k in mp.links if k.source == d)
            stats.append(
                DeviceStats(
                    device=d,
                    budget=max(p.budget for p in shares),
                    peak_bytes=max(p.mg.stats.peak_bytes for p in shares),
                    transfers=transfers,
                    finish_seconds=before + sims[runs[-1]].per_device[d].makespan,
                    tasks=sum(len(p.mg.taskgraph) for p in shares),
                    nodes=sum(len(p.mg) for p in shares),
                    received_bytes=received,
                    sent_bytes=sent,
                )
            )
        return stats

    def run(
        self,
        weights: Mapping[str, np.ndarray],
        tokens: Any,
        *,
        seed: int | None = None,
        backend: Any = "numpy",
        mode: str | None = None,
        run_seed: int = 0,
        until: Callable[[np.ndarray], bool] | None = None,
        timeout: float | None = None,
    ) -> GenerationOutput:
        """Generate with the step loop on every device, on `self.runner`; arguments as
        `StepPlans.run`, `backend`, `mode` and `timeout` as `DevicesPlan.run` takes them
        (`run_seed` orders a random-mode run on each device, the same for every step).
        The output has no run reports (the runners return the outputs only)."""
        options = _devices_run_options(self.devices, backend, mode, run_seed, timeout)

        def devices() -> _DevicesSteps:
            driver = runtime.RayDevices if self.runner == "ray" else runtime.LocalDevices
            return _DevicesSteps(driver(self.session_plans, **options))

        return _step_loop(self, devices, weights, tokens, seed, run_seed, until)


ON_DEVICES = (DevicesPlan, DevicesStepPlans)
"""The plans of a generation placed on several devices (`Planning(devices=N)`): each has
`devices`, `runner` and `on(runner)`."""


def _devices_run_options(
    devices: int, backend: Any, mode: str | None, run_seed: int, timeout: float | None
) -> dict[str, Any]:
    """The keywords each device's runner gets (`runtime.multi.run_devices`,
    `LocalDevices`, `RayDevices`): its backend by name, its order by `mode`
    (`RUNNERS_ORDER`; `DevicesNotBuiltError` for "streams"), the random order's seed,
    and the timeout when given."""
    if mode not in RUNNERS_ORDER:
        raise DevicesNotBuiltError(
            f"mode {mode!r} is not built for a generation on {devices} devices; "
            f"each device runs its nodes one at a time: mode None, 'sequential' or "
            "'random'"
        )
    if not isinstance(backend, str):
        raise GenerationError(
            f"a generation on {devices} devices takes its backend by name (each "
            f"device makes its own), got {type(backend).__name__}"
        )
    options: dict[str, Any] = {"backend": backend, "order": RUNNERS_ORDER[mode]}
    if mode == "random":
        options["seed"] = run_seed
    if timeout is not None:
        options["timeout"] = timeout
    return options


def plan_generation(
    spec: GenerationSpec,
    budget: int | str,
    planning: Planning | None = None,
    **moved: Any,
) -> UnrolledPlan | StepPlans | DevicesPlan | DevicesStepPlans:
    """Plan `spec`'s generation within `budget` as `planning` says (default `Planning()`):
    "unrolled" (one plan) or "steps" (a prefill plan and decode plans of `chunk_steps`
    steps per bucket of `bucket_pages` pages), each compiled by `einpage.compile` with
    `planning.compile_options()`; with `planning.devices` > 1, each program placed on
    that many devices (`DevicesPlan` or `DevicesStepPlans`, `_plan_devices`: the budget
    read per device). A percentage is read by `read_generation_budget` (the
    plan's `budget` says how). Raises `GenerationBudgetError` (naming the step and the
    task) when the budget is too small; `GenerationError` for a keyword of the old
    signature (way=, chunk_steps=, eviction=, ...), saying where it went."""
    moved_keywords("plan_generation", moved, planning_homes(""), "spec, budget, planning")
    if planning is None:
        planning = Planning()
    elif not isinstance(planning, Planning):
        hint = f": Planning(way={planning!r})" if isinstance(planning, str) else ""
        raise GenerationError(
            f"plan_generation takes a Planning after the budget, got {planning!r}{hint}"
        )
    started = time.perf_counter()
    if planning.devices > 1:
        return _plan_devices(spec, budget, planning, started)
    if isinstance(budget, Sequence) and not isinstance(budget, str):
        raise GenerationError(
            f"a budget per device ({len(budget)} given) is for a generation on several "
            "devices: give one budget, or Planning(devices=N)"
        )
    if planning.way == "unrolled":
        programs = {"unrolled": spec.generation_program()}
        first_step: dict[str, str | None] = {"unrolled": None}
    else:
        chunks, programs, first_step, keys = _step_programs(spec, planning)
    graphs = {name: program.build() for name, program in programs.items()}
    reading = read_generation_budget(spec, graphs, budget, planning)
    options = planning.compile_options()
    if planning.checkpoint is not None:
        options["checkpoint"] = _checkpoint_places(spec, planning.checkpoint, graphs["unrolled"])
    seconds = time.perf_counter() - started
    compiled = {}
    for name, tg in graphs.items():
        compiled[name], plan_seconds = _compile(tg, reading, name, first_step[name], options)
        seconds += plan_seconds
    if planning.way == "unrolled":
        return UnrolledPlan(spec, compiled["unrolled"], seconds, planning)
    decoders = {key: compiled[name] for name, key in keys.items()}
    return StepPlans(spec, compiled["prefill"], decoders, chunks, seconds, planning)


def _checkpoint_places(
    spec: GenerationSpec, checkpoint: str | os.PathLike[str], tg: TaskGraph
) -> dict[str, Any]:
    """Where `tg`'s weights are in `checkpoint`, for its plan to read them in place
    (`checkpoint_places`); a quantized generation's weights are made on the host, so
    they are in no checkpoint (`GenerationError`)."""
    if spec.quant is not None:
        raise GenerationError(
            "Planning(checkpoint=...): the weights of a quantized generation are quantized "
            "on the host, so a plan cannot read them from the checkpoint; plan it without "
            "quant, or without a checkpoint (the weights then given to the run)"
        )
    return checkpoint_places(spec.cfg, checkpoint, tg)


def _step_programs(
    spec: GenerationSpec, planning: Planning
) -> tuple[list[Chunk], dict[str, Program], dict[str, str | None], dict[str, tuple[int, int]]]:
    """The programs of step plans: the chunks (`chunks_of`), the programs by plan name
    ("prefill", then one decode program per (bucket, chunk size)), the step each plan
    first serves (what a budget error names), and each decode plan's key."""
    chunks = chunks_of(spec, planning.bucket_pages, planning.chunk_steps)
    programs = {"prefill": spec.generation_program(1, cache_outputs=True)}
    first_step: dict[str, str | None] = {"prefill": "prefill"}
    keys: dict[str, tuple[int, int]] = {}
    for chunk in chunks:
        if chunk.name not in programs:
            programs[chunk.name] = spec.decode_program(chunk.pages, chunk.steps)
            first_step[chunk.name] = f"step {chunk.first}"
            keys[chunk.name] = chunk.key
    return chunks, programs, first_step, keys


def _plan_devices(
    spec: GenerationSpec, budget: Any, planning: Planning, started: float
) -> DevicesPlan | DevicesStepPlans:
    """Each program of the way `planning` says – the unrolled program, or the prefill
    and each decode program of step plans – placed on `planning.devices` devices
    (`compile_devices`, by `planning.strategy`), each device's budget `budget` read
    against its own graph of that program (a percentage is of that device's resident
    or streaming reference). A pipeline of more devices than the model has layers is
    refused (`GenerationError`); the placement's and the planner's errors pass through
    (`memgraph.multi.DeviceBudgetError` names the device and its smallest budget; for
    step plans, the plan too). Step plans whose weights land on other devices in one
    plan than in another are refused (`GenerationError`): each device stages its
    weights once for every plan."""
    layers = spec.cfg.num_layers
    if planning.strategy == "pipeline" and planning.devices > layers:
        raise GenerationError(
            f"a pipeline of {planning.devices} devices needs at least {planning.devices} "
            f"layers; {spec.cfg.name!r} has {layers}: use at most {layers} devices"
        )
    if planning.way == "unrolled":
        tg = spec.generation_program().build()
        seconds = time.perf_counter() - started
        compiled, plan_seconds = _compile_devices(tg, budget, planning, None)
        return DevicesPlan(spec, compiled, seconds + plan_seconds, planning)
    chunks, programs, _, keys = _step_programs(spec, planning)
    graphs = {name: program.build() for name, program in programs.items()}
    seconds = time.perf_counter() - started
    placed = {}
    for name, tg in graphs.items():
        placed[name], plan_seconds = _compile_devices(tg, budget, planning, name)
        seconds += plan_seconds
    _check_weight_devices(placed)
    decoders = {key: placed[name] for name, key in keys.items()}
    return DevicesStepPlans(spec, placed["prefill"], decoders, chunks, seconds, planning)


def _compile_devices(
    tg: TaskGraph, budget: Any, planning: Planning, plan: str | None
) -> tuple[CompiledDevices, float]:
    """`einpage.compile_devices` of `tg`, and its planning seconds; a device's budget
    error of step plan `plan` (None: the unrolled plan) says which plan it is."""
    try:
        compiled = compile_devices(tg, budget, planning.devices, **planning.devices_options())
    except DeviceBudgetError as err:
        if plan is None:
            raise
        raise DeviceBudgetError(
            f"the {plan} plan of {tg.name!r}: {err}", err.budget, err.needed, err.task, err.device
        ) from err
    return compiled, sum(s for stage, s in compiled.timings.items() if stage != "verifying")


def weight_devices(compiled: CompiledDevices) -> dict[str, tuple[int, ...]]:
    """Each weight of a placed plan (an input stating `role="weight"`) and the devices
    whose graphs read it."""
    found: dict[str, list[int]] = {}
    for part in compiled.plan.placed.parts:
        for name, task_id in part.tg.inputs.items():
            op = part.tg[task_id].op
            if isinstance(op, Input) and op.role == "weight":
                found.setdefault(name, []).append(part.device)
    return {name: tuple(devices) for name, devices in found.items()}


def _check_weight_devices(placed: Mapping[str, CompiledDevices]) -> None:
    """`GenerationError` unless every weight that two step plans read is on the same
    devices in both (the pipeline cuts every program's layers the same way; tensor
    parallelism puts a share of each sharded weight on every device)."""
    first_name, *others = placed
    first = weight_devices(placed[first_name])
    for name in others:
        for weight, devices in weight_devices(placed[name]).items():
            if weight in first and first[weight] != devices:
                raise GenerationError(
                    f"step plans on {placed[name].devices} devices place weight {weight!r} on "
                    f"device(s) {list(first[weight])} in the {first_name} plan but "
                    f"{list(devices)} in the {name} plan; each device stages its weights once "
                    "for every plan, so every plan must place them alike: plan the unrolled "
                    "way (Planning(way='unrolled', devices=N)) or on fewer devices"
                )


STEP_OPTIONS = {"outputs": "host"}
"""Planner options of step plans (what a step outputs goes to the host loop), unless
`Planning.options` gives them."""


def token_programs(spec: GenerationSpec) -> dict[str, Program]:
    """The programs of one token, whatever the way: "the prefill" (the prompt to the
    first token, its keys and values out, as a step loop's) and, with more than one new
    token, "the last decode step" (one step over the whole cache of the last token in
    pages of `page_size`, its pages in host memory). The generation's streaming minimum
    is the larger of theirs (`read_generation_budget`)."""
    programs = {"the prefill": spec.generation_program(1, cache_outputs=True)}
    if spec.new_tokens > 1:
        length = spec.prompt_len + spec.new_tokens - 2  # the cache the last step reads
        programs["the last decode step"] = spec.decode_program(_ceil(length, spec.page_size))
    return programs


def read_generation_budget(
    spec: GenerationSpec, graphs: Mapping[str, TaskGraph], budget: Any, planning: Planning
) -> Any:
    """The budget every plan of the generation shares: bytes or a size string as given;
    a percentage as a `BudgetReading` that names its reference point, one definition for
    both ways:

    * `"N%"` / `"N%resident"`: of the resident peak of the plans themselves – the
      unrolled plan's, or the largest step plan's (at 100% no plan moves anything);
    * `"N%streaming"`: of the generation's streaming minimum, that of one token – the
      larger of the prefill's and the last decode step's (`token_programs`), weights
      loaded just in time and dropped after use, planned as step plans are. An unrolled
      program's own streaming minimum would keep every weight (each is read again by
      the next step, so nothing drops it), nearly its resident peak; this one is the
      same for both ways, whatever `bucket_pages` and `chunk_steps`.

    `graphs` are the plans' programs by name, `planning` how they are planned (its
    planner options; a streaming minimum is read as step plans are planned). Raises
    `BudgetFormatError` for a malformed percentage."""
    match = PERCENT.match(budget) if isinstance(budget, str) else None
    if match is None:
        return budget  # bytes, a size string, or malformed: einpage.compile reads it
    streaming = (match.group(2).lower() or "resident") == "streaming"
    opts = planning.planner_options(planning.way == "steps" or streaming)
    if streaming:
        candidates = {name: p.build() for name, p in token_programs(spec).items()}
    else:
        candidates = {f"the {name} plan": tg for name, tg in graphs.items()}
    readings = {name: read_budget(tg, budget, opts) for name, tg in candidates.items()}
    name = max(readings, key=lambda n: readings[n].nbytes)
    reading = readings[name]
    return replace(reading, reference=f"{reading.reference} ({name}'s)")
