"""The oracle on every plan the tests make: `memgraph.verify` and the oracle must agree.

`install()` (from `conftest.py`) makes every MemGraph, as it is made, be judged twice:
by `memgraph.verify` and by the independent oracle (`oracle.py`, from the plan's JSON).
Where they disagree -- one accepts what the other rejects, or both reject but name
different nodes -- the watch records it, and the test that made the plan fails. Each
reports the first node that breaks one of its rules; the verifier names that node by
the id it carries, the oracle by its position (the same, unless the id is what is
wrong).

Plans made broken on purpose (mutation tests) are judged too: both must reject them,
at the same node. Left out, and counted in the summary line at the end of a run:

* plans of more than `NODE_CAP` nodes (the oracle's cost; see `NODE_CAP`);
* plans whose JSON cannot be written (a node lacks a field its kind needs);
* where the verdicts differ, plans whose JSON says something else than the plan: a
  field a node's kind does not use is not written, and a box is written as starts and
  sizes of its storage's array, so a box of another array becomes one of the storage's.
  The oracle can only judge what the JSON says.
* plans made by tests marked `judges_plans_itself` (they compare the two themselves);
* a plan made again from the very nodes (the same tuple), budget, alignment and storages
  as the plan judged just before it (the pipeline remakes a plan with more `info`).
"""

from __future__ import annotations

import collections
import os
import tempfile
import threading
import time
from pathlib import Path

import oracle

from einpage_core.errors import EinpageError, VerificationError
from memgraph.graph import MemGraph
from memgraph.verify import verify

__all__ = ["NODE_CAP", "OracleWatch", "WATCH", "install", "disagreement"]

NODE_CAP = 20_000
"""Plans of more nodes than this are left to the verifier alone. Measured on the suite
(2 cores): it makes about 3,700 plans, 3,650 of at most 5,000 nodes (850,000 nodes in
all), 30 of 5,000 to 20,000 (benchmarks, partitioned models) and 6 larger, up to 141,000
nodes. Judging a plan costs about 20 microseconds a node (writing its JSON, the verifier
and the oracle together), and the oracle's happens-before bitsets take n * n / 8 bytes
(50 MB at 20,000 nodes). With this cap the watch judges 3,072 plans in 16 s and leaves
8 out; the whole suite took 4 min 9 s, against 3 min 56 s without the watch (one run
each, back to back)."""


class OracleWatch:
    """What the watch saw: the disagreements not yet reported, and counts by outcome."""

    def __init__(self) -> None:
        self.verify = verify  # the real one, even where a test patches `memgraph.verify`
        self.paused = False
        self.busy = threading.local()  # loading a plan back makes a MemGraph too
        self.disagreements: list[str] = []
        self.counts: collections.Counter[str] = collections.Counter()
        self.seconds = 0.0  # spent judging
        self.last: tuple | None = None  # the last plan judged: nodes, budget, alignment, storages

    def see(self, mg: MemGraph) -> None:
        """Judge plan `mg` both ways (called as each MemGraph is made)."""
        if self.paused or getattr(self.busy, "on", False):
            return
        if len(mg.nodes) > NODE_CAP:
            self.counts["over the cap"] += 1
            return
        plan = (mg.nodes, mg.budget, mg.alignment, dict(mg.storages))
        if self.last is not None and plan[0] is self.last[0] and plan[1:] == self.last[1:]:
            self.counts["made again"] += 1  # e.g. the same plan with other `info`
            return
        self.last = plan
        self.busy.on = True
        start = time.perf_counter()
        try:
            self.judge(mg)
        finally:
            self.busy.on = False
            self.seconds += time.perf_counter() - start

    def judge(self, mg: MemGraph) -> None:
        try:
            text = mg.to_json()
        except (AttributeError, TypeError, ValueError):
            self.counts["without JSON"] += 1
            return
        try:
            self.verify(mg)
            named = None
        except VerificationError as err:
            named = "the plan" if err.node is None else err.node
        verdict = oracle.judge(text)
        self.counts["accepted" if verdict.accepted else "rejected"] += 1
        if self.agree(mg, named, verdict) or not self.json_says_it_all(mg, text):
            return
        verifier = "accepted it" if named is None else f"rejected it at {named}"
        self.disagreements.append(
            f"a plan of {len(mg.nodes)} nodes: the verifier {verifier}; the oracle "
            f"{verdict} (the plan's JSON: {self.save(text)})"
        )

    @staticmethod
    def agree(mg: MemGraph, named: int | str | None, verdict: oracle.Verdict) -> bool:
        """Whether the verifier's verdict (`named`: None for accepted, else the node it
        names or "the plan") and the oracle's are the same."""
        if verdict.accepted or named is None:
            return verdict.accepted and named is None
        if verdict.node is None or named == "the plan":
            return verdict.node is None and named == "the plan"
        return named in (verdict.node, mg.nodes[verdict.node].id)

    def json_says_it_all(self, mg: MemGraph, text: str) -> bool:
        """Whether the plan loaded back from `text` is `mg`: the same nodes, storages,
        budget and alignment (counted when not)."""
        try:
            again = MemGraph.from_json(text)
            same = (again.nodes, dict(again.storages), again.budget, again.alignment) == (
                mg.nodes,
                dict(mg.storages),
                mg.budget,
                mg.alignment,
            )
        except EinpageError:
            same = False
        if not same:
            self.counts["JSON unlike the plan"] += 1
        return same

    def save(self, text: str) -> str:
        """Keep a plan's JSON where a person can load it again; its path."""
        folder = Path(tempfile.gettempdir()) / "einpage-oracle-disagreements"
        folder.mkdir(exist_ok=True)
        path = folder / f"plan-{os.getpid()}-{sum(self.counts.values())}.json"
        path.write_text(text)
        return str(path)

    def take(self) -> list[str]:
        """The disagreements recorded since the last call."""
        found, self.disagreements = self.disagreements, []
        return found

    def counted(self) -> dict:
        """The counts and the seconds spent judging, for another process to `add`
        (a pytest-xdist worker sends them to the controller, which prints the summary)."""
        return {"counts": dict(self.counts), "seconds": self.seconds}

    def add(self, counted: dict) -> None:
        """Add another process's `counted()` to this watch's counts and seconds."""
        self.counts.update(counted["counts"])
        self.seconds += counted["seconds"]

    def summary(self) -> str:
        if not self.counts:
            return ""
        counts = ", ".join(f"{n} {what}" for what, n in sorted(self.counts.items()))
        return (
            f"plans judged by memgraph.verify and the oracle in {self.seconds:.1f} s "
            f"(NODE_CAP {NODE_CAP}): {counts}"
        )


WATCH = OracleWatch()


def install() -> None:
    """From now on, every MemGraph made is judged by the verifier and the oracle."""
    made = MemGraph.__post_init__

    def post_init(self) -> None:
        made(self)
        WATCH.see(self)

    MemGraph.__post_init__ = post_init


def disagreement(found: list[str]) -> str:
    """The message of a test that made plans the two judge differently."""
    more = f"\n(and {len(found) - 5} more)" if len(found) > 5 else ""
    return "memgraph.verify and the oracle disagree:\n" + "\n".join(found[:5]) + more
