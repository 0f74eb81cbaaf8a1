"""Per-op-kind tables: what a pass or backend does for each op kind, complete when built.

Every place that does something different per op kind – the reference evaluator's
kernels, the partition rules, the CuPy backend's kernels – keeps one `OpTable` keyed
by op class. A table names every kind of `taskgraph.nodes.OP_KINDS`, or says why a
kind is left out (`without`, e.g. inputs, which arrive and are never computed), and
checks this when it is built – at import – so adding an op kind without its entry
fails the first import, not a user's run. `tests/test_op_coverage.py` runs each kind
through every table.

>>> from taskgraph.nodes import Einsum, Fill, Input
>>> OpTable("names", {Einsum: "e", Fill: "f"})
Traceback (most recent call last):
...
einpage_core.errors.UnsupportedError: names: no entry for op kind(s) 'input', 'gather', ...
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Generic, TypeVar

from einpage_core.errors import UnsupportedError
from taskgraph.nodes import OP_KINDS, Op

__all__ = ["OpTable"]

V = TypeVar("V")


class OpTable(Mapping[type[Op], V], Generic[V]):
    """An entry per op class (`table[Einsum]`, or `table.of(op)`), checked to be complete.

    `name` says what the entries are (shown in errors); `without` maps each op class
    deliberately left out to the reason, which `of` reports when asked for one.
    """

    def __init__(
        self,
        name: str,
        entries: Mapping[type[Op], V],
        *,
        without: Mapping[type[Op], str] | None = None,
    ):
        self.name = name
        self._entries = dict(entries)
        self.without: Mapping[type[Op], str] = dict(without or {})
        kinds = list(OP_KINDS.values())
        unknown = [cls for cls in (*self._entries, *self.without) if cls not in kinds]
        if unknown:
            names = ", ".join(getattr(cls, "__name__", repr(cls)) for cls in unknown)
            raise UnsupportedError(f"{name}: {names} is not an op kind of OP_KINDS")
        both = [cls.kind for cls in self._entries if cls in self.without]
        if both:
            raise UnsupportedError(f"{name}: op kind(s) {both} both have an entry and are without")
        missing = [
            cls.kind for cls in kinds if cls not in self._entries and cls not in self.without
        ]
        if missing:
            raise UnsupportedError(
                f"{name}: no entry for op kind(s) {', '.join(map(repr, missing))} (each kind "
                "of OP_KINDS needs one, or a reason in `without`)"
            )

    def __getitem__(self, cls: type[Op]) -> V:
        return self._entries[cls]

    def __iter__(self) -> Iterator[type[Op]]:
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    def of(self, op: Op) -> V:
        """The entry for `op`'s kind; `UnsupportedError` saying why for a kind left out."""
        entry = self._entries.get(type(op))
        if entry is None:
            reason = self.without.get(type(op), "not an op kind of OP_KINDS")
            raise UnsupportedError(f"{self.name}: none for op kind {op.kind!r}: {reason}")
        return entry

    def __repr__(self) -> str:
        kinds = ", ".join(cls.kind for cls in self._entries)
        return f"<OpTable {self.name!r}: {kinds}>"
