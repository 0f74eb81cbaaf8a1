"""Tensor-parallel placement (Megatron style): the `Shard` facts the models state, the split
(`taskgraph.partition.tensor_split`) and its `TensorPart` facts, the placement
(`memgraph.placement.tensor_placement`, `place(tg, devices, "tensor")`), and the workloads
placed so on 2 and 4 devices, planned at each device's smallest budget (offloads
forced), verified as a whole and run (`runtime.multi.run_devices`, and once on Ray)
equal to `taskgraph.evaluate` of the unsplit graph; random programs with Shard facts on
random weight axes likewise."""

from __future__ import annotations

from dataclasses import replace

import pytest
import workloads
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from strategies import program_inputs
from test_placement import layered_programs, weighted_programs
from test_placement_driver import chain

import einpage as ep
import taskgraph
from einpage.models import gpt2, llama
from einpage_core.errors import GraphError, PlanError
from memgraph import plan
from memgraph.multi import plan_devices, verify_multi
from memgraph.placement import REPLICATED, STRATEGIES, place, split, tensor_placement
from runtime.multi import run_devices
from taskgraph.facts import FACT_KINDS, Shard, TensorPart, fact_from_attributes, fact_of
from taskgraph.graph import TaskGraph
from taskgraph.nodes import Input, Slice
from taskgraph.partition import TensorSplitError, partition, tensor_split

ORDERS = [("ready", None), ("random", 5)]

WORKLOADS = {
    "llama-gqa2-prefill": lambda: workloads.llama_gqa_prefill(2),
    "llama-gqa4-prefill": lambda: workloads.llama_gqa_prefill(4),
    "gpt2-prefill": workloads.gpt2_prefill,
    "llama-generation": lambda: workloads.generation("llama"),
    "gpt2-generation": lambda: workloads.generation("gpt2"),
    "llama-decode": workloads.decode_step,
    "llama-training": workloads.training_step,
}
"""The workloads placed tensor parallel, by name (tiny configs: 2 or 4 KV groups, 4 heads
for GPT-2, MLP widths that 4 divides)."""


def run_everywhere(mp, inputs, want, rtol):
    """`mp` run in each order of `ORDERS`, each equal to `want`."""
    for order, seed in ORDERS:
        got = run_devices(mp, inputs, order=order, seed=seed, timeout=30)
        workloads.assert_close(got, want, rtol)


def check_parts_on_their_devices(placed):
    """Every task of the placed graph stating `TensorPart(d, n)` is computed on device d
    alone (n devices; a View, which moves nothing, is made wherever it is read), and a
    task stating none is replicated (each device that needs it computes it): only parts
    are sent, from their own device."""
    tg = placed.graph
    device_of = tensor_placement(tg, placed.devices)
    for task in tg:
        part = fact_of(task, TensorPart)
        holders = {p.device for p in placed.parts if task.id in _local(p)}
        if part is not None:
            assert part.count == placed.devices
            assert device_of[task.id] == part.index
            if not task.op.aliases_input:
                assert holders <= {part.index}, (task.line(), holders)
        else:
            assert device_of[task.id] == REPLICATED
    for link in placed.links:  # only parts are sent: a replicated tensor is made locally
        assert fact_of(tg[link.task], TensorPart).index == link.source


def _local(part):
    """The tasks of the placed graph that device `part` computes (not link inputs)."""
    return {
        origin
        for t, origin in zip(part.tg, part.origin, strict=True)
        if not (isinstance(t.op, Input) and t.op.name.startswith("recv:"))
    }


# -- the facts -------------------------------------------------------------------------


def test_the_models_state_shard_on_heads_and_mlp_columns_only():
    """LLaMA (and the families reusing it) and GPT-2 state `Shard(0)` on the weights of
    attention's heads (KV groups for LLaMA) and the MLP's columns; never on the
    embedding, the head or the norms. A generation states it once per weight."""
    cfg = replace(llama.PRESETS["tiny"], qkv_bias=True)
    want = {
        "llama": {"wq", "wk", "wv", "wo", "bq", "bk", "bv", "w_gate", "w_up", "w_down"},
        "gpt2": {"wq", "wk", "wv", "wo", "bq", "bk", "bv", "w_fc", "b_fc", "w_proj"},
    }
    for family, config in (("llama", cfg), ("gpt2", gpt2.PRESETS["tiny"])):
        module = {"llama": llama, "gpt2": gpt2}[family]
        for tg in (
            module.prefill_program(config, 1, 4).build(),
            module.generation_program(config, 1, 3, 2).build(),
        ):
            stated = {}
            for task in tg:
                shards = [f for f in task.facts if isinstance(f, Shard)]
                if shards:
                    assert isinstance(task.op, Input) and shards == [Shard(0)], task.line()
                    stated[task.op.name] = shards[0]
            names = {name.rsplit(".", 1)[1] for name in stated}
            assert names == want[family], family
            assert len(stated) == len(want[family]) * config.num_layers


def test_mistral_and_qwen2_state_shard_through_llama_s_layers():
    from einpage.models import mistral, qwen2

    for module, biases in ((mistral, set()), (qwen2, {"bq", "bk", "bv"})):
        tg = module.prefill_program(module.PRESETS["tiny"], 1, 4).build()
        names = {t.op.name.rsplit(".", 1)[1] for t in tg if fact_of(t, Shard)}
        assert names == {"wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down"} | biases


def test_a_quantized_weight_states_shard_on_its_rebuilt_float_tensor():
    from einpage.program.quantize import Quantization

    cfg = llama.PRESETS["tiny"]
    tg = llama.prefill_program(cfg, 1, 4, quant=Quantization(8, 32)).build()
    sharded = [t for t in tg if fact_of(t, Shard)]
    quantized = [t for t in sharded if not isinstance(t.op, Input)]
    assert quantized, "no rebuilt weight states Shard"
    for task in quantized:
        assert task.shape[0] in (cfg.num_kv_heads, cfg.intermediate_size), task.line()
    assert not any(fact_of(tg[i], Shard) for i in tg.inputs.values() if tg[i].dtype == "int8")


def test_shard_and_tensor_part_check_their_fields_and_round_trip_through_json():
    assert {"shard", "tensor_part"} <= set(FACT_KINDS)
    assert fact_from_attributes({"kind": "shard", "axis": 1}) == Shard(1)
    assert fact_from_attributes({"kind": "tensor_part", "index": 1, "count": 2}) == TensorPart(1, 2)
    for bad in (-1, True, "0", None):
        with pytest.raises(GraphError, match="axis must be an int >= 0"):
            Shard(bad)
    with pytest.raises(GraphError, match=r"index must be below count \(2\), got 2"):
        TensorPart(2, 2)
    with pytest.raises(GraphError, match="count must be an int >= 0"):
        TensorPart(0, -1)
    prog = ep.Program()
    with pytest.raises(GraphError, match="names axis 2 of a tensor of rank 2; valid axes: 0..1"):
        prog.fact(prog.input("w", (4, 4), role="weight"), Shard(2))
    tg = tensor_split(workloads.llama_gqa_prefill(2).tg, 2)
    again = TaskGraph.from_json(tg.to_json())
    assert [t.facts for t in again] == [t.facts for t in tg]
    text = tg.to_json().replace('{"kind": "shard", "axis": 0}', '{"kind": "shard", "axis": 7}', 1)
    with pytest.raises(GraphError, match="names axis 7"):
        TaskGraph.from_json(text)


def test_the_facts_change_no_plan():
    """The same program with and without its Shard facts gives the same plan, node for
    node, at a budget that offloads."""
    tg = workloads.llama_prefill().tg
    bare = TaskGraph(
        tuple(replace(t, facts=tuple(f for f in t.facts if not isinstance(f, Shard))) for t in tg),
        tg.outputs,
        tg.name,
    )
    assert any(t.facts != b.facts for t, b in zip(tg, bare, strict=True))
    for budget in ("60%", "100%"):
        assert plan(tg, budget).lines() == plan(bare, budget).lines()


# -- the split -------------------------------------------------------------------------


@pytest.mark.parametrize("kv_heads,devices", [(2, 2), (4, 4)])
def test_a_llama_layer_links_only_the_partials_of_its_two_reductions(kv_heads, devices):
    """Per layer the attention output projection (o) and the MLP's down projection reduce
    a split class: each device sends its partial sum [b, s, d] to every other device
    that needs the sum – all of them, except after the last layer's MLP, whose sum only
    the head's device (0) needs. Nothing else crosses: (2L - 1) D (D - 1) + (D - 1)
    links of 2 x 8 x 64 float32 (4 KiB) each."""
    case = workloads.llama_gqa_prefill(kv_heads)
    placed = place(case.tg, devices, "tensor")
    tg = placed.graph
    layers = workloads.PREFILL_LAYERS
    assert len(placed.links) == (2 * layers - 1) * devices * (devices - 1) + devices - 1
    labels = {}
    for link in placed.links:
        task = tg[link.task]
        assert task.block.kind == "partial", task.line()
        assert fact_of(task, TensorPart) == TensorPart(link.source, devices)
        assert (link.shape, link.dtype, link.nbytes) == ((2, 8, 64), "float32", 4096)
        labels[task.label] = labels.get(task.label, 0) + 1
    assert labels == {
        "o": layers * devices * (devices - 1),
        "down": (layers - 1) * devices * (devices - 1) + devices - 1,
    }
    assert {(k.source, k.target) for k in placed.links} == {
        (a, b) for a in range(devices) for b in range(devices) if a != b
    }
    check_parts_on_their_devices(placed)


@pytest.mark.parametrize(
    "name,devices",
    [
        ("llama-gqa2-prefill", 2),
        ("llama-gqa4-prefill", 4),
        ("gpt2-prefill", 2),
        ("gpt2-prefill", 4),
    ],
)
def test_each_device_holds_its_share_of_every_sharded_weight(name, devices):
    """A sharded weight is read on each device only through one slice of 1/devices of its
    bytes (its heads, its columns: part d's block along the Shard axis); a weight without
    Shard (norms, embedding, head) is read whole where it is needed."""
    case = WORKLOADS[name]()
    placed = place(case.tg, devices, "tensor")
    weights = {i for i in case.tg.inputs.values() if case.tg[i].op.role == "weight"}
    sharded = {i for i in weights if fact_of(case.tg[i], Shard)}
    for part in placed.parts:
        held = {}
        for name, i in part.tg.inputs.items():
            task = part.tg[i]
            if task.op.role != "weight" or fact_of(task, Shard) is None:
                continue
            readers = part.tg.consumers[i]
            assert readers and all(isinstance(part.tg[r].op, Slice) for r in readers), name
            held[name] = sum(part.tg[r].nbytes for r in readers)
            axis = fact_of(task, Shard).axis
            share = task.shape[axis] // devices
            assert {part.tg[r].op.starts[axis] for r in readers} == {part.device * share}
            assert held[name] * devices == task.nbytes, name
        assert set(held) == {case.tg[i].op.name for i in sharded}
    assert weights - sharded  # the norms and the embedding stay whole


def test_a_split_graph_partitioned_for_a_budget_keeps_each_block_s_device():
    """Partitioning a split graph keeps its facts on the blocks: each block of a part goes
    to that part's device; the plans of the blocks run equal to the unsplit reference."""
    case = workloads.llama_gqa_prefill(2)
    split_graph = tensor_split(case.tg, 2)
    blocks = partition(split_graph, "12KiB")
    assert len(blocks) > len(split_graph)
    device_of = tensor_placement(blocks, 2)
    seen = set()
    for task in blocks:
        original = split_graph[task.block.of]
        part = fact_of(original, TensorPart)
        want = REPLICATED if part is None else part.index
        if task.block.kind in ("block", "partial"):
            assert device_of[task.id] == want, task.line()
            seen.add(want)
    assert seen == {REPLICATED, 0, 1}
    placed = place(blocks, 2, "tensor")  # split already: placed as it is
    assert placed.graph is blocks
    mp, roomy = workloads.smallest_placed_plans(placed)
    workloads.assert_forced_to_move(mp, roomy)
    run_everywhere(mp, case.inputs, taskgraph.evaluate(case.tg, case.inputs), case.rtol)


# -- errors ----------------------------------------------------------------------------


def test_a_graph_without_shard_facts_is_refused_naming_pipeline():
    tg, _ = chain()
    with pytest.raises(TensorSplitError, match="needs tensors stating Shard facts.*use pipeline"):
        place(tg, 2, "tensor")
    assert isinstance(TensorSplitError("x"), PlanError)


def test_parts_that_do_not_divide_a_split_class_are_refused_with_the_numbers():
    tg = workloads.llama_prefill().tg  # 4 KV heads
    with pytest.raises(
        TensorSplitError,
        match=r"tensor 'layers\.0\.attn\.wq' \(%\d+\)'s axis 0 \(Shard\) has extent 4, which 3 "
        r"parts do not divide: use a count that divides 4 \(\[1, 2, 4\]\), at most 4",
    ):
        place(tg, 3, "tensor")


def test_a_graph_partitioned_before_its_tensor_split_is_refused_saying_the_order():
    """Partitioning slices the sharded weights into blocks that state their Shard facts;
    tensor parallelism splits the unpartitioned graph, which may be partitioned after."""
    blocks = partition(workloads.llama_gqa_prefill(2).tg, "12KiB")
    with pytest.raises(TensorSplitError, match="partitioned already.*tensor_split.*then partition"):
        tensor_split(blocks, 2)


@pytest.mark.parametrize("parts", [0, -1, True, 1.5, "2"])
def test_parts_must_be_a_positive_int(parts):
    with pytest.raises(TensorSplitError, match="parts must be an int >= 1"):
        tensor_split(workloads.llama_prefill().tg, parts)


def test_a_graph_split_already_is_kept_for_its_count_and_refused_for_another():
    tg = workloads.llama_prefill().tg
    two = tensor_split(tg, 2)
    assert tensor_split(two, 2) is two
    with pytest.raises(TensorSplitError, match="split already for 2 parts.*cannot be split for 4"):
        tensor_split(two, 4)
    with pytest.raises(PlanError, match=r"split for 2 devices \(TensorPart facts\), not 4"):
        tensor_placement(two, 4)
    with pytest.raises(PlanError, match="needs a graph split by.*place\\(tg, 2, 'tensor'\\)"):
        tensor_placement(tg, 2)
    assert set(STRATEGIES) == {"pipeline", "tensor"}


def test_a_replicated_task_may_read_placed_ones_and_is_made_where_needed():
    """The relaxed split: a replicated compute task reading placed tasks is computed on
    every device that needs it, with the placed operands linked in."""
    tg, arrays = chain()
    einsums = [t.id for t in tg if t.kind == "einsum"]
    device_of = [REPLICATED] * len(tg)
    device_of[einsums[0]] = 0
    device_of[einsums[-1]] = 1
    placed = split(tg, device_of, 2)
    assert placed.graph is tg
    readers = {link.target for link in placed.links if link.task == einsums[0]}
    assert readers == {1}
    from test_placement_driver import assert_same_outputs, run_split

    assert_same_outputs(run_split(placed, arrays), taskgraph.evaluate(tg, arrays))


# -- the workloads ---------------------------------------------------------------------


@pytest.mark.parametrize(
    "name,devices",
    [
        ("llama-gqa2-prefill", 2),
        ("llama-gqa4-prefill", 4),
        ("gpt2-prefill", 2),
        ("gpt2-prefill", 4),
        ("llama-generation", 2),
        ("llama-generation", 4),
        ("gpt2-generation", 2),
        ("gpt2-generation", 4),
        ("llama-decode", 2),
        ("llama-decode", 4),
        ("llama-training", 2),
        ("llama-training", 4),
    ],
)
def test_workloads_placed_tensor_parallel_equal_the_unsplit_reference(name, devices):
    case = WORKLOADS[name]()
    placed = place(case.tg, devices, "tensor")
    check_parts_on_their_devices(placed)
    mp, roomy = workloads.smallest_placed_plans(placed)
    workloads.assert_forced_to_move(mp, roomy)
    run_everywhere(mp, case.inputs, taskgraph.evaluate(case.tg, case.inputs), case.rtol)


@pytest.mark.parametrize("bits,minimum", [(8, False), (4, True)])
def test_a_quantized_llama_splits_its_rebuilt_weights_and_equals_the_reference(bits, minimum):
    """The Shard facts of a quantized weight are on its rebuilt float tensor: each device
    rebuilds its own heads and columns from slices of the quantized inputs."""
    from einpage.program.quantize import Quantization

    cfg = llama.PRESETS["tiny"]
    quant = Quantization(bits, 32, minimum=minimum)
    tg = llama.prefill_program(cfg, 2, 4, quant=quant).build()
    inputs = program_inputs(tg, 0)
    placed = place(tg, 2, "tensor")
    check_parts_on_their_devices(placed)
    assert len(placed.links) == 2 * cfg.num_layers * 2 - 1  # o and down partials
    mp, roomy = workloads.smallest_placed_plans(placed)
    workloads.assert_forced_to_move(mp, roomy)
    run_everywhere(mp, inputs, taskgraph.evaluate(tg, inputs), 1e-4)


def test_a_tensor_parallel_prefill_runs_on_ray_actors(cluster):
    from runtime.ray_cluster import RayDevices

    case = workloads.llama_gqa_prefill(2)
    mp, roomy = workloads.smallest_placed_plans(place(case.tg, 2, "tensor"))
    workloads.assert_forced_to_move(mp, roomy)
    with RayDevices(mp, timeout=30) as actors:
        got = actors.run(case.inputs)
    workloads.assert_close(got, taskgraph.evaluate(case.tg, case.inputs), case.rtol)


# -- random programs -------------------------------------------------------------------


@st.composite
def sharded_programs(draw):
    """A random program (`weighted_programs` or `layered_programs`) with `Shard` stated
    on one random axis of one of its weights, and a count of devices (2-4) that divides
    that axis."""
    tg, _ = draw(st.one_of(weighted_programs(), layered_programs()))
    choices = [
        (t.id, axis, devices)
        for t in tg
        if isinstance(t.op, Input) and t.op.role == "weight"
        for axis, extent in enumerate(t.shape)
        for devices in (2, 3, 4)
        if extent % devices == 0
    ]
    assume(choices)
    weight, axis, devices = draw(st.sampled_from(choices))
    tasks = tuple(replace(t, facts=(*t.facts, Shard(axis))) if t.id == weight else t for t in tg)
    return TaskGraph(tasks, tg.outputs, tg.name), devices


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.filter_too_much])
@given(case=sharded_programs(), tight=st.floats(0.0, 1.0), seed=st.integers(0, 2**16))
def test_random_programs_with_shard_facts_split_placed_and_run_equal_the_reference(
    case, tight, seed
):
    tg, devices = case
    try:
        placed = place(tg, devices, "tensor")
    except TensorSplitError as err:  # a view regroups the axis, or nothing reads it
        assume(False)
        raise AssertionError from err
    check_parts_on_their_devices(placed)
    mp = plan_devices(placed, devices, workloads.random_budgets(placed, tight))
    verify_multi(mp)
    inputs = program_inputs(tg, seed)
    got = run_devices(mp, inputs, order="random", seed=seed, timeout=30)
    want = taskgraph.evaluate(tg, inputs)
    workloads.assert_close(got, want, workloads.tolerance_of(tg))


def test_the_embedding_runs_on_every_device_the_head_and_split_outputs_on_device_0():
    """What the README says of the tensor placement's unsplit ends: the embedding's
    gather is computed on every device (each needs the residual stream), the logits on
    device 0 only, and a decode step's new keys and values (split by KV group) are
    assembled on device 0 from every device's part."""
    from taskgraph.nodes import Gather

    prefill = place(workloads.llama_gqa_prefill(2).tg, 2, "tensor")
    assert [sum(isinstance(t.op, Gather) for t in p.tg) for p in prefill.parts] == [1, 1]
    assert prefill.outputs == {"logits": (0, "logits")}
    assert "logits" not in prefill.parts[1].tg.outputs
    decode = place(workloads.decode_step().tg, 2, "tensor")
    assert {device for device, _ in decode.outputs.values()} == {0}
    graph = decode.graph
    assembled = [graph[t] for n, t in graph.outputs.items() if n != "logits" and n != "ids"]
    assert assembled and all(t.block is not None and t.block.kind == "output" for t in assembled)
    assert any(link.target == 0 and link.source == 1 for link in decode.links)
