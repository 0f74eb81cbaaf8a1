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
# # einpage quickstart
#
# einpage compiles a tensor program, written as generalized einsums, into a *memory
# plan*: a schedule of allocations, computations and host <-> device copies that runs
# the program inside a fixed amount of device memory, even when the program needs
# more than that. This notebook walks through the pipeline once:
#
# 1. write a program and look at its **TaskGraph**;
# 2. **plan** it for a device smaller than it needs, and check the plan;
# 3. look at the plan: its nodes, a drawing, its memory map and simulated streams;
# 4. **run** it and compare the result with the reference evaluator;
# 5. go below the smallest budget by **partitioning** large tasks.
#
# Every number below is computed when the notebook runs.

# %%
# %matplotlib inline
import numpy as np
from IPython.display import SVG, display

import einpage as ep
import memgraph
import runtime
import taskgraph
from einpage.units import format_bytes

# %% [markdown]
# ## 1. A program
#
# A `Program` has inputs and einsums. `role="weight"` marks inputs that start in host
# memory (they are copied to the device when needed); other inputs start on the
# device. Besides plain einsums, an einsum can take a `join` (a scalar expression over
# its operands `a`, `b`, ...) and an `agg` for the reduced indices (sum by default,
# or max, min, prod). The op library (`ep.gelu`, `ep.softmax`, `@`, `+`, ...) writes
# the same einsums for you.
#
# The program is a residual MLP block followed by a softmax written out by hand.

# %%
prog = ep.Program("quickstart")
x = prog.input("x", (1024, 256))  # an activation, on the device
w1 = prog.input("w1", (256, 1024), role="weight")  # weights start in host memory
w2 = prog.input("w2", (1024, 256), role="weight")

h = prog.einsum("bd,df->bf", x, w1)  # a plain einsum: a matmul
y = x + ep.gelu(h) @ w2  # the op library writes einsums too
m = prog.einsum("bd->b", y, agg="max")  # a max-reduction
e = prog.einsum("bd,b->bd", y, m, join="exp(a - b)")  # a generalized join
s = prog.einsum("bd->b", e)  # a sum-reduction
prog.output(prog.einsum("bd,b->bd", e, s, join="a / b"), "p")

tg = prog.build()
print(tg)

# %% [markdown]
# `prog.build()` returns the **TaskGraph**: one task per op, with shapes, dtypes, bytes
# and FLOPs. It draws itself in a notebook (with Graphviz):

# %%
display(tg)

# %% [markdown]
# How much device memory does it need? With everything kept on the device while it is
# needed and every weight kept once loaded, the *resident peak* (a budget of 100%: then
# nothing moves). Loading weights just in time and never copying an activation out, the
# *streaming minimum* (100%streaming). No plan can use less than the largest working
# set of one task (its operands and output resident at once): `min_budget`.

# %%
resident = memgraph.resident_peak(tg)
peak = memgraph.streaming_minimum(tg)
need, task = memgraph.min_budget(tg)
print(f"resident peak:     {format_bytes(resident)}")
print(f"streaming minimum: {format_bytes(peak)}")
print(f"smallest budget: {format_bytes(need)}, for task %{task}: {tg[task].line()}")

# %% [markdown]
# ## 2. Plan it for a smaller device
#
# Plan for exactly the smallest budget. The planner simulates execution in an arena of
# that many bytes; when something does not fit it evicts the tensor needed furthest in
# the future (Belady), copying it to the host (*offload*) unless a host copy exists,
# and copies it back (*reload*) before its next use. `memgraph.verify` checks every
# invariant of the plan (regions within the budget, no overlap of live tensors, and
# dependencies that make concurrent streams safe) and raises on the first violation.

# %%
mg = memgraph.plan(tg, need)
report = memgraph.verify(mg)
print(repr(mg))
print(report)
print()
print(mg.stats)

# %% [markdown]
# A budget below the smallest one is refused with an error that says what needs the
# memory:

# %%
try:
    memgraph.plan(tg, need // 2)
except ep.InfeasibleBudgetError as err:
    print(err)

# %% [markdown]
# ## 3. Look at the plan
#
# A MemGraph is a list of nodes (`input`, `alloc`, `apply`, `offload`, `reload`, `free`,
# `output`), each with its device region and the nodes it depends on. Its insertion
# order is a valid sequential schedule:

# %%
print("\n".join(str(mg).splitlines()[:24]))

# %% [markdown]
# The drawing shows the dependencies by class: data (black), memory reuse (red,
# dashed). `collapse=True` folds each alloc and free into the node it serves.

# %%
SVG(memgraph.render.memgraph_svg(mg, collapse=True))

# %% [markdown]
# The **memory map** shows the arena over the plan: one rectangle per stay of a tensor
# on the device, with offloads (▼) and reloads (▲) marked.

# %%
mg.memory_map(figsize=(10, 4.5))

# %% [markdown]
# The **simulator** times the plan on three streams (compute, host-to-device,
# device-to-host) with a cost model of an H100 on PCIe 5: transfers overlap compute
# wherever the dependencies allow.

# %%
sim = memgraph.simulate(mg, timeline=True)
print(sim)
sim.plot(figsize=(10, 2.5))

# %% [markdown]
# ## 4. Run it and check it
#
# `runtime.run` executes the plan: on a GPU with CuPy when one is usable, otherwise
# with NumPy in a byte arena of exactly `budget` bytes, with tensors as views at their
# planned offsets — a planning mistake would corrupt the result just as on a GPU. The
# reference evaluator `taskgraph.evaluate` runs the TaskGraph directly with NumPy.

# %%
rng = np.random.default_rng(0)
inputs = {
    "x": rng.standard_normal((1024, 256)).astype("float32"),
    "w1": (rng.standard_normal((256, 1024)) / 16).astype("float32"),
    "w2": (rng.standard_normal((1024, 256)) / 32).astype("float32"),
}
out = runtime.run(mg, inputs, backend="auto")["p"]
ref = taskgraph.evaluate(tg, inputs)["p"]
print(f"rows sum to {out.sum(axis=1).mean():.6f}")
print(f"max |run - reference| = {np.abs(out - ref).max():.2e}")
assert np.allclose(out, ref, rtol=1e-4, atol=1e-6)

# %% [markdown]
# Plans are plain JSON, validated on load, and deterministic: the same program, budget
# and options give the same bytes.

# %%
text = mg.to_json()
again = memgraph.MemGraph.from_json(text)
print(f"{len(text):,} bytes of JSON; same plan again: {memgraph.plan(tg, need).to_json() == text}")
print(repr(again))

# %% [markdown]
# ## 5. Below the smallest budget: partitioning
#
# `memgraph.plan` plans the TaskGraph it is given, as it is. `einpage.compile` is the
# whole pipeline: when a task is too large for the budget it partitions the program
# first (`taskgraph.partition.partition_for_budget`: tasks run as blocks over parts of
# their output, with partial sums when a reduced index is split), then plans and
# verifies. The partitioned graph is an ordinary TaskGraph: the planner, the runtime
# and the reference evaluator use it unchanged. `Compiled` keeps both graphs, the plan,
# and how the budget and the block limit were chosen.

# %%
small = need // 2
compiled = ep.compile(tg, small)
mg_small = compiled.plan
out_small = runtime.run(mg_small, inputs, backend="auto")["p"]
print(compiled)
print(f"{len(tg)} tasks -> {len(compiled.graph)} tasks, {compiled.partitioning.describe()}")
print(f"max |run - reference| = {np.abs(out_small - ref).max():.2e}")
mg_small.memory_map(figsize=(10, 4.5))

# %% [markdown]
# ## The same from the command line
#
# ```
# einpage show prog.py                             # the TaskGraph of a Python file
# einpage plan prog.py --budget 8MiB -o plan.json  # or --budget 50% of the resident peak
# einpage stats plan.json                          # the tables above, and verification
# einpage run plan.json --check                    # run, compare with the reference
# einpage render plan.json -o plan.svg --collapse
# ```
#
# where `prog.py` defines `program` (or `build()`) as in the first cell. Presets such as
# `llama:tiny`, `llama:7b` or `gpt2:124m` work in place of a file (`einpage presets`).
