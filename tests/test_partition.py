"""Partitioning (`taskgraph.partition`): same answers, every block within the limit,
provenance that tiles each original task exactly once, and the shapes of the splits."""

from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import event, given
from hypothesis import strategies as st
from partition_cases import random_programs

import einpage as ep
import taskgraph
from einpage.errors import GraphError, InfeasibleBudgetError
from taskgraph import TaskGraph
from taskgraph.partition import (
    BlockLimitError,
    blocks_of,
    min_block_bytes,
    partition,
    partition_for_budget,
    smallest_feasible_block_limit,
    working_set,
)

# -- checks ---------------------------------------------------------------------------

NATIVE_TOLERANCE = {"float16": 5e-2, "float32": 1e-3, "float64": 1e-9, "int32": 0, "int64": 0}


def assert_same_outputs(tg: TaskGraph, parted: TaskGraph, arrays: dict) -> None:
    """The partitioned graph gives the same named outputs: exactly in float64 (up to the
    order of sums), and within the dtypes' rounding in the graph's own dtypes (partials
    are rounded to the output dtype before they are combined)."""
    native = max(NATIVE_TOLERANCE[tg[i].dtype] for i in tg.outputs.values())
    for wide, rtol in (("float64", 1e-9), (None, native)):
        with np.errstate(all="ignore"):  # random joins may overflow float16, in both
            want = taskgraph.evaluate(tg, arrays, dtype=wide)
            got = taskgraph.evaluate(parted, arrays, dtype=wide)
        assert got.keys() == want.keys()
        for name in want:
            assert got[name].shape == want[name].shape and got[name].dtype == want[name].dtype
            finite = np.abs(want[name][np.isfinite(want[name])])
            scale = max(1.0, float(finite.max(initial=0.0)))
            np.testing.assert_allclose(
                got[name], want[name], rtol=rtol, atol=rtol * scale, err_msg=name
            )


def assert_within_limit(parted: TaskGraph, limit: int, alignment: int = 1) -> None:
    """Every task but inputs and the Concats that rebuild outputs fits the limit."""
    for task in parted.tasks:
        if task.kind == "input" or task.block.kind == "output":
            continue
        assert working_set(parted, task.id, alignment) <= limit, task.line()


def assert_provenance(tg: TaskGraph, parted: TaskGraph) -> None:
    """Every task names a region of an original task; blocks tile each original once."""
    coverage = {t.id: np.zeros(t.shape, dtype=int) for t in tg.tasks}
    for task in parted.tasks:
        block = task.block
        assert block is not None, task.line()
        original = tg[block.of]
        assert task.dtype == original.dtype, task.line()
        assert len(block.starts) == len(original.shape), task.line()
        assert all(
            a + n <= extent
            for a, n, extent in zip(block.starts, block.shape, original.shape, strict=True)
        ), task.line()
        if block.kind in ("assembly", "output"):
            assert task.kind in ("slice", "concat"), task.line()
        if block.kind == "partial":
            spec = original.op.spec
            sizes = spec.index_sizes([tg[i].shape for i in original.inputs])
            assert len(block.reduced) == len(spec.reduced)
            assert all(
                a + n <= sizes[c] for (a, n), c in zip(block.reduced, spec.reduced, strict=True)
            )
        if block.kind == "block":
            copies = ("slice", "concat", "view")  # a copy's block may alias a block
            assert task.kind == original.kind or (
                original.kind in copies and task.kind in copies
            ), task.line()
            box = tuple(slice(a, a + n) for a, n in zip(block.starts, block.shape, strict=True))
            coverage[block.of][box] += 1
    for task_id, count in coverage.items():
        assert (count == 1).all(), f"blocks of %{task_id} do not tile it once: {count}"
    assert set(blocks_of(parted)) == {t.id for t in tg.tasks}


@given(
    case=random_programs(),
    position=st.floats(0.0, 1.0),
    below=st.integers(0, 9),
    alignment=st.sampled_from([1, 1, 8, 64]),
)
def test_partition_preserves_results_and_fits(case, position, below, alignment):
    """Random programs x random limits: the typed error below the finest split; above
    it, the same outputs, every task within the limit, blocks tiling their originals."""
    tg, arrays = case.tg, case.arrays
    needed = smallest_feasible_block_limit(tg, alignment)
    largest = max(working_set(tg, t.id, alignment) for t in tg.tasks if t.kind != "input")
    # Mostly limits between the smallest feasible one and the largest working set (log
    # scale, denser at the small end); one in ten below the smallest feasible one.
    high = max(needed, largest) * 11 // 10
    limit = int(needed * (high / needed) ** (position**2))
    if below == 0:
        limit = int(limit * position * 0.99)
    if limit < needed:
        with pytest.raises(BlockLimitError) as info:
            partition(tg, limit, alignment=alignment)
        assert info.value.needed == needed and info.value.limit == limit
        event("limit below the finest split")
        return
    parted = partition(tg, limit, alignment=alignment)
    assert_same_outputs(tg, parted, arrays)
    if parted is tg:
        assert largest <= limit
        event("nothing to split")
        return
    event(f"tasks x{min(len(parted) // len(tg), 20)}")
    assert_within_limit(parted, limit, alignment)
    assert_provenance(tg, parted)
    assert TaskGraph.from_json(parted.to_json()).tasks == parted.tasks


# -- examples -------------------------------------------------------------------------


def attention_program(batch=2, heads=4, seq=32, head_dim=8, dtype="float32") -> TaskGraph:
    """Scores, causal mask, softmax (max, sum, normalize) and the weighted sum of values."""
    prog = ep.Program("attention")
    q, k, v = (prog.input(n, (batch, heads, seq, head_dim), dtype) for n in "qkv")
    scores = prog.einsum("bhqe,bhke->bhqk", q, k, label="scores")
    probs = ep.softmax(ep.causal_mask(scores), axis=-1)
    prog.output(prog.einsum("bhqk,bhke->bhqe", probs, v, label="attn"), "o")
    return prog.build()


def random_inputs(tg: TaskGraph, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {
        name: rng.standard_normal(tg[i].shape).astype(tg[i].dtype) for name, i in tg.inputs.items()
    }


def by_label(tg: TaskGraph) -> dict[str, int]:
    return {t.label: t.id for t in tg.tasks if t.label}


def test_attention_splits_by_batch_head_and_query_never_by_key():
    tg = attention_program()
    labels = by_label(tg)  # scores, mask, masked, softmax.max, softmax.sum, softmax, attn
    limit = 6 * 1024  # a scores block of one (batch, head) is 4 KiB: smaller than that
    parted = partition(tg, limit)
    assert_same_outputs(tg, parted, random_inputs(tg))
    assert_within_limit(parted, limit)
    assert_provenance(tg, parted)
    seq = 32
    chain = {labels[n] for n in ("scores", "masked", "softmax.max", "softmax.sum", "softmax")}
    for task in parted.tasks:
        block = task.block
        if block.of in chain and block.kind == "block":
            b, h, q = block.shape[:3]
            assert b == 1 and h * q < 4 * seq, task.line()  # batch first, then heads/queries
            if len(block.shape) == 4:  # never split along the key index
                assert block.shape[3] == seq, task.line()
        # The chain's blocks flow from producer to consumer: no partials, no assembly.
        assert block.of not in chain or block.kind == "block", task.line()
    # Depth first: the first output block is done before the last scores block starts.
    attn = [t.id for t in parted.tasks if t.block.of == labels["attn"]]
    scores = [t.id for t in parted.tasks if t.block.of == labels["scores"]]
    assert attn[0] < scores[-1]


def test_causal_mask_blocks_carry_their_origin():
    tg = attention_program()
    parted = partition(tg, 6 * 1024)
    mask = by_label(tg)["mask"]
    blocks = [t for t in parted.tasks if t.block.of == mask]
    assert len(blocks) > 1  # split by query block, like its consumer
    for t in blocks:
        assert (t.op.origin or (0, 0)) == t.block.starts and t.op.pattern == "causal"
    assert_same_outputs(tg, parted, random_inputs(tg))


def test_huge_reduction_splits_the_reduced_index_and_combines_with_the_agg():
    for agg, join in (("sum", "a + b + c + d"), ("max", "max(max(max(a, b), c), d)")):
        prog = ep.Program("mm")
        a = prog.input("a", (2, 4096), "float64")
        b = prog.input("b", (4096, 2), "float64")
        prog.output(prog.einsum("ij,jk->ik", a, b, agg=agg), "c")
        tg = prog.build()
        parted = partition(tg, "40KiB")  # a and b are 64 KiB each, the output 32 B
        partials = [t for t in parted.tasks if t.block.kind == "partial"]
        assert [t.block.reduced for t in partials] == [((j, 1024),) for j in range(0, 4096, 1024)]
        (result,) = (t for t in parted.tasks if t.block.kind == "block" and t.block.of == 2)
        assert str(result.op.join) == join and result.inputs == tuple(t.id for t in partials)
        assert_same_outputs(tg, parted, random_inputs(tg))
        assert_within_limit(parted, 40 * 1024)


def test_combines_form_a_tree_when_the_partials_do_not_fit_one_task():
    prog = ep.Program("sum")
    x = prog.input("x", (64, 4096), "float64")
    prog.output(prog.einsum("ij->i", x), "s")
    tg = prog.build()
    limit, alignment = 2048, 512  # every tensor takes 512 B: three partials per combine
    parted = partition(tg, limit, alignment=alignment)
    combines = [t for t in parted.tasks if t.kind == "einsum" and t.op.spec.inputs[0] == "i"]
    assert combines and all(len(t.inputs) <= 3 for t in combines)
    made = {t.id for t in combines}
    assert any(made.intersection(t.inputs) for t in combines)  # a tree: combines of combines
    assert_same_outputs(tg, parted, random_inputs(tg))
    assert_within_limit(parted, limit, alignment)
    assert_provenance(tg, parted)


def test_a_weight_larger_than_the_limit_is_read_in_slices():
    prog = ep.Program("proj")
    x = prog.input("x", (8, 1024))
    w = prog.input("w", (1024, 64), role="weight")  # 256 KiB
    prog.output(prog.einsum("bd,df->bf", x, w), "y")
    tg = prog.build()
    limit = 64 * 1024
    parted = partition(tg, limit)
    w_id = parted.inputs["w"]
    readers = [parted[c] for c in parted.consumers[w_id]]
    assert readers and all(t.kind == "slice" and t.block.kind == "assembly" for t in readers)
    assert all(working_set(parted, t.id) == t.nbytes <= limit for t in readers)
    assert_same_outputs(tg, parted, random_inputs(tg))
    assert_within_limit(parted, limit)


def test_gather_is_split_by_rows_of_ids():
    prog = ep.Program("embed")
    table = prog.input("table", (10, 8), role="weight")
    ids = prog.input("ids", (4096,), "int64")
    prog.output(ep.gather(table, ids), "rows")
    tg = prog.build()
    parted = partition(tg, "20KiB")  # 128 KiB of rows
    blocks = [t for t in parted.tasks if t.kind == "gather"]
    assert len(blocks) > 1 and all(t.shape[1] == 8 for t in blocks)
    arrays = {"table": random_inputs(tg)["table"], "ids": np.arange(4096) % 10}
    assert_same_outputs(tg, parted, arrays)
    assert_provenance(tg, parted)


def test_head_reshape_is_split_consistently():
    """`[b, s, h*e] -> [b, s, h, e]`: blocks by head map to contiguous column ranges."""
    prog = ep.Program("heads")
    x = prog.input("x", (1, 16, 32))
    w = prog.input("w", (32, 32), role="weight")
    qf = prog.einsum("bsd,df->bsf", x, w, label="qf")
    q = prog.view(qf, (1, 16, 4, 8))
    scores = prog.einsum("bqhe,bkhe->bhqk", q, q, label="scores")
    prog.output(ep.softmax(scores), "p")
    tg = prog.build()
    parted = partition(tg, "2KiB")
    labels = by_label(tg)
    views = [t for t in parted.tasks if t.kind == "view"]
    assert views and all(t.shape[2] < 4 for t in views)  # split by head
    qf_blocks = [t for t in parted.tasks if t.block.of == labels["qf"]]
    assert all(t.block.kind != "assembly" and t.shape[2] % 8 == 0 for t in qf_blocks)
    assert_same_outputs(tg, parted, random_inputs(tg))
    assert_within_limit(parted, 2 * 1024)
    assert_provenance(tg, parted)


def test_split_output_is_assembled_under_its_name():
    tg = attention_program()
    parted = partition(tg, 6 * 1024)
    out = parted[parted.outputs["o"]]
    assert out.kind == "concat" and out.block.kind == "output" and out.shape == (2, 4, 32, 8)
    assert out.block.of == tg.outputs["o"]


def test_json_round_trip_of_a_partitioned_graph():
    tg = attention_program()
    parted = partition(tg, 6 * 1024)
    again = TaskGraph.from_json(parted.to_json())
    assert again.tasks == parted.tasks and dict(again.outputs) == dict(parted.outputs)
    assert json.loads(parted.to_json())["tasks"][-1]["block"]["kind"] == "output"
    arrays = random_inputs(tg)
    np.testing.assert_array_equal(
        taskgraph.evaluate(again, arrays)["o"], taskgraph.evaluate(parted, arrays)["o"]
    )


def test_limit_below_the_finest_split_names_the_smallest_that_works():
    tg = attention_program(batch=1, heads=2, seq=4, head_dim=2)
    needed = smallest_feasible_block_limit(tg)
    culprit = max(
        (t.id for t in tg.tasks if t.kind != "input"), key=lambda i: min_block_bytes(tg, i)
    )
    with pytest.raises(
        BlockLimitError, match=rf"below the smallest that works.*\({needed} B\)"
    ) as info:
        partition(tg, needed - 1)
    assert isinstance(info.value, InfeasibleBudgetError)
    assert (info.value.limit, info.value.needed, info.value.task) == (needed - 1, needed, culprit)
    assert_same_outputs(tg, partition(tg, needed), random_inputs(tg))


def test_min_block_bytes_is_the_finest_split():
    tg = attention_program(dtype="float64")
    labels = by_label(tg)
    assert min_block_bytes(tg, labels["scores"]) == 3 * 8  # q, k, out; a combine of 3
    assert min_block_bytes(tg, labels["scores"], alignment=256) == 3 * 256
    assert min_block_bytes(tg, labels["masked"]) == 3 * 8
    assert min_block_bytes(tg, tg.inputs["q"]) == 8


def test_working_set_counts_operands_once_and_views_as_aliases():
    prog = ep.Program()
    x = prog.input("x", (8, 8), "float64")
    y = prog.einsum("ij,ij->ij", x, x)
    z = prog.view(y, (64,))
    prog.output(prog.slice(x, (0, 0), (2, 8)), "s")
    prog.output(z, "z")
    tg = prog.build()
    assert working_set(tg, 1) == 2 * 512  # x once, and y
    assert working_set(tg, 2) == 512  # a view aliases its operand
    assert working_set(tg, 3) == 128  # an input block: only the slice
    assert working_set(tg, 1, alignment=1000) == 2000


def test_graph_that_fits_is_returned_as_is():
    tg = attention_program()
    largest = max(working_set(tg, t.id) for t in tg.tasks)
    assert partition(tg, largest) is tg
    assert partition(tg, f"{largest}B") is tg


def test_partition_for_budget_chooses_a_quarter_of_the_budget():
    tg = attention_program()
    chosen = partition_for_budget(tg, "64KiB", alignment=256)
    assert chosen.limit == 16 * 1024 and chosen.needed == smallest_feasible_block_limit(tg, 256)
    assert_within_limit(chosen.graph, chosen.limit, 256)
    assert "limit=16.0 KiB" in repr(chosen)
    tight = partition_for_budget(tg, chosen.needed + 100, alignment=256)
    assert tight.limit == tight.needed  # a quarter would be below what the graph needs
    with pytest.raises(InfeasibleBudgetError) as info:
        partition_for_budget(tg, chosen.needed - 1, alignment=256)
    assert (info.value.budget, info.value.needed) == (chosen.needed - 1, chosen.needed)


def test_bad_arguments():
    tg = attention_program()
    with pytest.raises(GraphError, match="alignment must be a positive int"):
        partition(tg, 4096, alignment=0)
    with pytest.raises(GraphError, match="partition takes a taskgraph.TaskGraph, got str"):
        partition("graph", 4096)
    with pytest.raises(ep.units.BudgetFormatError):
        partition(tg, "lots")
    with pytest.raises(GraphError, match="fraction"):
        partition_for_budget(tg, "1MiB", fraction=2)


def attention_layer(batch=2, seq=16, hidden=32, heads=4) -> TaskGraph:
    """RMSNorm, q/k/v projections with a head index, attention, output projection, residual."""
    head = hidden // heads
    prog = ep.Program("layer")
    x = prog.input("x", (batch, seq, hidden))
    h = ep.rmsnorm(x, prog.input("norm", (hidden,), role="weight"))
    q, k, v = (
        prog.einsum(
            "bsd,dhe->bhse", h, prog.input(f"w{n}", (hidden, heads, head), role="weight"), label=n
        )
        for n in "qkv"
    )
    scores = prog.einsum("bhqe,bhke->bhqk", q, k, label="scores")
    o = prog.einsum("bhqk,bhke->bhqe", ep.softmax(ep.causal_mask(scores)), v, label="attn")
    out = prog.einsum("bhqe,hed->bqd", o, prog.input("wo", (heads, head, hidden), role="weight"))
    prog.output(ep.add(x, out), "y")
    return prog.build()


def test_tasks_that_fit_are_split_with_the_tasks_they_feed_and_read():
    tg = attention_layer()
    labels = by_label(tg)
    limit = 16 * 1024  # masked scores need 17 KiB; a projection 12 KiB, attn 16 KiB
    assert all(working_set(tg, labels[n]) <= limit for n in ("q", "k", "v", "attn"))
    parted = partition(tg, limit)
    # Projections and the attention output are split like the scores: nothing copies
    # them or the attention chain; only the residual input is sliced, the output joined.
    for n in ("q", "k", "v", "scores", "masked", "softmax", "attn"):
        kinds = {t.block.kind for t in parted.tasks if t.block.of == labels[n]}
        assert kinds == {"block"} and len(blocks_of(parted)[labels[n]]) > 1, n
    assembly = [t for t in parted.tasks if t.block.kind == "assembly"]
    y = tg[tg.outputs["y"]]  # the residual sum, an output: whole
    assert {t.block.of for t in assembly} <= {tg.inputs["x"], *y.inputs}
    assert_same_outputs(tg, parted, random_inputs(tg))
    assert_within_limit(parted, limit)
    # Without absorption only the tasks over the limit are split, and copies join and
    # slice blocks between them and their neighbours.
    alone = partition(tg, limit, absorb=False)
    assert len([t for t in alone.tasks if t.block.kind == "assembly"]) > len(assembly)
    assert len(blocks_of(alone)[labels["q"]]) == 1
    assert_same_outputs(tg, alone, random_inputs(tg))
    assert_within_limit(alone, limit)


def test_partition_is_deterministic():
    tg = attention_layer()
    assert partition(tg, 8 * 1024).to_json() == partition(tg, 8 * 1024).to_json()


@pytest.mark.parametrize("name", ["llama:tiny", "llama:tiny-gqa", "gpt2:tiny"])
@pytest.mark.parametrize("factor", [4, 8, 16])
def test_model_presets_partition_to_the_same_answer(name, factor):
    """The tiny model presets at a few block limits (multiples of the finest, which
    alone would make hundreds of thousands of tasks): same outputs, every task within
    the limit, blocks tiling their originals."""
    from einpage.cli.presets import load_program
    from einpage.cli.presets import random_inputs as preset_inputs

    tg = load_program(name, seq=8)
    limit = smallest_feasible_block_limit(tg, 256) * factor
    parted = partition(tg, limit, alignment=256)
    assert len(parted) > len(tg)
    assert_within_limit(parted, limit, 256)
    assert_provenance(tg, parted)
    assert_same_outputs(tg, parted, preset_inputs(tg))
