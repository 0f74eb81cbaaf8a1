# ---
# jupyter:
#   jupytext:
#     text_representation:
#       extension: .py
#       format_name: percent
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # Budgets: what less memory costs
#
# How much data does a plan move between host and device, and how much time does that
# cost, as device memory shrinks? This notebook plans one transformer-like program at
# budgets from its streaming minimum (100%) down to the smallest budget that can run it,
# and compares three policies:
#
# * **Belady** (einpage's default): evict the tensors whose next use is furthest away;
# * **LRU**: evict the tensors used longest ago, with the same planner otherwise;
# * **layer streaming** (as ZeRO-Inference does it): keep every weight on the host and
#   copy a layer's weights in before it runs, one layer ahead; activations never leave
#   the device.
#
# Times are simulated (`memgraph.simulate`) for an H100 on PCIe 5: compute, host-to-device
# and device-to-host copies on three streams, overlapping where the plan's dependencies
# allow. Every number is computed when the notebook runs.

# %%
# %matplotlib inline
import numpy as np
from IPython.display import display
from matplotlib.figure import Figure

import einpage as ep
import memgraph
from einpage.units import format_bytes
from memgraph.baselines import streaming_peak
from memgraph.plots import memory_map

MiB = 2**20

# %% [markdown]
# ## The program: chunked prefill
#
# A prompt processed in chunks, as an inference server does to bound its memory: every
# chunk passes through the same layers (attention and an MLP), and attends to its own
# keys and values and to those of the earlier chunks. Weights are reused once per chunk
# and the key/value cache lives across chunks, so what to keep on the device is a real
# choice – the case where Belady and LRU differ.


# %%
def chunked_prefill(layers=4, chunks=4, d=512, ff=2048, chunk=256, dtype="float16"):
    prog = ep.Program(f"chunked-prefill-L{layers}-C{chunks}")
    shapes = {"norm": (d,), "wq": (d, d), "wk": (d, d), "wv": (d, d), "wo": (d, d)}
    shapes |= {"mlp_norm": (d,), "w1": (d, ff), "w2": (ff, d)}
    weights = [
        {n: prog.input(f"layers.{i}.{n}", s, dtype, role="weight") for n, s in shapes.items()}
        for i in range(layers)
    ]
    cache = [None] * layers  # keys and values of the chunks so far, per layer
    for c in range(chunks):
        h = prog.input(f"x{c}", (chunk, d), dtype)
        for i, w in enumerate(weights):
            with prog.scope(f"chunk{c}.layers.{i}"):
                n = ep.rmsnorm(h, w["norm"])
                q, k, v = n @ w["wq"], n @ w["wk"], n @ w["wv"]
                if cache[i] is not None:
                    k = ep.concat([cache[i][0], k], axis=0)
                    v = ep.concat([cache[i][1], v], axis=0)
                cache[i] = (k, v)
                scores = prog.einsum("qd,kd->qk", q, k, join=f"a * b * {d**-0.5}")
                h = h + (ep.softmax(scores) @ v) @ w["wo"]
                h = h + ep.silu(ep.rmsnorm(h, w["mlp_norm"]) @ w["w1"]) @ w["w2"]
        prog.output(h, f"y{c}")
    return prog.build()


tg = chunked_prefill()
peak = memgraph.streaming_minimum(tg)
need, task = memgraph.min_budget(tg)
streaming_needs = streaming_peak(tg)[0]
print(repr(tg))
print(f"weights on the host:   {format_bytes(tg.input_bytes)}")
print(f"streaming minimum:       {format_bytes(peak)}")
print(f"smallest budget:       {format_bytes(need)} ({100 * need / peak:.0f}%), task %{task}")
print(
    f"layer streaming needs: {format_bytes(streaming_needs)} ({100 * streaming_needs / peak:.0f}%)"
)

# %% [markdown]
# ## The sweep
#
# Twelve budgets, evenly spaced from the streaming minimum down to the smallest budget.
# Each plan is verified (`memgraph.verify`) and simulated. A policy that cannot work in
# a budget is left out there: layer streaming needs room for a whole layer's weights.
# `memgraph.transfer_lower_bounds` gives the bytes that *any* plan must move at that
# budget in this task order (the weights once, plus what cannot stay resident).

# %%
POLICIES = {
    "Belady": lambda budget: memgraph.plan(tg, budget),
    "LRU": lambda budget: memgraph.plan(tg, budget, eviction="lru"),
    "layer streaming": lambda budget: memgraph.layer_streaming_plan(tg, budget),
}

budgets = np.linspace(peak, need, 12).astype(int)
results = {name: {} for name in POLICIES}
bounds = {}
for budget in budgets:
    bound = memgraph.transfer_lower_bounds(tg, int(budget))
    bounds[budget] = bound.reload_bytes + bound.offload_bytes
    for name, make in POLICIES.items():
        try:
            mg = make(int(budget))
        except ep.InfeasibleBudgetError:
            continue
        memgraph.verify(mg)
        sim = memgraph.simulate(mg)
        moved = mg.stats.reload_bytes + mg.stats.offload_bytes
        results[name][budget] = {"plan": mg, "moved": moved, "sim": sim}

header = f"{'budget':>16}  " + "".join(f"{name:>26}" for name in POLICIES) + f"{'lower bound':>14}"
print(header)
for budget in budgets:
    cells = []
    for name in POLICIES:
        r = results[name].get(budget)
        cells.append(f"{r['moved'] / MiB:8.1f} MiB {r['sim'].makespan * 1e3:6.2f} ms" if r else "-")
    share = f"{format_bytes(budget)} ({100 * budget / peak:3.0f}%)"
    print(
        f"{share:>16}  " + "".join(f"{c:>26}" for c in cells) + f"{bounds[budget] / MiB:10.1f} MiB"
    )

# %% [markdown]
# Bytes moved and simulated time against the budget (the x axis runs from the
# streaming minimum, left, down to the smallest budget, right). The dotted line is the
# compute time alone – what infinitely fast copies would give.

# %%
colors = {"Belady": "#4e79a7", "LRU": "#f28e2b", "layer streaming": "#59a14f"}
fig = Figure(figsize=(11, 4), layout="constrained")
moved_ax, time_ax = fig.subplots(1, 2)
for name, points in results.items():
    xs = [100 * b / peak for b in points]
    moved_ax.plot(
        xs, [p["moved"] / MiB for p in points.values()], "o-", label=name, color=colors[name]
    )
    time_ax.plot(
        xs, [p["sim"].makespan * 1e3 for p in points.values()], "o-", label=name, color=colors[name]
    )
moved_ax.plot(
    [100 * b / peak for b in budgets],
    [bounds[b] / MiB for b in budgets],
    "k--",
    label="lower bound",
)
compute = next(iter(results["Belady"].values()))["sim"].compute_seconds * 1e3
time_ax.axhline(compute, color="k", linestyle=":", label="compute alone")
for ax, label in ((moved_ax, "host <-> device traffic (MiB)"), (time_ax, "simulated time (ms)")):
    ax.set_xlabel("budget (% of the streaming minimum)")
    ax.set_ylabel(label)
    ax.invert_xaxis()
    ax.set_ylim(bottom=0)
    ax.grid(True, color="#e5e5e5")
    ax.legend(fontsize=8)
fig.suptitle(f"{tg.name}: what a smaller budget costs")
display(fig)

# %% [markdown]
# In numbers: how often each eviction policy moves less, and the three policies at the
# smallest budget where all of them run and at the smallest budget of all.

# %%
wins = sum(results["Belady"][b]["moved"] < results["LRU"][b]["moved"] for b in budgets)
ties = sum(results["Belady"][b]["moved"] == results["LRU"][b]["moved"] for b in budgets)
print(f"Belady moves less than LRU at {wins} of {len(budgets)} budgets ({ties} ties)")
common = min(b for b in budgets if all(b in results[name] for name in POLICIES))
for budget in (common, budgets[-1]):
    print(f"budget {format_bytes(budget)} ({100 * budget / peak:.0f}% of the streaming minimum):")
    best = results["Belady"][budget]
    for name in POLICIES:
        r = results[name].get(budget)
        if r is None:
            print(f"  {name:<16} cannot run (needs {format_bytes(streaming_needs)})")
            continue
        extra = (r["moved"] / best["moved"] - 1) * 100
        versus = f" ({extra:+.0f}% vs Belady)" if name != "Belady" else ""
        print(
            f"  {name:<16} moves {format_bytes(r['moved']):>10}{versus}, "
            f"simulated {r['sim'].makespan * 1e3:.2f} ms, "
            f"{100 * r['sim'].compute_utilization:.0f}% of it computing"
        )

# %% [markdown]
# Belady's rule is optimal for a cache of equal-sized pages. Here tensors differ in
# size, must sit in contiguous windows of one arena, and some are cheap to drop (a
# weight has a host copy) while others must be copied out first; the planner's choice
# is greedy, so another policy can come out ahead at some budgets.
#
# ## Memory maps side by side
#
# The three plans at that common budget. Each rectangle is one stay of a tensor on the
# device (weights orange, activations blue, outputs green); ▼ marks an offload and ▲ a
# reload. Layer streaming loads whole layers of weights and keeps every activation,
# while the planner keeps what is needed soonest and moves the rest.

# %%
fig = Figure(figsize=(11, 10), layout="constrained")
for ax, name in zip(fig.subplots(3, 1), POLICIES, strict=True):
    s = results[name][common]["plan"].stats
    title = (
        f"{name}: offloads {format_bytes(s.offload_bytes)}, reloads {format_bytes(s.reload_bytes)}"
    )
    memory_map(results[name][common]["plan"], ax=ax, x="apply", annotate=False, title=title)
display(fig)
