"""Provenance of a task made by partitioning: the region of an original task it holds.

`Block` is a field of `taskgraph.nodes.Task` (None for a task a program made); its
kinds are `BLOCK_KINDS`.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from einpage_core.errors import GraphError

__all__ = ["Block", "BLOCK_KINDS"]

Shape = tuple[int, ...]

BLOCK_KINDS = ("block", "partial", "assembly", "output")
"""Roles of a task made by partitioning (see `Block`)."""


def _is_index(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(frozen=True, slots=True)
class Block:
    """Provenance of a task made by partitioning: the region of an original task it holds.

    `of` is the id of the original task (in the graph before partitioning); the task's
    output equals the box `starts[i] : starts[i] + shape[i]` of that task's output (so
    `shape` is the task's own shape). `kind` says why the task exists:

    * `"block"`    – one block of the original's partition; the blocks of a task tile
      its output exactly once (an unsplit task is its own single block).
    * `"partial"`  – an einsum block aggregated over part of the reduced indices only:
      `reduced` holds one `(start, size)` range per reduced index of the original spec
      (in `EinsumSpec.reduced` order); partials are combined, with the einsum's `agg`,
      into the block.
    * `"assembly"` – a copy (Slice or Concat) made so that a consumer gets exactly the
      region it reads: a part of one block, several blocks joined, or a region of an
      input. Assembly tasks may overlap blocks and each other.
    * `"output"`   – a Concat that rebuilds a split program output from its blocks.
    """

    of: int
    starts: Shape
    shape: Shape
    kind: str = "block"
    reduced: tuple[tuple[int, int], ...] = ()

    def __post_init__(self) -> None:
        if not _is_index(self.of) or self.of < 0:
            raise GraphError(f"block: 'of' must be a task id (an int >= 0), got {self.of!r}")
        starts, shape = tuple(self.starts), tuple(self.shape)
        if not all(_is_index(x) and x >= 0 for x in starts):
            raise GraphError(f"block of %{self.of}: starts must be ints >= 0, got {self.starts!r}")
        if not all(_is_index(x) and x > 0 for x in shape) or len(shape) != len(starts):
            raise GraphError(
                f"block of %{self.of}: shape {self.shape!r} must be positive ints, one per "
                f"start {list(starts)}"
            )
        if self.kind not in BLOCK_KINDS:
            raise GraphError(
                f"block of %{self.of}: kind must be one of {BLOCK_KINDS}, got {self.kind!r}"
            )
        try:
            reduced = tuple((start, size) for start, size in self.reduced)
        except (TypeError, ValueError):
            raise GraphError(
                f"block of %{self.of}: reduced must be (start, size) pairs, got {self.reduced!r}"
            ) from None
        if not all(_is_index(a) and a >= 0 and _is_index(n) and n > 0 for a, n in reduced):
            raise GraphError(
                f"block of %{self.of}: reduced ranges must be (start >= 0, size > 0), "
                f"got {self.reduced!r}"
            )
        if (self.kind == "partial") != bool(reduced):
            raise GraphError(
                f"block of %{self.of}: a partial needs reduced ranges and only a partial has "
                f"them (kind {self.kind!r}, reduced {list(reduced)})"
            )
        object.__setattr__(self, "starts", starts)
        object.__setattr__(self, "shape", shape)
        object.__setattr__(self, "reduced", reduced)

    def region(self) -> str:
        """The box as `%of[start:stop, ...]`."""
        box = ", ".join(f"{a}:{a + n}" for a, n in zip(self.starts, self.shape, strict=True))
        return f"%{self.of}[{box}]"

    def describe(self) -> str:
        """One line: `block %9[0:1, 0:11]`, `partial %4[0:2, 0:2] reduced[0:512]`."""
        text = f"{self.kind} {self.region()}"
        if self.reduced:
            text += " reduced[" + ", ".join(f"{a}:{a + n}" for a, n in self.reduced) + "]"
        return text

    def attributes(self) -> dict[str, Any]:
        """The JSON form (see `taskgraph.serialize`)."""
        return {
            "of": self.of,
            "starts": list(self.starts),
            "shape": list(self.shape),
            "kind": self.kind,
            "reduced": [list(r) for r in self.reduced],
        }

    @classmethod
    def from_attributes(cls, attrs: dict[str, Any]) -> Block:
        """Rebuild a block from its JSON form (validated by the constructor)."""
        expected = {f.name for f in fields(cls)}
        if not isinstance(attrs, dict) or set(attrs) != expected:
            got = sorted(attrs) if isinstance(attrs, dict) else attrs
            raise GraphError(f"block must be an object with exactly {sorted(expected)}, got {got}")
        reduced = attrs["reduced"]
        if not isinstance(reduced, list) or not all(
            isinstance(r, list) and len(r) == 2 for r in reduced
        ):
            raise GraphError(
                f"block: reduced must be a list of [start, size] pairs, got {reduced!r}"
            )
        for key in ("starts", "shape"):
            if not isinstance(attrs[key], list):
                raise GraphError(f"block: {key} must be a list of ints, got {attrs[key]!r}")
        return cls(
            attrs["of"],
            tuple(attrs["starts"]),
            tuple(attrs["shape"]),
            attrs["kind"],
            tuple((a, n) for a, n in reduced),
        )
