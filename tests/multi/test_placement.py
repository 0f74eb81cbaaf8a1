"""Pipeline placement and the split (`memgraph.placement`): where each task goes, that the
weight groups are balanced and keep layers (`Layer` facts) whole, which inputs are
replicated, that links appear exactly where a computed tensor crosses devices, and that
the split graphs compute the original's outputs (the driver of `test_placement_driver`,
against `taskgraph.evaluate`) – on hand-made programs, random ones, LLaMA-tiny prefill
and a training step."""

from __future__ import annotations

import itertools
from dataclasses import replace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from strategies import einsum_programs, program_inputs
from test_placement_driver import assert_same_outputs, chain, llama_case, run_split

import einpage as ep
import taskgraph
from einpage.models import llama
from einpage.models.generation import generation_inputs
from einpage.program.optim import SGD
from einpage.workloads.training import training_graph, training_inputs
from einpage_core.errors import PlanError
from memgraph.placement import (
    REPLICATED,
    contiguous_groups,
    pipeline_placement,
    place,
    split,
    used_weights,
    weight_groups,
    weight_units,
)
from taskgraph.builder import GraphBuilder
from taskgraph.einsum import EinsumSpec
from taskgraph.expr import parse as parse_join
from taskgraph.facts import KVPage, Layer, Update, fact_of
from taskgraph.graph import TaskGraph
from taskgraph.nodes import Einsum, Input
from taskgraph.partition import partition


def best_contiguous_bound(sizes, groups):
    """The smallest largest-group sum over every cut of `sizes` into `groups` non-empty
    contiguous groups, by brute force."""
    best = None
    for cuts in itertools.combinations(range(1, len(sizes)), groups - 1):
        bounds = (0, *cuts, len(sizes))
        largest = max(sum(sizes[a:b]) for a, b in itertools.pairwise(bounds))
        best = largest if best is None else min(best, largest)
    return best


def crossings(tg, device_of):
    """(task, reading device) for each tensor placed on one device and read by a task
    placed on another, Views resolved to their bases (independent of `split`)."""
    found = set()
    for task in tg:
        device = device_of[task.id]
        if device == REPLICATED:
            continue
        for operand in task.inputs:
            root = tg.storage_root(operand)
            if device_of[root] not in (REPLICATED, device):
                found.add((root, device))
    return found


# -- hand-made programs ----------------------------------------------------------------


def test_each_weight_s_readers_go_to_its_device_and_the_rest_follows_its_operands():
    tg, _ = chain((16, 32, 8, 16))  # w0 1 KiB, w1 2 KiB, w2 1 KiB, w3 512 B
    device_of = pipeline_placement(tg, 2)
    groups = weight_groups(tg, 2)
    assert [[tg[w].op.name for w in g] for g in groups] == [["w0", "w1"], ["w2", "w3"]]
    device_of_weight = {w: g for g, group in enumerate(groups) for w in group}
    for task in tg:
        if isinstance(task.op, Input):
            assert device_of[task.id] == REPLICATED
            continue
        weights = [i for i in task.inputs if i in device_of_weight]
        if weights:  # a matmul: its weight's device
            assert device_of[task.id] == device_of_weight[weights[0]]
        else:  # tanh of the matmul before: the matmul's device
            assert device_of[task.id] == device_of[task.inputs[0]]
    placed = split(tg, device_of, 2)
    assert {(k.task, k.target) for k in placed.links} == crossings(tg, device_of)
    assert len(placed.links) == 1 and placed.outputs == {"y": (1, "y")}


@pytest.mark.parametrize(
    "sizes", [(4, 4, 4, 12), (1, 2, 3, 4, 5, 6, 7), (16, 1, 1, 1, 1, 16), (3, 3, 3, 3, 3, 3, 3)]
)
@pytest.mark.parametrize("devices", [1, 2, 3, 4])
def test_weight_groups_are_contiguous_cover_every_weight_and_have_the_smallest_largest_group(
    sizes, devices
):
    prog = ep.Program("groups")
    x = prog.input("x", (1, 4))
    for i, width in enumerate(sizes):
        prog.output(x @ prog.input(f"w{i}", (4, width), role="weight"), f"y{i}")
    tg = prog.build()
    groups = weight_groups(tg, devices)
    assert [w for g in groups for w in g] == used_weights(tg)  # contiguous, in order
    assert len(groups) == devices and all(groups)
    largest = max(sum(tg[w].nbytes for w in g) for g in groups)
    bytes_ = [tg[w].nbytes for w in used_weights(tg)]
    assert largest == best_contiguous_bound(bytes_, devices)


def test_weights_are_ordered_by_first_use_not_by_input_order():
    prog = ep.Program("order")
    x = prog.input("x", (2, 8))
    late = prog.input("late", (8, 8), role="weight")  # declared first, used second
    early = prog.input("early", (8, 8), role="weight")
    prog.output((x @ early) @ late, "y")
    tg = prog.build()
    assert [tg[w].op.name for w in used_weights(tg)] == ["early", "late"]
    device_of = pipeline_placement(tg, 2)
    assert device_of[tg.inputs["early"]] == device_of[tg.inputs["late"]] == REPLICATED
    placed = split(tg, device_of, 2)
    assert [list(p.tg.inputs) for p in placed.parts] == [["x", "early"], ["late", "recv:%3"]]


def test_inputs_and_fills_are_replicated_on_every_device_that_reads_them():
    """An activation input and a constant read on both devices are in both graphs, under
    their own names, and never linked; a weight is only where it is read."""
    prog = ep.Program("shared")
    x = prog.input("x", (4, 8))
    bias = prog.input("bias", (4, 8))
    w0 = prog.input("w0", (8, 8), role="weight")
    w1 = prog.input("w1", (8, 8), role="weight")
    half = prog.fill((4, 8), 0.5)
    h = prog.einsum("ij,jk,ik->ik", x, w0, bias, join="a * b + c") * half
    prog.output(prog.einsum("ij,jk,ik->ik", h, w1, bias, join="a * b + c") * half, "y")
    tg = prog.build()
    placed = place(tg, 2)
    names = [set(p.tg.inputs) for p in placed.parts]
    assert names == [{"x", "bias", "w0"}, {"bias", "w1", "recv:%" + str(placed.links[0].task)}]
    fills = [[t for t in p.tg if t.kind == "fill"] for p in placed.parts]
    assert [len(f) for f in fills] == [1, 1]
    assert all(tg[k.task].is_compute for k in placed.links)
    rng = np.random.default_rng(1)
    arrays = {n: rng.standard_normal(tg[i].shape).astype(np.float32) for n, i in tg.inputs.items()}
    assert_same_outputs(run_split(placed, arrays), taskgraph.evaluate(tg, arrays))


def test_a_view_of_another_device_s_tensor_is_made_where_it_is_read_from_its_linked_base():
    prog = ep.Program("view")
    x = prog.input("x", (4, 8))
    w0 = prog.input("w0", (8, 8), role="weight")
    w1 = prog.input("w1", (32, 2), role="weight")
    flat = (x @ w0).reshape(1, 32)
    prog.output(flat @ w1, "y")
    prog.output(flat, "flat")
    tg = prog.build()
    device_of = pipeline_placement(tg, 2)
    placed = split(tg, device_of, 2)
    (link,) = placed.links
    assert tg[link.task].kind == "einsum" and link.shape == (4, 8)
    assert [t.kind for t in placed.parts[1].tg] == ["input", "input", "view", "einsum"]
    assert placed.outputs == {"y": (1, "y"), "flat": (0, "flat")}
    arrays = {n: np.ones(tg[i].shape, np.float32) for n, i in tg.inputs.items()}
    assert_same_outputs(run_split(placed, arrays), taskgraph.evaluate(tg, arrays))


def test_the_split_keeps_scopes_labels_order_and_renumbered_facts():
    tg, arrays = llama_case(llama.PRESETS["tiny"])
    placed = place(tg, 2)
    for part in placed.parts:
        assert list(part.origin) == sorted(part.origin)
        for task, original in zip(part.tg, part.origin, strict=True):
            source = tg[original]
            assert (task.scope, task.label, task.shape, task.dtype) == (
                source.scope,
                source.label,
                source.shape,
                source.dtype,
            )
            if not isinstance(task.op, Input) or task.op == source.op:
                assert task.op == source.op and task.workspace == source.workspace
                assert [part.origin[i] for i in task.inputs] == list(source.inputs)
                assert len(task.facts) == len(source.facts)
                for fact, old in zip(task.facts, source.facts, strict=True):
                    assert [part.origin[r] for r in fact.refs()] == list(old.refs())


# -- errors ----------------------------------------------------------------------------


def test_more_devices_than_weights_is_refused_with_the_numbers():
    tg, _ = chain((16, 16, 16))
    with pytest.raises(PlanError, match="pipeline placement of 4 devices needs at least 4 "
                       "weights; this program has 3"):  # fmt: skip
        pipeline_placement(tg, 4)


def test_no_weights_on_several_devices_is_refused_and_one_device_holds_everything():
    prog = ep.Program("plain")
    x = prog.input("x", (4, 4))
    prog.output(ep.exp(x), "y")
    tg = prog.build()
    with pytest.raises(PlanError, match="2 devices needs weights.*reads none"):
        pipeline_placement(tg, 2)
    placed = place(tg, 1)
    assert len(placed.parts[0].tg) == len(tg) and not placed.links


@pytest.mark.parametrize("devices", [0, -1, 1.5, True, "2"])
def test_devices_must_be_a_positive_int(devices):
    tg, _ = chain()
    with pytest.raises(PlanError, match="devices must be an int >= 1"):
        pipeline_placement(tg, devices)


def test_split_refuses_bad_placements():
    tg, _ = chain()
    device_of = list(pipeline_placement(tg, 2))
    with pytest.raises(PlanError, match=f"names 3 devices for {len(tg)} tasks"):
        split(tg, device_of[:3], 2)
    with pytest.raises(PlanError, match="device 2 is not one of 0..1"):
        split(tg, [2 if d == 1 else d for d in device_of], 2)


# -- random programs -------------------------------------------------------------------


@st.composite
def weighted_programs(draw):
    """A random program (`einsum_programs`) whose inputs are mostly made weights (each
    with probability 3/4: the strategy's own roles rarely give several weights), and a
    number of devices its weights can fill (1 when it reads none)."""
    tg = draw(einsum_programs(max_tasks=20))
    tasks = tuple(
        replace(t, op=replace(t.op, role="weight"))
        if isinstance(t.op, Input) and draw(st.integers(0, 3))
        else t
        for t in tg
    )
    tg = TaskGraph(tasks, tg.outputs, tg.name)
    devices = draw(st.integers(1, max(1, min(4, len(used_weights(tg))))))
    return tg, devices


@st.composite
def layered_programs(draw, layers: bool = False):
    """2-4 random programs (`einsum_programs`, every input a weight) run one after the
    other, as a pipeline's stages: in each stage after the first, the first input is
    replaced by itself times tanh of the sum of the previous stage's output "out" (so
    the stage reads the one before), and the number of stages as the devices. Without
    `layers`, weights are grouped by bytes, not by stage, so the crossings fall
    anywhere; with it, stage i's weights state `Layer(i)`."""
    devices = draw(st.integers(2, 4))
    builder = GraphBuilder("layered")
    previous = None
    for stage in range(devices):
        tg = draw(einsum_programs(max_tasks=10))
        new: dict[int, int] = {}
        for task in tg:
            if not isinstance(task.op, Input):
                inputs = [new[i] for i in task.inputs]
                new[task.id] = builder.add(task.op, inputs, task.shape, task.dtype)
                continue
            op = replace(task.op, name=f"s{stage}.{task.op.name}", role="weight")
            facts = [Layer(stage)] if layers else []
            new[task.id] = builder.add(op, (), task.shape, task.dtype, facts=facts)
            if previous is not None and task.id == 0:
                letters = "abcdefgh"
                whole = letters[: len(builder.tasks[previous].shape)]
                total = builder.add(Einsum(EinsumSpec.parse(f"{whole}->")), [previous])
                mine = letters[: len(task.shape)]
                mix = Einsum(EinsumSpec.parse(f"{mine},->{mine}"), parse_join("a * tanh(b)", 2))
                new[task.id] = builder.add(mix, [new[task.id], total])
        for name, task_id in tg.outputs.items():
            builder.output(new[task_id], f"s{stage}.{name}")
        previous = new[tg.outputs["out"]]
    return builder.build(), devices


@settings(max_examples=30, deadline=None)
@given(case=st.one_of(weighted_programs(), layered_programs()), seed=st.integers(0, 2**16))
def test_random_programs_split_compute_the_original_outputs(case, seed):
    tg, devices = case
    device_of = pipeline_placement(tg, devices)
    placed = split(tg, device_of, devices)
    links = {(k.task, k.target) for k in placed.links}
    assert links == crossings(tg, device_of)
    for link in placed.links:
        assert link.source == device_of[link.task] != link.target
        assert (link.shape, link.dtype) == (tg[link.task].shape, tg[link.task].dtype)
    used = set(used_weights(tg))
    for part in placed.parts:  # weights appear only where a task reads them
        for name, i in part.tg.inputs.items():
            if part.tg[i].op.role == "weight" and part.origin[i] in used:
                assert part.tg.consumers[i], name
    arrays = program_inputs(tg, seed)
    want = taskgraph.evaluate(tg, arrays)
    assert_same_outputs(run_split(placed, arrays), want)


# -- models ----------------------------------------------------------------------------


@pytest.mark.parametrize("devices", [2, 3])
def test_llama_tiny_prefill_split_equals_the_unsplit_reference(devices):
    tg, arrays = llama_case(replace(llama.PRESETS["tiny"], num_layers=devices))
    placed = place(tg, devices)
    assert {link.source for link in placed.links} == set(range(devices - 1))
    for group in weight_groups(tg, devices):  # each device computes with its weights
        device = weight_groups(tg, devices).index(group)
        names = {tg[w].op.name for w in group}
        assert names <= set(placed.parts[device].tg.inputs)
    want = taskgraph.evaluate(tg, arrays)
    assert_same_outputs(run_split(placed, arrays, per_device=True), want)  # device by device
    assert_same_outputs(run_split(placed, arrays), want)


def test_llama_with_tied_embeddings_sends_the_last_hidden_state_back_to_the_first_device():
    """The logits read the embedding table (a weight of device 0): device 1 sends its
    hidden state back, so the devices wait for each other and only task-level dataflow
    runs the split."""
    cfg = replace(llama.PRESETS["tiny"], tie_embeddings=True)
    tg, arrays = llama_case(cfg)
    placed = place(tg, 2)
    assert {(k.source, k.target) for k in placed.links} == {(0, 1), (1, 0)}
    assert placed.outputs["logits"][0] == 0
    assert_same_outputs(run_split(placed, arrays), taskgraph.evaluate(tg, arrays))


def training_case(seed: int = 0):
    cfg = llama.PRESETS["tiny"]
    optimizer = SGD(lr=0.1, momentum=0.9)
    tg = training_graph(cfg, 2, 4, optimizer)
    rng = np.random.default_rng(seed)
    weights = {
        name: (rng.standard_normal(shape) * 0.2 + (len(shape) == 1)).astype(np.float32)
        for name, shape in llama.weight_shapes(cfg).items()
    }
    tokens, labels = rng.integers(0, cfg.vocab_size, (2, 2, 4))
    return tg, training_inputs(cfg, optimizer, tokens, labels, weights)


def test_a_training_step_split_on_two_devices_equals_the_unsplit_reference():
    tg, arrays = training_case()
    placed = place(tg, 2)
    directions = {(k.source, k.target) for k in placed.links}
    assert directions == {(0, 1), (1, 0)}  # forward to device 1, gradients back to 0
    updated = []
    for name, (device, local) in placed.outputs.items():  # each update with its weight
        update = fact_of(tg[tg.outputs[name]], Update)
        if update is not None and tg[update.of].op.role == "weight":
            part = placed.parts[device].tg
            assert tg[update.of].op.name in part.inputs
            moved = fact_of(part[part.outputs[local]], Update)
            assert part[moved.of].op == tg[update.of].op  # renumbered to the same weight
            updated.append(tg[update.of].op.name)
    assert sorted(updated) == sorted(llama.weight_shapes(llama.PRESETS["tiny"]))
    assert_same_outputs(run_split(placed, arrays), taskgraph.evaluate(tg, arrays))


def test_an_unrolled_generation_split_on_two_devices_chooses_the_same_ids():
    """Each step's chosen ids come back from the last device to the embedding's."""
    cfg = llama.PRESETS["tiny"]
    tg = llama.generation_program(cfg, 2, 5, 3).build()
    _, prefill = llama_case(cfg)
    weights = {n: a for n, a in prefill.items() if n in llama.weight_shapes(cfg)}
    tokens = np.random.default_rng(3).integers(0, cfg.vocab_size, (2, 5))
    arrays = generation_inputs(llama.FAMILY, cfg, tokens, 3, weights=weights)
    placed = place(tg, 2)
    assert {(k.source, k.target) for k in placed.links} == {(0, 1), (1, 0)}
    assert_same_outputs(run_split(placed, arrays), taskgraph.evaluate(tg, arrays))


def test_a_decode_step_keeps_each_kv_page_with_its_layer_s_device():
    """A KV page (an input stating `KVPage`) is in the graph of exactly one device: the
    one whose tasks read it, where its layer's attention runs."""
    cfg = llama.PRESETS["tiny"]
    tg = llama.decode_program(cfg, 2, 2).build()
    placed = place(tg, 2)
    device_of = pipeline_placement(tg, 2)
    pages = {i: fact_of(tg[i], KVPage) for i in tg.inputs.values() if fact_of(tg[i], KVPage)}
    assert len(pages) == 8
    layer_devices: dict[int, set[int]] = {}
    for page, fact in pages.items():
        holders = [p.device for p in placed.parts if tg[page].op.name in p.tg.inputs]
        readers = {device_of[t] for t in tg.consumers[page]}
        assert readers == set(holders) and len(holders) == 1
        layer_devices.setdefault(fact.layer, set()).update(holders)
    assert all(len(devices) == 1 for devices in layer_devices.values())
    arrays = program_inputs(tg, 5)
    arrays["tokens"] = np.array([1, 2])
    arrays["positions"] = np.array([3])
    assert_same_outputs(run_split(placed, arrays), taskgraph.evaluate(tg, arrays))


def test_a_partitioned_prefill_splits_with_its_blocks_and_slices_of_weights():
    """Block tasks keep their `Block`; a Slice of a weight goes with the weight."""
    tg, arrays = llama_case(llama.PRESETS["tiny"], seq=8)
    blocks = partition(tg, "24KiB")
    placed = place(blocks, 2)
    device_of = pipeline_placement(blocks, 2)
    groups = weight_groups(blocks, 2)
    weight_device = {w: g for g, group in enumerate(groups) for w in group}
    slices = [t for t in blocks if blocks.is_input_slice(t.id)]
    assert slices
    for task in slices:
        if task.inputs[0] in weight_device:
            assert device_of[task.id] == weight_device[task.inputs[0]]
    kept = sum(t.block is not None for part in placed.parts for t in part.tg)
    assert kept >= sum(t.block is not None and device_of[t.id] != REPLICATED for t in blocks)
    for part in placed.parts:
        for task, original in zip(part.tg, part.origin, strict=True):
            if not isinstance(task.op, Input):
                assert task.block == blocks[original].block
    assert_same_outputs(run_split(placed, arrays), taskgraph.evaluate(blocks, arrays))


@settings(max_examples=60, deadline=None)
@given(
    sizes=st.lists(st.integers(1, 1000), min_size=1, max_size=9),
    groups=st.integers(1, 9),
)
def test_contiguous_groups_have_the_smallest_largest_sum_of_any_cut(sizes, groups):
    if groups > len(sizes):
        with pytest.raises(PlanError, match=f"cannot cut {len(sizes)} items into {groups}"):
            contiguous_groups(sizes, groups)
        return
    lengths = contiguous_groups(sizes, groups)
    assert len(lengths) == groups and all(n >= 1 for n in lengths) and sum(lengths) == len(sizes)
    bounds = list(itertools.accumulate([0, *lengths]))
    largest = max(sum(sizes[a:b]) for a, b in itertools.pairwise(bounds))
    assert largest == best_contiguous_bound(sizes, groups)


# -- layers (`Layer` facts) ------------------------------------------------------------


def layer_of(tg, weight):
    """The layer index a weight states, or None (read from its `Layer` fact)."""
    fact = fact_of(tg[weight], Layer)
    return None if fact is None else fact.index


def check_layers_whole(tg, devices):
    """Every layer's weights – and every compute task reading one – on one device, the
    layers' devices in layer order; returns {layer: device}."""
    device_of = pipeline_placement(tg, devices)
    groups = weight_groups(tg, devices)
    assert [w for g in groups for w in g] == [w for u in weight_units(tg) for w in u]
    layer_device: dict[int, int] = {}
    for g, group in enumerate(groups):
        for w in group:
            layer = layer_of(tg, w)
            if layer is not None:
                assert layer_device.setdefault(layer, g) == g, (layer, g)
            for reader in tg.consumers[w]:
                if tg[reader].is_compute:
                    assert device_of[reader] == g
    order = [layer_device[i] for i in sorted(layer_device)]
    assert order == sorted(order)
    return layer_device


@pytest.mark.parametrize("layers, devices", [(2, 2), (3, 2), (3, 3), (4, 3)])
def test_llama_stages_hold_whole_layers_and_send_only_the_residual_stream(layers, devices):
    """Each layer's weights on one device and links only between layers: each is the
    hidden state [batch, seq, hidden] (nothing of a layer's inside, not even its norm's
    statistics of that hidden state); the split computes the reference's logits."""
    cfg = replace(llama.PRESETS["tiny"], num_layers=layers)
    tg, arrays = llama_case(cfg, batch=2, seq=5)
    layer_device = check_layers_whole(tg, devices)
    assert sorted(set(layer_device.values())) == list(range(devices))
    device_of = pipeline_placement(tg, devices)
    placed = split(tg, device_of, devices)
    assert {(k.task, k.target) for k in placed.links} == crossings(tg, device_of)
    assert placed.links and all(k.target == k.source + 1 for k in placed.links)
    for link in placed.links:
        assert (link.shape, link.dtype) == ((2, 5, cfg.hidden_size), "float32"), link.describe()
    assert_same_outputs(run_split(placed, arrays), taskgraph.evaluate(tg, arrays))


def test_gpt2_and_a_quantized_llama_keep_their_layers_whole_too():
    """GPT-2's layers, and an int4 LLaMA's (a weight's quantized inputs `.q`, `.scale`,
    `.min`, all stating its layer), each on one device; the links are hidden states.
    (The int4 layers weigh less than the float32 embedding table: device 0 holds it
    alone.)"""
    from einpage.models import gpt2
    from einpage.program.quantize import Quantization

    quant = Quantization(4, 32, minimum=True)
    cfg = llama.PRESETS["tiny"]
    cases = [
        (gpt2.prefill_program(gpt2.PRESETS["tiny"], 1, 4).build(), gpt2.PRESETS["tiny"]),
        (llama.prefill_program(cfg, 1, 4, quant=quant).build(), cfg),
    ]
    for tg, config in cases:
        assert check_layers_whole(tg, 2) == ({0: 1, 1: 1} if config is cfg else {0: 0, 1: 1})
        placed = place(tg, 2)
        assert {k.shape for k in placed.links} == {(1, 4, config.hidden_size)}, tg.name


def test_a_quantized_weight_s_inputs_are_one_unit_with_its_layer():
    from einpage.program.quantize import Quantization

    cfg = llama.PRESETS["tiny"]
    tg = llama.prefill_program(cfg, 1, 4, quant=Quantization(8, 32)).build()
    units = weight_units(tg)
    names = [[tg[w].op.name for w in unit] for unit in units]
    # the head's quantized inputs state no layer: each is a unit of its own
    assert names[0] == ["embed"] and names[-3:] == [["norm"], ["lm_head.q"], ["lm_head.scale"]]
    assert len(names) == 4 + cfg.num_layers
    for i, unit in enumerate(names[1:-3]):
        assert {f"layers.{i}.attn.wq.q", f"layers.{i}.attn.wq.scale"} <= set(unit)
        assert all(n.startswith(f"layers.{i}.") for n in unit)  # the names say it too


def test_units_are_cut_balanced_by_bytes_never_inside_a_layer():
    """Layers of 32 + 96, 96 + 32 and 64 + 64 bytes, and a head of 64 bytes and no layer:
    the best cut of single weights on two devices falls inside layer 1 (224 | 224
    bytes); the cut of units keeps layers whole (256 | 192), the best such cut."""
    prog = ep.Program("units")
    x = prog.input("x", (1, 4))
    widths = {0: (2, 6), 1: (6, 2), 2: (4, 4)}
    for layer, pair in widths.items():
        with prog.layer(layer):
            for k, n in enumerate(pair):
                prog.output(x @ prog.input(f"l{layer}.w{k}", (4, n), role="weight"), f"y{layer}{k}")
    prog.output(x @ prog.input("head", (4, 4), role="weight"), "head")
    tg = prog.build()
    units = weight_units(tg)
    assert [[tg[w].op.name for w in u] for u in units] == [
        ["l0.w0", "l0.w1"], ["l1.w0", "l1.w1"], ["l2.w0", "l2.w1"], ["head"],
    ]  # fmt: skip
    singles = [tg[w].nbytes for w in used_weights(tg)]
    assert contiguous_groups(singles, 2) == [3, 4]  # l1.w0 | l1.w1: what units prevent
    unit_bytes = [sum(tg[w].nbytes for w in u) for u in units]
    for devices in (2, 3):
        groups = weight_groups(tg, devices)
        assert len(groups) == devices
        assert [w for g in groups for w in g] == [w for u in units for w in u]
        for g in groups:  # every group a run of whole units
            assert any(set(g) == set(sum(units[a:b], ())) for a in range(4) for b in range(a, 5))
        largest = max(sum(tg[w].nbytes for w in g) for g in groups)
        assert largest == best_contiguous_bound(unit_bytes, devices)
    assert [[tg[w].op.name for w in g] for g in weight_groups(tg, 2)] == [
        ["l0.w0", "l0.w1", "l1.w0", "l1.w1"], ["l2.w0", "l2.w1", "head"],
    ]  # fmt: skip


def test_more_devices_than_layers_is_refused_with_both_numbers():
    tg, _ = llama_case(llama.PRESETS["tiny"])  # 2 layers
    for devices in (3, 8):
        message = f"pipeline placement of {devices} devices needs at least {devices} layers; "
        with pytest.raises(PlanError, match=message + "this program has 2"):
            pipeline_placement(tg, devices)
        with pytest.raises(PlanError, match="this program has 2. Use at most 2 devices"):
            place(tg, devices)
    assert len(place(tg, 2).parts) == 2


def test_a_weight_stating_two_layers_is_refused_naming_it():
    prog = ep.Program()
    x = prog.input("x", (2, 4))
    with prog.layer(0):
        w = prog.input("w", (4, 4), role="weight")
    prog.fact(w, Layer(1))
    prog.output(x @ w, "y")
    with pytest.raises(PlanError, match=r"weight 'w' \(%1\) states layers 0, 1"):
        weight_units(prog.build())


@settings(max_examples=25, deadline=None)
@given(case=layered_programs(layers=True), seed=st.integers(0, 2**16))
def test_random_layered_programs_keep_each_layer_on_one_device(case, seed):
    """Random stages whose weights state their stage as a layer: each layer whole on one
    device, in order; the links are the crossings and the split equals the reference."""
    tg, stages = case
    layers = {f.index for w in used_weights(tg) for f in tg[w].facts if isinstance(f, Layer)}
    devices = max(1, min(stages, len(layers)))
    check_layers_whole(tg, devices)
    device_of = pipeline_placement(tg, devices)
    placed = split(tg, device_of, devices)
    assert {(k.task, k.target) for k in placed.links} == crossings(tg, device_of)
    arrays = program_inputs(tg, seed)
    assert_same_outputs(run_split(placed, arrays), taskgraph.evaluate(tg, arrays))
