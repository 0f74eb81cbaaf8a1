"""Paged attention equals unpaged attention: over random page sizes, cache lengths and
head layouts (multi-head, grouped-query), with and without masked (unfilled) positions,
by `taskgraph.evaluate` of the unpaged causal program and by an independent NumPy formula.
"""

from __future__ import annotations

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

import einpage as ep
import memgraph
import runtime
import taskgraph
from einpage.models.common import causal_attention
from einpage.models.decode import LayerCache, Page, masked_score, paged_attention
from einpage.models.generation import kv_mask

TOL = {"rtol": 2e-5, "atol": 2e-6}


def numpy_attention(q: np.ndarray, k: np.ndarray, v: np.ndarray) -> np.ndarray:
    """softmax(q kᵀ) v with every key visible: q [..., s, e], k and v [..., n, e]."""
    s = np.einsum("...qe,...ke->...qk", q.astype(np.float64), k.astype(np.float64))
    p = np.exp(s - s.max(axis=-1, keepdims=True))
    return np.einsum("...qk,...ke->...qe", p / p.sum(axis=-1, keepdims=True), v)


layouts = st.sampled_from([(3, 1), (2, 2), (1, 4)])  # (kv heads g, group r); r=1 is MHA


@given(
    length=st.integers(1, 23),
    page_size=st.integers(1, 9),
    layout=layouts,
    batch=st.integers(1, 2),
    seed=st.integers(0, 2**16),
)
def test_paged_attention_equals_causal_attention(length, page_size, layout, batch, seed):
    """The newest position's query over a cache cut into pages (the last one partial) ==
    the last row of causal attention over the whole sequence."""
    g, r = layout
    e = 4
    rng = np.random.default_rng(seed)
    q = (2 * rng.standard_normal((batch, g, r, length, e))).astype("float32")
    k = (2 * rng.standard_normal((batch, g, length, e))).astype("float32")
    v = rng.standard_normal((batch, g, length, e)).astype("float32")
    inputs = {"q": q, "k": k, "v": v}
    if r == 1:  # multi-head: the 4-D layout, as GPT-2 uses
        inputs["q"] = q[:, :, 0]

    prog = ep.Program("unpaged")
    qt, kt, vt = (prog.input(name, a.shape) for name, a in inputs.items())
    prog.output(causal_attention(qt, kt, vt), "out")
    unpaged = taskgraph.evaluate(prog.build(), inputs)["out"][..., -1:, :]

    prog = ep.Program("paged")
    qt, kt, vt = (prog.input(name, a.shape) for name, a in inputs.items())
    last = qt.shape[-2] - 1
    q_last = prog.slice(qt, (0,) * (qt.ndim - 2) + (last, 0), (*qt.shape[:-2], 1, e))
    cache = LayerCache.of_prompt(kt, vt, page_size)
    assert cache.length == length
    assert all(p.size == page_size for p in cache.pages)
    prog.output(paged_attention(q_last, cache.all_pages), "out")
    paged = taskgraph.evaluate(prog.build(), inputs)["out"]

    np.testing.assert_allclose(paged, unpaged, **TOL)
    q_np = inputs["q"][..., -1:, :]
    k_np, v_np = (k, v) if r > 1 else (k, v)
    if r > 1:
        k_np, v_np = k[:, :, None], v[:, :, None]
    np.testing.assert_allclose(paged, numpy_attention(q_np, k_np, v_np), **TOL)


@given(
    length=st.integers(1, 20),
    page_size=st.integers(1, 6),
    extra_pages=st.integers(0, 2),
    seed=st.integers(0, 2**16),
    dtype=st.sampled_from(["float32", "float16"]),
)
def test_masked_pages_read_only_their_filled_positions(length, page_size, extra_pages, seed, dtype):
    """A decode step plan's pages: a bucket of whole pages, filled up to `length`, with
    garbage (huge values) beyond it, masked; plus the new position's own page."""
    rng = np.random.default_rng(seed)
    pages = -(-length // page_size) + extra_pages
    h, e = 2, 4
    k = rng.standard_normal((1, h, pages * page_size, e)).astype(dtype)
    v = rng.standard_normal((1, h, pages * page_size, e)).astype(dtype)
    big = 100 if dtype == "float16" else 1e30  # unfilled, huge scores: they must not matter
    k[:, :, length:] = big
    v[:, :, length:] = -big
    q = rng.standard_normal((1, h, 1, e)).astype(dtype)
    k_new = rng.standard_normal((1, h, 1, e)).astype(dtype)
    v_new = rng.standard_normal((1, h, 1, e)).astype(dtype)

    prog = ep.Program("masked")
    qt = prog.input("q", q.shape, dtype)
    mask = prog.input("mask", (pages, page_size), dtype)
    new = Page(prog.input("k_new", k_new.shape, dtype), prog.input("v_new", v_new.shape, dtype))
    cached = []
    for j in range(pages):
        shape = (1, h, page_size, e)
        row = prog.view(prog.slice(mask, (j, 0), (1, page_size)), (page_size,))
        cached.append(
            Page(prog.input(f"k{j}", shape, dtype), prog.input(f"v{j}", shape, dtype), row)
        )
    prog.output(paged_attention(qt, [*cached, new]), "out")
    tg = prog.build()
    inputs = {"q": q, "mask": kv_mask(pages, page_size, length, dtype), "k_new": k_new}
    inputs["v_new"] = v_new
    for j in range(pages):
        inputs[f"k{j}"] = k[:, :, j * page_size : (j + 1) * page_size]
        inputs[f"v{j}"] = v[:, :, j * page_size : (j + 1) * page_size]
    got = taskgraph.evaluate(tg, inputs)["out"]
    keys = np.concatenate([k[:, :, :length], k_new], axis=2)
    values = np.concatenate([v[:, :, :length], v_new], axis=2)
    want = numpy_attention(q.astype("float32"), keys.astype("float32"), values.astype("float32"))
    tol = TOL if dtype == "float32" else {"rtol": 2e-2, "atol": 2e-3}
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got.astype("float32"), want, **tol)


def test_the_masked_score_is_exact_finite_and_vanishes():
    for dtype in ("float32", "float16"):
        value = masked_score(dtype)
        assert float(np.array(value, dtype=dtype)) == value  # exactly representable
        assert np.exp(np.float32(value) - np.float32(-100)) == 0


def test_paged_attention_runs_planned_with_pages_offloaded():
    """A cache of 6 computed pages planned at the smallest budget: pages leave and come back."""
    rng = np.random.default_rng(3)
    length, page_size, h, e = 24, 4, 2, 8
    arrays = {
        "q": rng.standard_normal((1, h, 1, e)).astype("float32"),
        "k": rng.standard_normal((1, h, length, e)).astype("float32"),
        "v": rng.standard_normal((1, h, length, e)).astype("float32"),
    }
    prog = ep.Program("pages")
    qt, kt, vt = (prog.input(n, a.shape) for n, a in arrays.items())
    cache = LayerCache.of_prompt(ep.exp(kt), vt, page_size)  # computed pages (activations)
    prog.output(paged_attention(qt, cache.all_pages), "out")
    tg = prog.build()
    mg = memgraph.plan(tg, memgraph.min_budget(tg)[0])
    assert mg.stats.offload_count > 0
    out = runtime.run(mg, arrays, backend="numpy", mode="random")
    want = numpy_attention(arrays["q"], np.exp(arrays["k"]), arrays["v"])
    np.testing.assert_allclose(out["out"], want, **TOL)
