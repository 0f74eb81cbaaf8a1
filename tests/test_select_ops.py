"""The selection ops: argmax/argmin (int64 ids), kth_largest (a top-k threshold) and
Gumbel-max sampling – their results against NumPy, their validation, and sampling that
follows its distribution (a chi-square test at a fixed seed)."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import einpage as ep
import memgraph
import runtime
import taskgraph
from einpage_core.errors import DTypeError, GraphError, ProgramError, ShapeError
from taskgraph.nodes import ArgReduce, KthLargest, op_from_attributes
from taskgraph.partition import partition, smallest_feasible_block_limit


def _run(build, inputs):
    prog = ep.Program()
    tensors = {
        name: prog.input(name, value.shape, str(value.dtype)) for name, value in inputs.items()
    }
    for name, tensor in build(tensors).items():
        prog.output(tensor, name)
    return taskgraph.evaluate(prog.build(), inputs)


@given(
    rows=st.integers(1, 5),
    cols=st.integers(1, 9),
    seed=st.integers(0, 2**16),
    dtype=st.sampled_from(["float32", "float16", "int64"]),
)
def test_argmax_argmin_and_kth_largest_equal_numpy(rows, cols, seed, dtype):
    rng = np.random.default_rng(seed)
    x = rng.integers(-3, 4, (rows, cols)).astype(dtype)  # small ints: ties are common
    k = int(rng.integers(1, cols + 1))
    out = _run(
        lambda t: {
            "max": ep.argmax(t["x"]),
            "min": ep.argmin(t["x"]),
            "min0": ep.argmin(t["x"], axis=0),
            "kth": ep.kth_largest(t["x"], k),
        },
        {"x": x},
    )
    np.testing.assert_array_equal(out["max"], np.argmax(x, axis=-1))  # first index on ties
    np.testing.assert_array_equal(out["min"], np.argmin(x, axis=-1))
    np.testing.assert_array_equal(out["min0"], np.argmin(x, axis=0))
    np.testing.assert_array_equal(out["kth"], -np.sort(-x, axis=-1)[:, k - 1])
    assert out["max"].dtype == np.int64 and out["kth"].dtype == x.dtype


def test_argmax_ids_feed_a_gather_on_the_device():
    """Greedy decoding's loop in miniature: the ids index an embedding without the host."""
    rng = np.random.default_rng(0)
    table = rng.standard_normal((10, 4)).astype("float32")
    logits = rng.standard_normal((3, 10)).astype("float32")
    prog = ep.Program()
    t = prog.input("table", (10, 4), role="weight")
    lg = prog.input("logits", (3, 10))
    prog.output(ep.gather(t, ep.argmax(lg)), "rows")
    tg = prog.build()
    mg = memgraph.plan(tg, "2KiB")
    out = runtime.run(mg, {"table": table, "logits": logits}, backend="numpy", mode="random")
    np.testing.assert_array_equal(out["rows"], table[np.argmax(logits, axis=-1)])


def test_selection_ops_validate():
    prog = ep.Program()
    x = prog.input("x", (2, 5))
    with pytest.raises(ShapeError, match="k=6 exceeds"):
        ep.kth_largest(x, 6)
    with pytest.raises(GraphError, match="k must be a positive int"):
        ep.kth_largest(x, 0)
    with pytest.raises(GraphError, match="unknown argreduce agg 'argmid'"):
        ArgReduce("argmid")
    with pytest.raises(ShapeError, match="out of range"):
        ep.argmax(x, axis=2)
    with pytest.raises(DTypeError, match="int64"):
        prog._add(ArgReduce(), (x,), dtype="float32")
    g = prog.input("g", (2, 4))
    with pytest.raises(ShapeError, match="noise has shape"):
        ep.sample_gumbel(x, g)
    g = prog.input("g2", (2, 5))
    for bad in (0, -1.0, math.inf, True):
        with pytest.raises(ProgramError, match="temperature must be > 0"):
            ep.sample_gumbel(x, g, temperature=bad)
    ids = prog.input("ids", (2, 5), "int64")
    with pytest.raises(DTypeError, match="logits must be a float"):
        ep.sample_gumbel(ids, ids)


def test_selection_ops_describe_and_round_trip():
    for op in (ArgReduce("argmin"), KthLargest(3)):
        assert op_from_attributes(op.kind, op.attributes()) == op
    prog = ep.Program()
    x = prog.input("x", (3, 8))
    prog.output(ep.kth_largest(x, 3), "k")
    tg = prog.build()
    assert "kth_largest[k=3](%0)" in tg[1].line()
    assert taskgraph.TaskGraph.from_json(tg.to_json())[1] == tg[1]


def test_partitioned_selections_split_rows_and_keep_columns_whole():
    prog = ep.Program()
    x = prog.input("x", (8, 16))
    h = ep.exp(x)  # a computed operand: its rows are assembled when split
    prog.output(ep.argmax(h), "a")
    prog.output(ep.kth_largest(h, 4), "k")
    tg = prog.build()
    parted = partition(tg, smallest_feasible_block_limit(tg))
    xs = np.random.default_rng(1).standard_normal((8, 16)).astype("float32")
    want, got = taskgraph.evaluate(tg, {"x": xs}), taskgraph.evaluate(parted, {"x": xs})
    assert len(parted) > 2 * len(tg)
    for name in want:
        np.testing.assert_array_equal(got[name], want[name])


def test_gumbel_max_sampling_follows_the_distribution():
    """20,000 draws from one row of logits over a 6-token vocabulary, temperature 0.7,
    top-k 4: the two smallest logits are never drawn and the counts of the others pass a
    chi-square test against softmax(logits / 0.7) over the top 4 (fixed seed)."""
    n, temperature = 20_000, 0.7
    logits = np.array([1.0, -0.5, 0.3, 2.0, -1.5, 0.8], dtype="float32")
    rng = np.random.default_rng(1234)
    gumbel = rng.gumbel(size=(n, logits.size)).astype("float32")
    rows = np.broadcast_to(logits, (n, logits.size)).copy()
    out = _run(
        lambda t: {"ids": ep.sample_gumbel(t["logits"], t["g"], temperature, top_k=4)},
        {"logits": rows, "g": gumbel},
    )
    counts = np.bincount(out["ids"], minlength=logits.size)
    kept = np.argsort(-logits)[:4]
    assert counts[np.setdiff1d(np.arange(logits.size), kept)].sum() == 0
    p = np.exp(logits[kept] / temperature)
    p /= p.sum()
    expected = n * p
    chi2 = float(((counts[kept] - expected) ** 2 / expected).sum())
    assert chi2 < 16.27  # the 0.999 quantile of chi-square with 3 degrees of freedom


def test_gumbel_max_without_top_k_can_draw_every_token():
    n = 4000
    logits = np.array([0.0, 0.1, -0.2], dtype="float32")
    gumbel = np.random.default_rng(5).gumbel(size=(n, 3)).astype("float32")
    rows = np.broadcast_to(logits, (n, 3)).copy()
    out = _run(lambda t: {"ids": ep.sample_gumbel(t["l"], t["g"])}, {"l": rows, "g": gumbel})
    counts = np.bincount(out["ids"], minlength=3)
    p = np.exp(logits) / np.exp(logits).sum()
    assert np.all(np.abs(counts / n - p) < 0.03)
