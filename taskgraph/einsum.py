"""Einsum specs: parsing, validation against operand shapes, and normalization.

A TaskGraph stores only *explicit* specs (`"ij,jk->ik"`): letters only, an output
after `->`, no ellipsis. `normalize` turns what a user may write (implicit output,
`...`, spaces) into such a spec, following NumPy's conventions.

Semantics (generalized einsum): every index names one dimension size shared by all
operands that use it; an operand that lacks an index is broadcast along it; indices
absent from the output are reduced with the einsum's aggregation.

>>> spec = EinsumSpec.parse("bd,df->bf")
>>> spec.reduced, spec.index_sizes([(4, 8), (8, 16)])
('d', {'b': 4, 'd': 8, 'f': 16})
"""

from __future__ import annotations

import math
import string
from collections.abc import Sequence
from dataclasses import dataclass

from einpage_core.errors import ShapeError, SpecError, UnsupportedError

__all__ = ["EinsumSpec", "Normalized", "normalize", "LETTERS"]

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
        """Raise `SpecError` for bad characters, repeated or unbound indices, empty terms."""
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
            if repeated:
                raise UnsupportedError(
                    f"einsum spec {shown!r}: index {repeated[0]!r} is repeated in {where}; "
                    "diagonals are not supported (use distinct indices)"
                )
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
            for char, size in zip(term, shape, strict=True):
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
        """Points in the iteration space: the product of every index size."""
        return math.prod(self.index_sizes(shapes).values())


@dataclass(frozen=True, slots=True)
class Normalized:
    """A user spec made explicit: the spec, and per operand the axes of size 1 to drop.

    `squeeze[i]` lists axes of operand i that NumPy would broadcast (size 1 against a
    larger size inside `...`); the caller reshapes those away before building the task.
    """

    spec: EinsumSpec
    squeeze: tuple[tuple[int, ...], ...]


def normalize(spec: str, shapes: Sequence[Shape]) -> Normalized:
    """Make a user's einsum spec explicit, following NumPy: implicit output, `...`.

    Implicit output (no `->`) is the ellipsis dimensions followed by the indices that
    appear exactly once, sorted. `...` stands for the leading dimensions not named by
    letters; they are aligned from the right across operands, and a size-1 dimension
    broadcasts against a larger one.

    >>> normalize("...ij,...jk", [(2, 3, 4), (4, 5)]).spec
    EinsumSpec(inputs=('Aij', 'jk'), output='Aik')
    """
    terms, arrow, out = _split_spec(spec, len(shapes))
    ranks = _ellipsis_ranks(spec, terms, shapes)
    ellipsis = _ellipsis_letters(spec, max(ranks, default=0))
    sizes = _ellipsis_sizes(spec, terms, shapes, ranks, len(ellipsis))
    new_terms: list[str] = []
    squeeze: list[tuple[int, ...]] = []
    for term, shape, rank in zip(terms, shapes, ranks, strict=True):
        explicit, drop = _expand_term(term, shape, rank, ellipsis, sizes)
        new_terms.append(explicit)
        squeeze.append(drop)
    if arrow:
        if ellipsis and "..." not in out:
            raise SpecError(f"einsum spec {spec!r}: the output must contain '...' when operands do")
        output = out.replace("...", ellipsis)
    else:
        named = "".join(terms).replace(".", "")
        output = ellipsis + "".join(sorted(c for c in set(named) if named.count(c) == 1))
    result = EinsumSpec(tuple(new_terms), output)
    result.check_structure(spec)
    result.index_sizes(
        [
            tuple(d for axis, d in enumerate(shape) if axis not in drop)
            for shape, drop in zip(shapes, squeeze, strict=True)
        ]
    )
    return Normalized(result, tuple(squeeze))


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


def _expand_term(
    term: str, shape: Shape, rank: int, ellipsis: str, sizes: Sequence[int]
) -> tuple[str, tuple[int, ...]]:
    """`term` with its `...` replaced by ellipsis letters, and the operand's axes to squeeze
    (size 1 where the ellipsis dimension is larger: NumPy broadcasts them)."""
    start = term.find("...")
    if start < 0:
        return term, ()
    letters, drop = [], []
    for k in range(rank):
        slot = len(ellipsis) - rank + k
        if shape[start + k] == 1 and sizes[slot] != 1:
            drop.append(start + k)
        else:
            letters.append(ellipsis[slot])
    return term.replace("...", "".join(letters)), tuple(drop)
