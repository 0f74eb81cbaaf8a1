"""Random programs for partitioning and paging tests: a DAG of generalized einsums over
shared indices, with fills, views, slices, concats and gathers now and then."""

from __future__ import annotations

import math

import numpy as np
from hypothesis import strategies as st
from strategies import join_trees

import einpage as ep
from taskgraph import TaskGraph


class Case:
    """A random program and arrays for its inputs; shown as the graph's listing."""

    def __init__(self, tg: TaskGraph, arrays: dict[str, np.ndarray]):
        self.tg = tg
        self.arrays = arrays

    def __repr__(self) -> str:
        return "\n" + str(self.tg)


class _Letters:
    """Index letters with one size each: the program's shared dims, and fresh ones."""

    def __init__(self, sizes: dict[str, int]):
        self.sizes = dict(sizes)
        self.unused = [c for c in "opqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ" if c not in sizes]

    def fresh(self, size: int) -> str:
        letter = self.unused.pop(0)
        self.sizes[letter] = size
        return letter

    def shape(self, term: str) -> tuple[int, ...]:
        return tuple(self.sizes[c] for c in term)


def _factorizations(n: int, draw) -> list[int]:
    """A random ordered factorization of n (factors > 1), or [n]."""
    factors = []
    while n > 1:
        divisors = [d for d in range(2, n + 1) if n % d == 0]
        d = draw(st.sampled_from(divisors))
        factors.append(d)
        n //= d
    return factors or [1]


class _Random:
    """A random program being drawn: its inputs' arrays and a pool of (tensor, term)."""

    def __init__(self, draw, letters: _Letters, dtype: str):
        self.draw = draw
        self.letters = letters
        self.dtype = dtype
        self.rng = np.random.default_rng(draw(st.integers(0, 2**16)))
        self.prog = ep.Program("random")
        self.arrays: dict[str, np.ndarray] = {}
        self.pool: list[tuple[ep.Tensor, str]] = []

    def term(self) -> str:
        draw = self.draw
        return "".join(
            draw(st.lists(st.sampled_from("ijklmn"), min_size=1, max_size=3, unique=True))
        )

    def add_input(self, term: str, role: str = "activation") -> None:
        name = f"x{len(self.arrays)}"
        shape = self.letters.shape(term)
        self.arrays[name] = self.rng.standard_normal(shape).astype(self.dtype)
        self.pool.append((self.prog.input(name, shape, self.dtype, role=role), term))

    def add_einsum(self) -> None:
        draw, letters = self.draw, self.letters
        count = draw(st.integers(1, 3))
        picked = [draw(st.sampled_from(self.pool)) for _ in range(count)]
        used = sorted(set("".join(term for _, term in picked)))
        if not used:
            return
        out = "".join(draw(st.permutations(used))[: draw(st.integers(0, len(used)))])
        spec = ",".join(term for _, term in picked) + "->" + out
        join = None if draw(st.booleans()) else draw(join_trees(count, depth=2))[0]
        agg = draw(st.sampled_from(["sum", "sum", "max", "min", "prod"]))
        if agg == "prod" and math.prod(letters.sizes[c] for c in used) > 64:
            agg = "sum"  # keep products of many factors within range
        tensor = self.prog.einsum(spec, *[t for t, _ in picked], join=join, agg=agg)
        self.pool.append((tensor, out))

    def add_fill(self) -> None:
        draw = self.draw
        term = self.term()
        causal = len(term) >= 2 and draw(st.booleans())
        value = draw(st.sampled_from([-2.5, 0.5, -math.inf])) if causal else 1.5
        if self.dtype != "float64":
            value = -2.5 if causal else value
        pattern = "causal" if causal else "full"
        shape = self.letters.shape(term)
        self.pool.append((self.prog.fill(shape, value, self.dtype, pattern=pattern), term))

    def add_view(self) -> None:
        draw, letters = self.draw, self.letters
        tensor, term = draw(st.sampled_from(self.pool))
        if not term:
            return
        lo = draw(st.integers(0, len(term) - 1))
        hi = draw(st.integers(lo + 1, len(term)))
        factors = _factorizations(math.prod(letters.shape(term[lo:hi])), draw)
        factors = draw(st.permutations(factors))
        new = term[:lo] + "".join(letters.fresh(f) for f in factors) + term[hi:]
        if len(new) > 5:
            return
        self.pool.append((self.prog.view(tensor, letters.shape(new)), new))

    def add_slice(self) -> None:
        draw, letters = self.draw, self.letters
        tensor, term = draw(st.sampled_from(self.pool))
        starts, shape, new = [], [], ""
        for c in term:
            n = letters.sizes[c]
            start = draw(st.integers(0, n - 1))
            size = draw(st.integers(1, n - start))
            starts.append(start)
            shape.append(size)
            new += c if size == n else letters.fresh(size)
        self.pool.append((self.prog.slice(tensor, starts, shape), new))

    def add_concat(self) -> None:
        draw = self.draw
        tensor, term = draw(st.sampled_from(self.pool))
        if not term:
            return
        others = [t for t, other in self.pool if other == term]
        parts = [tensor] + [draw(st.sampled_from(others)) for _ in range(draw(st.integers(1, 2)))]
        axis = draw(st.integers(0, len(term) - 1))
        total = sum(p.shape[axis] for p in parts)
        new = term[:axis] + self.letters.fresh(total) + term[axis + 1 :]
        self.pool.append((self.prog.concat(parts, axis), new))

    def add_gather(self) -> None:
        draw, letters = self.draw, self.letters
        table, term = draw(st.sampled_from(self.pool))
        if not term or len(term) > 3:
            return
        id_term = "".join(
            letters.fresh(draw(st.integers(1, 4))) for _ in range(draw(st.integers(1, 2)))
        )
        name = f"ids{len(self.arrays)}"
        self.arrays[name] = self.rng.integers(0, letters.sizes[term[0]], letters.shape(id_term))
        ids = self.prog.input(name, letters.shape(id_term), "int64")
        self.pool.append((self.prog.gather(table, ids), id_term + term[1:]))


@st.composite
def random_programs(draw):
    """A DAG of generalized einsums over shared indices, with fills, views, slices, concats
    and gathers now and then."""
    letters = _Letters({c: draw(st.integers(1, 4)) for c in "ijklmn"})
    dtype = draw(st.sampled_from(["float64", "float64", "float32", "float16"]))
    state = _Random(draw, letters, dtype)
    for _ in range(draw(st.integers(1, 3))):
        state.add_input(state.term(), draw(st.sampled_from(["activation", "weight"])))
    add = {
        "einsum": state.add_einsum,
        "fill": state.add_fill,
        "view": state.add_view,
        "slice": state.add_slice,
        "concat": state.add_concat,
        "gather": state.add_gather,
    }
    kinds = ["einsum"] * 6 + ["fill", "view", "slice", "concat", "gather"]
    for _ in range(draw(st.integers(1, 6))):
        add[draw(st.sampled_from(kinds))]()
    pool = state.pool
    state.prog.output(pool[-1][0], "out")
    for k in range(draw(st.integers(0, 2))):
        state.prog.output(draw(st.sampled_from(pool))[0], f"extra{k}")
    return Case(state.prog.build(), state.arrays)
