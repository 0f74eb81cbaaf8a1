"""When reloads are issued: by their deadline, evicting ahead of the execution horizon.

Without scheduling (`PlanOptions(schedule_transfers=False)`), the allocation horizon only
prefetches into memory that happens to be free: when step `a` ahead of the execution
horizon `e` does not fit, the horizon stalls there, and step `a` is prepared only when its
turn comes, evicting then. Its reloads then go into bytes whose last reader has just run,
so the compute stream waits for each whole copy (the simulator shows it as stall): a
streamed weight reloaded into the bytes of the weight read just before it cannot start
before that read ends.

With scheduling (`schedule_transfers=True`), a stalled step `a > e` that the lookahead
target says must be prepared *now* – its deadline: the latest step at which its
transfers still hide behind the compute of the steps before it, given the host-to-device
transfers pending for the steps up to it (`HorizonPlanner.horizon_target`) – is prepared
ahead, evicting for it with the same victim search and policy as at the execution
horizon, ranks compared at step `a`; so its reloads overlap the compute of steps
`e .. a-1`. Every tensor a step in `[e, a]` reads or writes is pinned while that step is
prepared, so each victim's next use is after `a`. Two limits keep this from moving more
bytes than the unscheduled plan:

* the planner waits instead when the bytes steps `e .. a-1` free, with the largest free
  block, could hold what step `a` misses (`evicts_ahead`): their frees may make room
  without evicting anything;
* a window is evicted ahead only when every victim has a valid host copy (a weight, or
  a tensor offloaded before: it is dropped, no copy out); a window that needs an offload
  is left to the execution horizon, where the victim search sees every tensor that steps
  `e .. a-1` unpin. Measured, evicting such windows ahead, or offloading their victims
  early without evicting them ("eager offloads"), moved more bytes or was slower: in the
  simulator (and on CUDA streams) an offload already starts as soon as its writer has run
  and the device-to-host link is free, wherever it sits in the plan.

It is off by default, because it trades bytes for time: a victim chosen while steps
`e .. a-1` are still pinned can be a worse choice than the one the policy would make at
step `a` (on cyclic weight reuse the weight read last is the best victim, and it is
still pinned), so a plan may reload more. Measured (`benchmarks/transfer_schedule.py`,
`h100-pcie5`): LLaMA-7B / 16 GiB / batch 16 generation 1.51 s -> 1.42 s (57% -> 60% of
its bound, 44.3 -> 46.2 GiB reloaded); GPT-2 1.5B 16x1024 training and the
compute-bound transformer-like graph at 50% unchanged; three passes over four 1 KiB
weights in 4 KiB (`tests/memgraph/test_optimal.py`) reload 11 KiB instead of the
optimum's 9. Restricting victims to those that waiting could not improve on kept the
bytes, but the generation cell then took 1.50 s: its gain comes from the other victims.

Reload victims old enough to hide the copy (`PlanOptions(hide_reloads=True)`)
---------------------------------------------------------------------------
Belady's victim for a reload is the tensor whose next use is furthest away: on cyclic
reuse (the weights of a decode step, read again next step) that is the tensor read
*just now*. The reload then goes into the bytes of the read that has just run, so it
cannot start before that read ends, and the read that needs it waits for the whole
copy: with the streamed weights one after another (Belady keeps a fixed set resident
and streams the rest through the bytes of the last one read), compute and the
host-to-device link take turns. Diagnosed on the LLaMA-7B / 16 GiB / batch 16 generation
cell (`benchmarks/generation.py`): each decode step moved 1.0 GiB (21.6 ms on the link)
beside 16.3 ms of compute, and took 36.7 ms – the sum, not the larger – because the
MLP weights of layers 23–27 were each reloaded into the bytes of the one before, after
its matmul; the link was idle during layers 0–22.

With `hide_reloads`, the window for an allocation that must evict is first searched
with the tensors read within one copy's time before the execution horizon held
(`RecentReads`: the compute before step `e` since their read ended is shorter than
`nbytes` over the host-to-device bandwidth), so the victim was read long enough ago for
the copy to run behind the compute since. Where no such window exists, or it would
offload more bytes than the unrestricted window (`hiding_window`), the unrestricted
window is used. On cyclic reuse any tensor read earlier in the cycle is needed again
one cycle later, so evicting an older one instead of the newest moves about the same
bytes; elsewhere it may move more (a victim needed sooner than Belady's), so the option
is off by default and trades bytes for time. Measured beside the default in one run
(`benchmarks/generation.py`, its `hidden` column; `benchmarks/transfer_schedule.py`):
see the README's "Measured" section.

The dependencies are the verifier's usual ones (an alloc waits for the frees of the
bytes it reuses, a free for every reader of its residency), so every plan is proved by
`memgraph.verify` whatever the eviction policy; `benchmarks/transfer_schedule.py`
measures plans with and without scheduling side by side.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from memgraph.eviction import Window
    from memgraph.residents import TensorState

__all__ = ["released_before", "evicts_ahead", "RecentReads", "hiding_window"]


def released_before(last_uses: Iterable[tuple[int, int]], steps: int) -> list[int]:
    """Prefix sums of the arena bytes released after each step's apply.

    `last_uses` are (position of a tensor's last use, its aligned size) for the tensors
    freed by the planner after that apply (a tensor used past the last step – a device
    output – is not). Entry `p` of the result is the bytes released by steps `0 .. p-1`,
    so the bytes steps `e .. a-1` release are `result[a] - result[e]`.

    >>> released_before([(0, 256), (2, 512), (2, 256), (5, 1024)], 4)
    [0, 256, 256, 1024, 1024]
    """
    released = [0] * (steps + 1)
    for position, size in last_uses:
        if position < steps:
            released[position + 1] += size
    for p in range(steps):
        released[p + 1] += released[p]
    return released


def evicts_ahead(need: int, free: int, released: Sequence[int], e: int, a: int) -> bool:
    """Whether step `a` (ahead of the execution horizon `e`) should be prepared now by
    evicting: the `need` bytes it still misses are more than the `free` bytes and those
    that steps `e .. a-1` release (`released`, from `released_before`) together. If they
    are not, waiting for those frees prepares it without moving anything.

    >>> evicts_ahead(need=1024, free=256, released=[0, 256, 512], e=0, a=2)
    True
    >>> evicts_ahead(need=1024, free=512, released=[0, 256, 512], e=0, a=2)
    False
    """
    return a > e and need > free + released[a] - released[e]


class RecentReads:
    """The tensors each step read, kept while their read is recent (`hide_reloads`).

    `before[p]` is the estimated compute seconds before step `p` (prefix sums, so the
    compute between the end of step `p` and the start of step `e` is `before[e] -
    before[p + 1]`). `record(p, tensors)` after step `p`'s apply; `within(e, seconds)`
    the tensors still resident whose last read is a step whose apply ended less than
    `seconds` of compute before step `e` starts: a copy of `seconds` into their bytes
    would have to wait for that read. Reads older than that are forgotten (`e` only
    grows), so each read is kept once and dropped once.
    """

    def __init__(self, before: Sequence[float]):
        self.before = before
        self.reads: deque[tuple[int, TensorState]] = deque()

    def record(self, position: int, tensors: Iterable[TensorState]) -> None:
        for tensor in tensors:
            self.reads.append((position, tensor))

    def within(self, e: int, seconds: float) -> list[TensorState]:
        before, reads = self.before, self.reads
        while reads and before[e] - before[reads[0][0] + 1] >= seconds:
            reads.popleft()
        return [t for p, t in reads if t.region is not None and t.last_use == p]


def hiding_window(hidden: Window | None, plain: Window | None) -> Window | None:
    """The window to clear: `hidden` (found with the recently read tensors held, see
    `RecentReads`) unless there is none or it offloads more bytes than `plain`, the
    window the policy picks among all evictable tensors."""
    if hidden is None or (plain is not None and hidden.transfer_bytes > plain.transfer_bytes):
        return plain
    return hidden
