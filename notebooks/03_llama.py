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
# # LLaMA in less memory than it needs
#
# This notebook takes a LLaMA model through the whole of einpage:
#
# 1. a small LLaMA from Hugging Face `transformers`, written as an einsum program and
#    checked against transformers' logits;
# 2. planned under shrinking device budgets – what moves between host and device, and
#    where tensors sit in the arena;
# 3. executed by the NumPy runtime, whose arena is one buffer of exactly `budget`
#    bytes, and checked again;
# 4. loaded the way a real checkpoint is (`save_pretrained` → safetensors);
# 5. LLaMA-7B planned from its shapes alone (no weights), with the simulated time on
#    an H100 over PCIe 5 and the layer-streaming baseline beside it.
#
# It runs on a CPU in well under a minute.

# %%
# %matplotlib inline
import tempfile
import warnings

import numpy as np
import torch

warnings.filterwarnings("ignore", message="IProgress not found")  # tqdm, in transformers
import transformers  # noqa: E402

import memgraph  # noqa: E402
import runtime  # noqa: E402
import taskgraph  # noqa: E402
from einpage.errors import InfeasibleBudgetError  # noqa: E402
from einpage.models import llama  # noqa: E402
from einpage.units import format_bytes  # noqa: E402

torch.manual_seed(0)
torch.set_num_threads(2)
transformers.utils.logging.disable_progress_bar()


def relative_error(got, want):
    """Max abs error relative to the logit scale (max |logit|)."""
    return float(np.abs(got - want).max() / np.abs(want).max())


# %% [markdown]
# ## 1. A small LLaMA, as einsums
#
# Random weights, but the real architecture: RMSNorm, rotary embeddings, grouped-query
# attention (8 query heads share 2 key/value heads), a SwiGLU MLP, an untied LM head.
# `initializer_range=0.1` makes attention sharper than the default, so a wrong weight
# would show in the logits.

# %%
hf_config = transformers.LlamaConfig(
    vocab_size=256,
    hidden_size=128,
    intermediate_size=344,
    num_hidden_layers=4,
    num_attention_heads=8,
    num_key_value_heads=2,
    initializer_range=0.1,
    attn_implementation="eager",
)
hf_model = transformers.LlamaForCausalLM(hf_config).eval()

cfg = llama.LlamaConfig.from_hf(hf_config, name="small-llama")
weights = llama.weights_from_state_dict(cfg, hf_model.state_dict())  # {input name: array}
batch, seq = 2, 64
tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, (batch, seq))

tg = llama.prefill_program(cfg, batch, seq).build()
inputs = llama.prefill_inputs(cfg, tokens, weights)  # tokens, RoPE tables and weights
print(cfg)
weight_bytes = sum(w.nbytes for w in weights.values())
print(f"{len(tg)} tasks, {len(weights)} weights ({format_bytes(weight_bytes)})")

# %% [markdown]
# Every operation is one generalized einsum (or a gather, a view, a fill). One
# attention block of the TaskGraph – note the grouped-query specs: `g` is the K/V head,
# `r` the query head within its group, so K and V are never repeated:

# %%
attention = [t for t in tg if t.scope == "layers.0.attn"]
print("\n".join(str(t) for t in attention[:14]))

# %% [markdown]
# The reference evaluator runs the TaskGraph with NumPy; it must match transformers to
# 1e-4 of the logit scale in float32.

# %%
with torch.no_grad():
    want = hf_model(torch.from_numpy(tokens)).logits.numpy()
reference = taskgraph.evaluate(tg, inputs)["logits"]
print(f"evaluator vs transformers: {relative_error(reference, want):.1e}")
assert relative_error(reference, want) < 1e-4

# %% [markdown]
# ## 2. Plans under shrinking budgets
#
# Two sizes frame every budget:
#
# * the **streaming minimum** (formerly the streaming minimum): the arena the planner
#   needs when nothing leaves the device but weights, which start on the host, arrive
#   just in time and go after use (`"100%streaming"`); keeping every weight once loaded
#   needs the larger **resident peak** (`"100%"`: then nothing moves at all);
# * the **min budget**: the largest single step (its operands and output at once).
#   Below it no plan exists without splitting that step.

# %%
peak = memgraph.streaming_minimum(tg)
smallest, step = memgraph.min_budget(tg)
print(
    f"streaming minimum {format_bytes(peak)}; resident peak "
    f"{format_bytes(memgraph.resident_peak(tg))}; min budget {format_bytes(smallest)}, "
    f"set by {tg[step]}"
)

# %%
budgets = {  # from the streaming minimum down to the min budget, in thirds
    "peak": peak,
    "2/3": smallest + 2 * (peak - smallest) // 3,
    "1/3": smallest + (peak - smallest) // 3,
    "min": smallest,
}
plans = {}
print(
    f"{'budget':>16} {'peak':>10} {'offloaded':>16} {'reloaded':>16} {'dropped':>14} {'nodes':>6}"
)
for label, nbytes in budgets.items():
    mg = memgraph.plan(tg, nbytes)
    memgraph.verify(mg)  # raises naming the first broken rule
    plans[label] = mg
    s = mg.stats
    print(
        f"{label:>5} {format_bytes(nbytes):>10} {format_bytes(s.peak_bytes):>10} "
        f"{format_bytes(s.offload_bytes):>10} ({s.offload_count:>2}) "
        f"{format_bytes(s.reload_bytes):>10} ({s.reload_count:>2}) "
        f"{format_bytes(s.drop_bytes):>9} ({s.drop_count}) {s.node_count:>6}"
    )

# %% [markdown]
# Every plan reloads each weight at least once (they start in host memory). As the
# budget shrinks, activations are *offloaded* (copied out) and reloaded when needed
# again, and tensors that already have a valid host copy – a weight fetched early, an
# activation offloaded before – are *dropped*: freed without a copy, reloaded later.
# (Even at the streaming minimum the default plan offloads a little: it prefetches
# weights ahead of their steps, and that memory comes from somewhere.)
#
# The memory map of the tightest plan: arena offset against plan step, one rectangle
# per stay of a tensor on the device.

# %%
plans["min"].memory_map(figsize=(11, 5))

# %% [markdown]
# Live device bytes step by step, the tightest plan against the unconstrained one:

# %%
plans["min"].live_bytes_timeline(
    label="min budget", compare={"streaming minimum": plans["peak"]}, figsize=(11, 3.5)
)

# %% [markdown]
# ## 3. Running the plans
#
# The NumPy runtime executes a plan in an arena of exactly `budget` bytes: tensors are
# views at their planned offsets, so a planning bug corrupts the logits just as it
# would on a GPU. `mode="random"` runs any ready node in random order (and poisons
# freed memory), so a missing dependency would show up too.

# %%
for label, mg in plans.items():
    for mode in ("sequential", "random"):
        got = runtime.run(mg, inputs, backend="numpy", mode=mode)["logits"]
        error = relative_error(got, want)
        assert error < 1e-4, (label, mode, error)
    print(f"{label:>5}: logits match transformers to {error:.1e} (sequential and random order)")

# %% [markdown]
# A `Session` keeps the arena and the staged weights between runs: stage once, then
# each run passes only the activations (`prefill_inputs` without weights).

# %%
with runtime.Session(plans["min"], "numpy") as session:
    session.stage(weights)
    for seed in (1, 2):
        prompt = np.random.default_rng(seed).integers(0, cfg.vocab_size, (batch, seq))
        got = session.run(llama.prefill_inputs(cfg, prompt))["logits"]
        with torch.no_grad():
            expected = hf_model(torch.from_numpy(prompt)).logits.numpy()
        print(f"prompt {seed}: {relative_error(got, expected):.1e}, {session.last}")

# %% [markdown]
# ## 4. From a checkpoint on disk
#
# A real model comes as a directory written by `save_pretrained`: `config.json` and
# safetensors shards. The same few lines serve Llama-2-7B on a GPU (with `"float16"`
# and the `"cupy"` backend); here, the small model saved to a temporary directory.
# `logits="last"` returns only what choosing the next token needs.

# %%
with tempfile.TemporaryDirectory() as path:
    hf_model.save_pretrained(path, max_shard_size="500KB")  # a sharded checkpoint

    cfg = llama.LlamaConfig.from_checkpoint(path)
    weights = llama.weights_from_safetensors(cfg, path)  # reads only what the program uses
    tg_last = llama.prefill_program(cfg, batch, seq, logits="last").build()
    mg = memgraph.plan(tg_last, memgraph.min_budget(tg_last)[0])
    with runtime.Session(mg, "auto") as session:  # CuPy on a GPU, else NumPy
        session.stage(weights)
        logits = session.run(llama.prefill_inputs(cfg, tokens))["logits"]

print("next tokens:", logits.argmax(-1), "transformers:", want[:, -1].argmax(-1))
assert relative_error(logits, want[:, -1]) < 1e-4

# %% [markdown]
# ## 5. LLaMA-7B from its shapes
#
# A program needs no weights to be planned: `PRESETS["7b"]` builds the float16
# prefill of one 2048-token prompt (12.6 GiB of weights) in a fraction of a second.
# The simulator times a plan on three streams (compute, host→device, device→host)
# of an H100 over PCIe 5 (400 TFLOP/s, 50 GB/s each way); the layer-streaming
# baseline (ZeRO-Inference's policy: copy each layer's weights in before it runs, one
# layer ahead) is simulated beside it.

# %%
tg7 = llama.prefill_program(llama.PRESETS["7b"], 1, 2048, "float16").build()
smallest7, step7 = memgraph.min_budget(tg7)
print(
    f"{len(tg7)} tasks; streaming minimum {format_bytes(memgraph.streaming_minimum(tg7))}; "
    f"min budget {format_bytes(smallest7)} ({tg7[step7].label} in {tg7[step7].scope})"
)
print(
    f"{'budget':>8} | {'peak':>9} {'offloaded':>10} {'reloaded':>10} {'time':>8} {'stall':>6}"
    f" | {'streaming':>9} {'stall':>6}"
)
plans7 = {}
for budget in ("600MiB", "1GiB", "8GiB", "16GiB", "32GiB"):
    mg = plans7[budget] = memgraph.plan(tg7, budget)
    s, sim = mg.stats, memgraph.simulate(mg, "h100-pcie5")
    try:
        stream = memgraph.simulate(memgraph.layer_streaming_plan(tg7, budget), "h100-pcie5")
        baseline = f"{stream.makespan * 1e3:>6.0f} ms {1 - stream.compute_utilization:>6.0%}"
    except InfeasibleBudgetError as err:
        baseline = f"needs {format_bytes(err.needed)}"
    print(
        f"{budget:>8} | {format_bytes(s.peak_bytes):>9} {format_bytes(s.offload_bytes):>10} "
        f"{format_bytes(s.reload_bytes):>10} {sim.makespan * 1e3:>5.0f} ms "
        f"{1 - sim.compute_utilization:>6.0%} | {baseline}"
    )
print(f"compute alone: {sim.compute_seconds * 1e3:.0f} ms")

# %% [markdown]
# At batch 1 the prefill is bound by the PCIe link: every plan must bring all 12.6 GiB
# of weights over once (~270 ms at 50 GB/s) against ~115 ms of compute, so beyond a
# gigabyte more memory does not help, and the planner and layer streaming both sit at
# that bound. Memory buys headroom for larger batches and longer prompts instead.
# Layer streaming needs a whole layer's weights beside the attention activations; below
# that only the planner has a plan – it offloads activations, at a modest cost in time.
# `benchmarks/llama_plans.py` has the full table (7B and 65B, several shapes and
# budgets, with lower bounds).
#
# The 600 MiB plan's memory map, on the simulated time axis: weights (orange) stream
# through the arena between the attention scores of each layer (blue).

# %%
tight = plans7["600MiB"]
tight.memory_map(x="time", times=memgraph.simulate(tight, timeline=True).times, figsize=(11, 5))
