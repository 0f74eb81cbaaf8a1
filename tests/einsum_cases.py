"""Random einsums in everything `numpy.einsum` accepts: indices repeated inside one operand
(diagonals, traces), implicit outputs, ellipses of different ranks, and size-1
dimensions that broadcast (under `...` and of named indices)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from hypothesis import strategies as st

POOL = "abcdeAB"
"""Index letters drawn from (uppercase too: an implicit output sorts them first)."""


@dataclass(frozen=True)
class NumpyCase:
    """A random `numpy.einsum` call: its spec and operand shapes."""

    spec: str
    shapes: tuple[tuple[int, ...], ...]

    def __repr__(self) -> str:
        return f"NumpyCase({self.spec!r}, {list(self.shapes)})"


@st.composite
def numpy_einsum_cases(
    draw, max_operands: int = 4, max_points: int = 2048, ellipsis: bool = True
) -> NumpyCase:
    """A spec and shapes that `numpy.einsum` accepts, drawn to reach its corners.

    Terms draw letters with repetition (so a term may repeat an index: a diagonal),
    sometimes with `...` standing for 0-2 leading dimensions (operands' ellipses have
    different ranks and align from the right); a size-1 axis sometimes stands where the
    index or the ellipsis dimension is larger (broadcast). The output is implicit or
    an explicit permutation of a subset of the indices (`...` where an operand has
    one). The iteration space is kept under `max_points`.
    """
    letters = draw(st.permutations(POOL))[: draw(st.integers(1, 5))]
    sizes = {c: draw(st.integers(1, 3)) for c in letters}
    count = draw(st.integers(1, max_operands))
    terms = [
        "".join(draw(st.lists(st.sampled_from(letters), min_size=0, max_size=4)))
        for _ in range(count)
    ]
    if not any(terms):
        terms[0] = letters[0]
    rank = draw(st.integers(0, 2)) if ellipsis and draw(st.booleans()) else -1
    dots = [rank >= 0 and draw(st.booleans()) for _ in terms]
    under = [draw(st.integers(1, 3)) for _ in range(max(rank, 0))]
    used = sorted(set("".join(terms)))
    while math.prod(sizes[c] for c in used) * math.prod(under) > max_points:
        c = max(used, key=lambda k: sizes[k])
        sizes[c] = max(1, sizes[c] // 2)
    shapes, written = [], []
    for term, dotted in zip(terms, dots, strict=True):
        ones = {c for c in set(term) if draw(st.integers(0, 5)) == 0}  # broadcast indices
        shape = [1 if c in ones else sizes[c] for c in term]
        if dotted:
            own = draw(st.integers(0, rank))
            dims = [d if draw(st.integers(0, 3)) else 1 for d in under[rank - own :]]
            at = draw(st.integers(0, len(term)))
            term = term[:at] + "..." + term[at:]
            shape = shape[:at] + dims + shape[at:]
        shapes.append(tuple(shape))
        written.append(term)
    spec = ",".join(written)
    if draw(st.booleans()):
        chosen = draw(st.permutations(used))[: draw(st.integers(0, len(used)))]
        out = "".join(chosen)
        if any(dots) and (rank > 0 or draw(st.booleans())):
            at = draw(st.integers(0, len(out)))
            out = out[:at] + "..." + out[at:]
        spec += "->" + out
    return NumpyCase(spec, tuple(shapes))
