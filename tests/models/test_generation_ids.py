"""Where the chosen ids live in a generation's plans, as the README says: each step's
ids feed the next step's embedding gather where the choice wrote them, on the device,
never back from the host; ids leave the device only towards the `ids` output – a step
plan's output goes to the host loop, and an unrolled plan under pressure may offload a
step's ids (8 bytes a sequence) and reload them for the concat of the `ids` output.
Checked on every plan of a set: both ways, three families, greedy and top-k, budgets
from tight to resident."""

from __future__ import annotations

import itertools
from collections import Counter

from einpage.models import FAMILIES
from einpage.models.decode import Sampling
from einpage.models.errors import GenerationBudgetError
from einpage.workloads.generation import WAYS, GenerationSpec, Planning, plan_generation
from memgraph import NodeKind
from taskgraph.nodes import ArgReduce, Concat, Gather, View

BUDGETS = ("100%", "60%", "35%", "100%streaming", "120KiB", "90KiB")
SAMPLINGS = (None, Sampling(top_k=4))


def assembly_of_ids(tg) -> set[int]:
    """The tasks that only assemble the `ids` output: the Concats and Views from the
    output down to each step's ids."""
    found, todo = set(), [tg.outputs["ids"]]
    while todo:
        task = tg[todo.pop()]
        if isinstance(task.op, Concat | View) and task.id not in found:
            found.add(task.id)
            todo.extend(task.inputs)
    return found


def id_transfers(mg) -> Counter:
    """What each transfer of an id tensor (a step's choice) is for, and how the gathers
    read the ids: a Counter of ("gather", where its ids came from), ("offload", what),
    ("reload", who reads it then)."""
    tg = mg.taskgraph
    chosen = {t.id for t in tg if isinstance(t.op, ArgReduce)}
    outputs = {tg.storage_root(i) for i in tg.outputs.values()}
    assembly = assembly_of_ids(tg)
    seen: Counter = Counter()
    source: dict[int, str] = {}
    reloaded: set[int] = set()
    for node in mg.nodes:
        if node.kind is NodeKind.APPLY:
            task = tg[node.tensor]
            if isinstance(task.op, Gather):
                ids = tg.storage_root(task.inputs[1])
                if ids in chosen:
                    seen["gather", source[ids]] += 1
            if {tg.storage_root(i) for i in task.inputs} & reloaded:
                seen["reload", "ids output" if task.id in assembly else task.line()] += 1
            source[tg.storage_root(node.tensor)] = "device"
        elif node.kind is NodeKind.RELOAD and node.tensor in chosen:
            source[node.tensor] = "host"
            reloaded.add(node.tensor)
        elif node.kind is NodeKind.OFFLOAD and node.tensor in chosen:
            seen["offload", "output" if node.tensor in outputs else "room"] += 1
        elif node.kind is NodeKind.FREE and node.tensor in reloaded:
            reloaded.discard(node.tensor)
    return seen


def test_ids_reach_the_next_step_on_the_device_and_leave_only_for_the_output():
    totals = {way: Counter() for way in WAYS}
    plans = 0
    for name, sampling, budget, way in itertools.product(
        ("llama", "gpt2", "qwen2"), SAMPLINGS, BUDGETS, WAYS
    ):
        family = FAMILIES[name]
        spec = GenerationSpec(
            family, family.presets["tiny"], 2, 7, 5, page_size=4, sampling=sampling
        )
        try:
            plan = plan_generation(spec, budget, Planning(way=way))
        except GenerationBudgetError:
            continue
        for compiled in plan.plans.values():
            plans += 1
            totals[way] += id_transfers(compiled.plan)
    assert plans >= 60
    unrolled, steps = totals["unrolled"], totals["steps"]
    assert {key for key in unrolled + steps if key[0] == "gather"} == {("gather", "device")}
    assert set(steps) - {("gather", "device")} == {("offload", "output")}
    assert set(unrolled) <= {("gather", "device"), ("offload", "room"), ("reload", "ids output")}
    assert unrolled["offload", "room"] > 0  # under pressure, it happens (README: "may")
