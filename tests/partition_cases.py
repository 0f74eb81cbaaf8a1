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


@st.composite
def random_programs(draw):
    """A DAG of generalized einsums over shared indices, with fills, views, slices, concats
    and gathers now and then."""
    letters = _Letters({c: draw(st.integers(1, 4)) for c in "ijklmn"})
    dtype = draw(st.sampled_from(["float64", "float64", "float32", "float16"]))
    rng = np.random.default_rng(draw(st.integers(0, 2**16)))
    prog = ep.Program("random")
    arrays: dict[str, np.ndarray] = {}
    pool: list[tuple[ep.Tensor, str]] = []

    def add_input(term: str, role: str = "activation") -> None:
        name = f"x{len(arrays)}"
        arrays[name] = rng.standard_normal(letters.shape(term)).astype(dtype)
        pool.append((prog.input(name, letters.shape(term), dtype, role=role), term))

    for _ in range(draw(st.integers(1, 3))):
        term = "".join(
            draw(st.lists(st.sampled_from("ijklmn"), min_size=1, max_size=3, unique=True))
        )
        add_input(term, draw(st.sampled_from(["activation", "weight"])))

    kinds = ["einsum"] * 6 + ["fill", "view", "slice", "concat", "gather"]
    for _ in range(draw(st.integers(1, 6))):
        kind = draw(st.sampled_from(kinds))
        if kind == "einsum":
            count = draw(st.integers(1, 3))
            picked = [draw(st.sampled_from(pool)) for _ in range(count)]
            used = sorted(set("".join(term for _, term in picked)))
            if not used:
                continue
            out = "".join(draw(st.permutations(used))[: draw(st.integers(0, len(used)))])
            spec = ",".join(term for _, term in picked) + "->" + out
            join = None if draw(st.booleans()) else draw(join_trees(count, depth=2))[0]
            agg = draw(st.sampled_from(["sum", "sum", "max", "min", "prod"]))
            if agg == "prod" and math.prod(letters.sizes[c] for c in used) > 64:
                agg = "sum"  # keep products of many factors within range
            tensor = prog.einsum(spec, *[t for t, _ in picked], join=join, agg=agg)
            pool.append((tensor, out))
        elif kind == "fill":
            term = "".join(
                draw(st.lists(st.sampled_from("ijklmn"), min_size=1, max_size=3, unique=True))
            )
            causal = len(term) >= 2 and draw(st.booleans())
            value = draw(st.sampled_from([-2.5, 0.5, -math.inf])) if causal else 1.5
            if dtype != "float64":
                value = -2.5 if causal else value
            pattern = "causal" if causal else "full"
            pool.append((prog.fill(letters.shape(term), value, dtype, pattern=pattern), term))
        elif kind == "view":
            tensor, term = draw(st.sampled_from(pool))
            if not term:
                continue
            lo = draw(st.integers(0, len(term) - 1))
            hi = draw(st.integers(lo + 1, len(term)))
            factors = _factorizations(math.prod(letters.shape(term[lo:hi])), draw)
            factors = draw(st.permutations(factors))
            new = term[:lo] + "".join(letters.fresh(f) for f in factors) + term[hi:]
            if len(new) > 5:
                continue
            pool.append((prog.view(tensor, letters.shape(new)), new))
        elif kind == "slice":
            tensor, term = draw(st.sampled_from(pool))
            starts, shape, new = [], [], ""
            for c in term:
                n = letters.sizes[c]
                start = draw(st.integers(0, n - 1))
                size = draw(st.integers(1, n - start))
                starts.append(start)
                shape.append(size)
                new += c if size == n else letters.fresh(size)
            pool.append((prog.slice(tensor, starts, shape), new))
        elif kind == "concat":
            tensor, term = draw(st.sampled_from(pool))
            if not term:
                continue
            others = [t for t, other in pool if other == term]
            parts = [tensor] + [
                draw(st.sampled_from(others)) for _ in range(draw(st.integers(1, 2)))
            ]
            axis = draw(st.integers(0, len(term) - 1))
            total = sum(p.shape[axis] for p in parts)
            new = term[:axis] + letters.fresh(total) + term[axis + 1 :]
            pool.append((prog.concat(parts, axis), new))
        else:  # gather
            table, term = draw(st.sampled_from(pool))
            if not term or len(term) > 3:
                continue
            id_term = "".join(
                letters.fresh(draw(st.integers(1, 4))) for _ in range(draw(st.integers(1, 2)))
            )
            name = f"ids{len(arrays)}"
            arrays[name] = rng.integers(0, letters.sizes[term[0]], letters.shape(id_term))
            ids = prog.input(name, letters.shape(id_term), "int64")
            pool.append((prog.gather(table, ids), id_term + term[1:]))

    prog.output(pool[-1][0], "out")
    for k in range(draw(st.integers(0, 2))):
        prog.output(draw(st.sampled_from(pool))[0], f"extra{k}")
    return Case(prog.build(), arrays)
