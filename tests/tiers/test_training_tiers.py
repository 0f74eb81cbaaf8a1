"""A training step with its optimizer states on disk (ZeRO-Infinity's setting): the
weights and AdamW's states read from a safetensors checkpoint, under a host budget below
what they take, equals the same step planned with everything in host memory and the
reference evaluator – in every runtime mode."""

from __future__ import annotations

import numpy as np
import pytest

import einpage as ep
import runtime
import taskgraph
from einpage.models import llama
from einpage.program.optim import AdamW
from einpage.weight_files import save_weights
from einpage.workloads.training import training_graph, training_inputs
from memgraph import NodeKind, min_budget
from taskgraph.nodes import Input

ADAMW = AdamW(lr=1e-2, betas=(0.8, 0.9), eps=1e-3, weight_decay=0.1)


@pytest.fixture(scope="module")
def step(tmp_path_factory):
    """The step's graph, all its inputs, and a checkpoint of its weights and states (with
    the states away from zero, as after a few steps)."""
    cfg = llama.PRESETS["tiny"]
    tg = training_graph(cfg, 2, 8, ADAMW)
    rng = np.random.default_rng(0)
    weights = {
        name: (rng.standard_normal(shape) * 0.2 + (len(shape) == 1)).astype(np.float32)
        for name, shape in llama.weight_shapes(cfg).items()
    }
    tokens, labels = rng.integers(0, cfg.vocab_size, (2, 2, 8))
    arrays = training_inputs(cfg, ADAMW, tokens, labels, weights)
    for name, task in tg.inputs.items():
        if tg[task].op.role == "state":
            arrays[name] = np.abs(rng.standard_normal(tg[task].shape)).astype(np.float32) * 0.01
    stored = {
        name: arrays[name]
        for name, task in tg.inputs.items()
        if isinstance(tg[task].op, Input) and tg[task].op.role in ("weight", "state")
    }
    folder = tmp_path_factory.mktemp("train")
    path = save_weights(stored, folder / "step.safetensors")
    return tg, arrays, stored, path, folder


@pytest.mark.parametrize("mode", ["sequential", "streams", "random"])
def test_a_step_with_its_states_on_disk_equals_the_step_in_memory(step, mode):
    tg, arrays, stored, path, folder = step
    budget = min_budget(tg)[0]
    in_memory = ep.compile(tg, budget).plan
    tiered = ep.compile(tg, budget, host_budget="50%", checkpoint=path, spill=folder).plan
    states = [n for n in tg.inputs if tg[tg.inputs[n]].op.role == "state"]
    assert states and all(tiered.storages[s].disk is not None
                          for s in (n.storage for n in tiered.nodes
                                    if n.kind is NodeKind.INPUT and n.name in states))  # fmt: skip
    # less host memory than the step in memory holds (every weight, state and output)
    assert tiered.stats.host_peak_bytes <= tiered.tier.budget < in_memory.host_bytes
    assert tiered.stats.disk_read_bytes >= sum(stored[s].nbytes for s in states)
    given = {k: v for k, v in arrays.items() if k not in stored}
    got = runtime.run(tiered, given, backend="numpy", mode=mode, seed=3, spill=folder)
    want = runtime.run(in_memory, arrays, backend="numpy", mode="sequential")
    reference = taskgraph.evaluate(tg, arrays)
    assert set(got) == set(want) == set(reference)
    for name in reference:
        np.testing.assert_array_equal(got[name], want[name], err_msg=name)
        np.testing.assert_allclose(got[name], reference[name], rtol=1e-5, atol=1e-6, err_msg=name)
    assert not [p for p in folder.iterdir() if p.name.startswith("einpage-spill")]
