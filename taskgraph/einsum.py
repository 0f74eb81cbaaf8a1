"""Einsum specs: parsing, validation against operand shapes, and normalization.

A TaskGraph stores only *explicit* specs (`"ij,jk->ik"`): letters only, an output
after `->`, no ellipsis. `normalize` turns what a user may write (implicit output,
`...`, spaces, size-1 dimensions that broadcast) into such a spec, following
`numpy.einsum` exactly.

Semantics (generalized einsum): every index names one dimension size shared by all
operands that use it; an operand that lacks an index is broadcast along it; indices
absent from the output are reduced with the einsum's aggregation. An index repeated
inside one operand reads that operand's diagonal (`ii->i`, `iij->ij`, the trace
`ii->`): the operand's axes of that index have one size and move together, as in
NumPy. A diagonal is not a contiguous view, so it is read by the task itself (see
`take_diagonals`); an index may not repeat in the output.

>>> spec = EinsumSpec.parse("bd,df->bf")
>>> spec.reduced, spec.index_sizes([(4, 8), (8, 16)])
('d', {'b': 4, 'd': 8, 'f': 16})
>>> EinsumSpec.parse("iij,jk->ik").has_diagonal
True
"""

from __future__ import annotations

import math
import string
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from einpage_core.errors import ShapeError, SpecError

__all__ = ["EinsumSpec", "Normalized", "normalize", "take_diagonals", "LETTERS"]

LETTERS = string.ascii_letters
"""Characters allowed as einsum indices."""

Shape = tuple[int, ...]


@dataclass(frozen=True, slots=True)
class EinsumSpec:
    """An explicit einsum spec: one index string per input, and the output's."""

    inputs: tuple[str, ...]
    output: str

    @classmethod
    def parse(cls, spec: str) -> EinsumSpec:
        """Parse an explicit spec such as `"bhqd,bhkd->bhqk"` and check its structure."""
        if not isinstance(spec, str):
            raise SpecError(f"einsum spec must be a string, got {type(spec).__name__}")
        text = spec.replace(" ", "")
        if text.count("->") != 1:
            raise SpecError(f"einsum spec {spec!r} must have exactly one '->' (explicit output)")
        lhs, output = text.split("->")
        inputs = tuple(lhs.split(","))
        self = cls(inputs, output)
        self.check_structure(spec)
        return self

    def check_structure(self, original: str | None = None) -> None:
        """Raise `SpecError` for bad characters, an index repeated in the output, an output
        index bound by no operand, or no operands."""
        shown = original if original is not None else str(self)
        if not self.inputs:
            raise SpecError(f"einsum spec {shown!r} has no operand terms")
        for position, term in enumerate((*self.inputs, self.output)):
            where = "the output" if position == len(self.inputs) else f"operand {position}"
            for char in term:
                if char not in LETTERS:
                    raise SpecError(
                        f"einsum spec {shown!r}: {where} has {char!r}; indices must be letters"
                    )
            repeated = sorted({c for c in term if term.count(c) > 1})
            if repeated and position == len(self.inputs):
                raise SpecError(f"einsum spec {shown!r}: output index {repeated[0]!r} is repeated")
        bound = set("".join(self.inputs))
        for char in self.output:
            if char not in bound:
                raise SpecError(
                    f"einsum spec {shown!r}: output index {char!r} appears in no operand"
                )

    def __str__(self) -> str:
        return ",".join(self.inputs) + "->" + self.output

    @property
    def indices(self) -> str:
        """All indices: the output's first, then the reduced ones in order of appearance."""
        return self.output + self.reduced

    @property
    def has_diagonal(self) -> bool:
        """Whether some operand repeats an index (the task reads a diagonal of it)."""
        return any(len(set(term)) < len(term) for term in self.inputs)

    @property
    def reduced(self) -> str:
        """Indices aggregated away (in no output position), in order of first appearance."""
        seen: list[str] = []
        for char in "".join(self.inputs):
            if char not in self.output and char not in seen:
                seen.append(char)
        return "".join(seen)

    def index_sizes(self, shapes: Sequence[Shape]) -> dict[str, int]:
        """The size of every index given the operand shapes; raises on any disagreement."""
        if len(shapes) != len(self.inputs):
            raise SpecError(
                f"einsum spec {str(self)!r} has {len(self.inputs)} operand term(s) "
                f"but {len(shapes)} operand(s) were given"
            )
        sizes: dict[str, int] = {}
        owner: dict[str, int] = {}
        for position, (term, shape) in enumerate(zip(self.inputs, shapes, strict=True)):
            if len(term) != len(shape):
                raise SpecError(
                    f"einsum spec {str(self)!r}: operand {position} has shape {tuple(shape)} "
                    f"(rank {len(shape)}) but its term {term!r} has {len(term)} indices"
                )
            for axis, (char, size) in enumerate(zip(term, shape, strict=True)):
                first = term.index(char)
                if first < axis and shape[first] != size:
                    raise ShapeError(
                        f"einsum spec {str(self)!r}: index {char!r} repeats in operand "
                        f"{position} (a diagonal) over axes {first} and {axis} of sizes "
                        f"{shape[first]} and {size}; a diagonal needs equal sizes"
                    )
                if char in sizes and sizes[char] != size:
                    raise ShapeError(
                        f"einsum spec {str(self)!r}: index {char!r} has size {sizes[char]} in "
                        f"operand {owner[char]} but {size} in operand {position}"
                    )
                sizes.setdefault(char, size)
                owner.setdefault(char, position)
        return sizes

    def output_shape(self, shapes: Sequence[Shape]) -> Shape:
        """The output shape given the operand shapes."""
        sizes = self.index_sizes(shapes)
        return tuple(sizes[c] for c in self.output)

    def iteration_size(self, shapes: Sequence[Shape]) -> int:
        """Points in the iteration space: the product of every index's size, each index once
        (an index repeated in an operand is one dimension: `ii->` has n points)."""
        return math.prod(self.index_sizes(shapes).values())


@dataclass(frozen=True, slots=True)
class Normalized:
    """A user spec made explicit: the spec, and per operand the axes of size 1 to drop.

    `squeeze[i]` lists axes of operand i that NumPy would broadcast (size 1 against a
    larger size, under `...` or of a named index); the caller reshapes those away
    before building the task.
    """

    spec: EinsumSpec
    squeeze: tuple[tuple[int, ...], ...]


def normalize(spec: str, shapes: Sequence[Shape]) -> Normalized:
    """Make a user's einsum spec explicit, following `numpy.einsum`: implicit output,
    `...`, broadcasting.

    Implicit output (no `->`) is the ellipsis dimensions followed by the indices that
    appear exactly once (an index repeated inside one operand appears twice: `"ii"` is
    the trace), sorted by character code (uppercase first). `...` stands for the
    leading dimensions not named by letters; they are aligned from the right across
    operands. A size-1 dimension broadcasts against a larger one, under `...` and for
    a named index alike (`"ij,jk"` with j of size 1 in one operand and 3 in the
    other); the caller drops such axes (`Normalized.squeeze`). The axes of an index
    repeated inside one operand must have one size.

    >>> normalize("...ij,...jk", [(2, 3, 4), (4, 5)]).spec
    EinsumSpec(inputs=('Aij', 'jk'), output='Aik')
    >>> normalize("ij,jk", [(2, 1), (3, 4)])
    Normalized(spec=EinsumSpec(inputs=('i', 'jk'), output='ik'), squeeze=((1,), ()))
    """
    terms, arrow, out = _split_spec(spec, len(shapes))
    ranks = _ellipsis_ranks(spec, terms, shapes)
    ellipsis = _ellipsis_letters(spec, max(ranks, default=0))
    sizes = _ellipsis_sizes(spec, terms, shapes, ranks, len(ellipsis))
    axes = [
        _expand_term(term, shape, rank, ellipsis, sizes)
        for term, shape, rank in zip(terms, shapes, ranks, strict=True)
    ]
    axes = _broadcast_named(axes, shapes)
    if arrow:
        if ellipsis and "..." not in out:
            raise SpecError(f"einsum spec {spec!r}: the output must contain '...' when operands do")
        output = out.replace("...", ellipsis)
    else:
        named = "".join(terms).replace(".", "")
        output = ellipsis + "".join(sorted(c for c in set(named) if named.count(c) == 1))
    result = EinsumSpec(tuple("".join(c for c, _ in kept) for kept in axes), output)
    result.check_structure(spec)
    result.index_sizes(
        [tuple(shape[axis] for _, axis in kept) for shape, kept in zip(shapes, axes, strict=True)]
    )
    squeeze = tuple(
        tuple(a for a in range(len(shape)) if a not in {axis for _, axis in kept})
        for shape, kept in zip(shapes, axes, strict=True)
    )
    return Normalized(result, squeeze)


_Axes = list[tuple[str, int]]
"""The axes of an operand that stay: (index letter, axis of the operand), in order."""


def _broadcast_named(axes: Sequence[_Axes], shapes: Sequence[Shape]) -> list[_Axes]:
    """Drop the axes of an index whose every axis in that operand has size 1 where another
    operand gives the index a larger size (NumPy broadcasts them). Disagreeing sizes are
    left for `EinsumSpec.index_sizes` to report."""
    largest: dict[str, int] = {}
    for kept, shape in zip(axes, shapes, strict=True):
        for char, axis in kept:
            largest[char] = max(largest.get(char, 1), shape[axis])
    result = []
    for kept, shape in zip(axes, shapes, strict=True):
        ones = {c for c, _ in kept if all(shape[a] == 1 for d, a in kept if d == c)}
        result.append([(c, a) for c, a in kept if c not in ones or largest[c] == 1])
    return result


def take_diagonals(term: str, array: Any) -> tuple[str, Any]:
    """`array` (indexed by `term`) with the diagonal of every repeated index taken, and the
    term of the result: each index once, a diagonal's index last. Uses the array's own
    `diagonal` method, so NumPy and CuPy arrays alike give a view (strided, not
    contiguous).

    >>> import numpy as np
    >>> term, view = take_diagonals("iji", np.arange(12).reshape(2, 3, 2))
    >>> term, view.tolist()
    ('ji', [[0, 7], [2, 9], [4, 11]])
    """
    letters = list(term)
    while True:
        repeated = next((c for c in letters if letters.count(c) > 1), None)
        if repeated is None:
            return "".join(letters), array
        first = letters.index(repeated)
        second = letters.index(repeated, first + 1)
        array = array.diagonal(0, first, second)
        letters = [c for k, c in enumerate(letters) if k not in (first, second)] + [repeated]


def _split_spec(spec: str, operands: int) -> tuple[list[str], str, str]:
    """The operand terms, the arrow (`"->"` or `""`) and the output term of a user spec,
    checked: one term per operand, at most one arrow, well-formed ellipses."""
    if not isinstance(spec, str):
        raise SpecError(f"einsum spec must be a string, got {type(spec).__name__}")
    text = spec.replace(" ", "")
    if text.count("->") > 1:
        raise SpecError(f"einsum spec {spec!r} has more than one '->'")
    lhs, arrow, out = text.partition("->")
    terms = lhs.split(",")
    if len(terms) != operands:
        raise SpecError(
            f"einsum spec {spec!r} has {len(terms)} operand term(s) but {operands} "
            "operand(s) were given"
        )
    for term in (*terms, out):
        if term.count("...") > 1 or term.replace("...", "").count(".") > 0:
            raise SpecError(f"einsum spec {spec!r}: malformed ellipsis in {term!r}")
    return terms, arrow, out


def _ellipsis_ranks(spec: str, terms: Sequence[str], shapes: Sequence[Shape]) -> list[int]:
    """Per operand, how many dimensions its `...` stands for (0 without one)."""
    ranks = []
    for position, (term, shape) in enumerate(zip(terms, shapes, strict=True)):
        named = len(term.replace("...", ""))
        extra = len(shape) - named
        if "..." not in term and extra != 0 or extra < 0:
            raise SpecError(
                f"einsum spec {spec!r}: operand {position} has shape {tuple(shape)} "
                f"(rank {len(shape)}) but its term {term!r} names {named} indices"
            )
        ranks.append(extra if "..." in term else 0)
    return ranks


def _ellipsis_letters(spec: str, rank: int) -> str:
    """Letters for the ellipsis dimensions: unused ones, uppercase first, in order."""
    used = set(spec)
    free_letters = [c for c in string.ascii_uppercase + string.ascii_lowercase if c not in used]
    if rank > len(free_letters):
        raise SpecError(f"einsum spec {spec!r}: too many dimensions under '...'")
    return "".join(free_letters[:rank])


def _ellipsis_sizes(
    spec: str, terms: Sequence[str], shapes: Sequence[Shape], ranks: Sequence[int], rank: int
) -> list[int]:
    """Sizes of the ellipsis dimensions, operands aligned from the right; size 1 broadcasts."""
    sizes = [1] * rank
    for term, shape, own in zip(terms, shapes, ranks, strict=True):
        start = term.find("...")
        for k in range(own):
            size = shape[start + k]
            slot = rank - own + k
            if size != 1:
                if sizes[slot] not in (1, size):
                    shown = [tuple(s) for s in shapes]
                    raise ShapeError(
                        f"einsum spec {spec!r}: dimensions under '...' do not broadcast: "
                        f"{sizes[slot]} against {size} (shapes {shown})"
                    )
                sizes[slot] = size
    return sizes


def _expand_term(term: str, shape: Shape, rank: int, ellipsis: str, sizes: Sequence[int]) -> _Axes:
    """The axes of an operand that stay, with `...` named by ellipsis letters: all of
    them but the size-1 ellipsis axes where the ellipsis dimension is larger (NumPy
    broadcasts those)."""
    start = term.find("...")
    if start < 0:
        return [(c, axis) for axis, c in enumerate(term)]
    kept = [(c, axis) for axis, c in enumerate(term[:start])]
    for k in range(rank):
        slot = len(ellipsis) - rank + k
        if not (shape[start + k] == 1 and sizes[slot] != 1):
            kept.append((ellipsis[slot], start + k))
    after = term[start + 3 :]
    kept += [(c, start + rank + k) for k, c in enumerate(after)]
    return kept
