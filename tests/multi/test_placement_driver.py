"""The oracle of a split (`memgraph.placement.split`): a tiny driver that evaluates the
per-device TaskGraphs with the reference kernels (`taskgraph.evaluate_task`), task by
task, each device in its own order, a link's input taking the value its source device
output once that output is computed. It shares no code with the splitter: it reads only
the parts' TaskGraphs, the links and where the outputs end. The tests here show that it
can fail: a split whose link carries the wrong tensor, or whose devices wait for each
other, is caught.

Other files of tests/multi import `run_split` and the model cases from here.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

import einpage as ep
import taskgraph
from einpage.models import llama
from memgraph.placement import pipeline_placement, split
from taskgraph.nodes import Input


class Stuck(AssertionError):
    """No device of a split can make progress, though some have tasks left."""


def run_split(placed, inputs, per_device: bool = False) -> dict[str, np.ndarray]:
    """The original outputs of `placed` on `inputs` (original input name -> array).

    Task-level dataflow: each device evaluates its tasks in its own graph's order, and
    waits at a link's input until the link's source output has a value. With
    `per_device`, each device's whole graph is instead evaluated at once with
    `taskgraph.evaluate`, devices in the order in which their links are ready (so a
    split whose devices wait for each other in a cycle raises `Stuck`).
    """
    feeds = {(k.target, k.input): (k.source, k.output) for k in placed.links}
    sent: dict[tuple[int, str], np.ndarray] = {}
    results: dict[int, dict[str, np.ndarray]] = {}
    parts = {part.device: part for part in placed.parts}
    if per_device:
        waiting = sorted(parts)
        while waiting:
            for device in waiting:
                tg = parts[device].tg
                given = {}
                for name in tg.inputs:
                    source = feeds.get((device, name))
                    given[name] = sent.get(source) if source else inputs[name]
                if any(value is None for value in given.values()):
                    continue
                results[device] = taskgraph.evaluate(tg, given)
                sent.update(((device, n), v) for n, v in results[device].items())
                waiting.remove(device)
                break
            else:
                raise Stuck(f"devices {waiting} all wait for links")
    else:
        values: dict[int, dict[int, np.ndarray]] = {d: {} for d in parts}
        position = dict.fromkeys(parts, 0)
        names = {
            d: {t: [n for n, i in p.tg.outputs.items() if i == t] for t in p.tg.outputs.values()}
            for d, p in parts.items()
        }
        moved = True
        while moved:
            moved = False
            for device, part in parts.items():
                tg = part.tg
                while position[device] < len(tg):
                    task = tg[position[device]]
                    if isinstance(task.op, Input):
                        source = feeds.get((device, task.op.name))
                        if source is not None and source not in sent:
                            break
                        value = sent[source] if source else np.asarray(inputs[task.op.name])
                    else:
                        operands = [values[device][i] for i in task.inputs]
                        value = taskgraph.evaluate_task(task, operands)
                    values[device][task.id] = value
                    for name in names[device].get(task.id, ()):
                        sent[device, name] = value
                    position[device] += 1
                    moved = True
        left = {d: len(p.tg) - position[d] for d, p in parts.items() if position[d] < len(p.tg)}
        if left:
            raise Stuck(f"tasks left on devices {left}, all waiting for links")
        results = {d: {n: values[d][i] for n, i in p.tg.outputs.items()} for d, p in parts.items()}
    return {name: results[device][local] for name, (device, local) in placed.outputs.items()}


def assert_same_outputs(got: dict, want: dict) -> None:
    """The same output names, each equal bit for bit (the same kernels on the same values)."""
    assert sorted(got) == sorted(want)
    for name in want:
        np.testing.assert_array_equal(np.asarray(got[name]), want[name], err_msg=name)


def llama_case(cfg, batch: int = 2, seq: int = 5, seed: int = 0):
    """A LLaMA prefill TaskGraph of `cfg` and its inputs, with random weights."""
    rng = np.random.default_rng(seed)
    weights = {
        name: (
            rng.standard_normal(shape) * (0.3 if len(shape) > 1 else 0.1) + (len(shape) == 1)
        ).astype(np.float32)
        for name, shape in llama.weight_shapes(cfg).items()
    }
    tokens = rng.integers(0, cfg.vocab_size, (batch, seq))
    tg = llama.prefill_program(cfg, batch, seq).build()
    return tg, llama.prefill_inputs(cfg, tokens, weights)


def chain(widths=(16, 16, 16, 16), seed: int = 0):
    """x @ w0 -> tanh -> @ w1 -> tanh ...: a chain over weights of the given output widths."""
    prog = ep.Program("chain")
    x = prog.input("x", (4, 16))
    rows = 16
    for i, width in enumerate(widths):
        x = ep.tanh(x @ prog.input(f"w{i}", (rows, width), role="weight"))
        rows = width
    prog.output(x, "y")
    tg = prog.build()
    rng = np.random.default_rng(seed)
    arrays = {n: rng.standard_normal(tg[i].shape).astype(np.float32) for n, i in tg.inputs.items()}
    return tg, arrays


# -- the driver can fail -------------------------------------------------------------


def test_the_driver_equals_the_reference_on_a_correct_split():
    tg, arrays = chain()
    placed = split(tg, pipeline_placement(tg, 2), 2)
    want = taskgraph.evaluate(tg, arrays)
    assert_same_outputs(run_split(placed, arrays), want)
    assert_same_outputs(run_split(placed, arrays, per_device=True), want)


def two_branches(seed: int = 0):
    """Two tensors of one shape computed on device 0 and read on device 1."""
    prog = ep.Program("branches")
    x = prog.input("x", (4, 16))
    w = [prog.input(f"w{i}", (16, 16), role="weight") for i in range(4)]
    h0, h1 = ep.tanh(x @ w[0]), ep.tanh(x @ w[1])
    prog.output(h0 @ w[2] + h1 @ w[3], "y")
    tg = prog.build()
    rng = np.random.default_rng(seed)
    arrays = {n: rng.standard_normal(tg[i].shape).astype(np.float32) for n, i in tg.inputs.items()}
    return tg, arrays


def test_the_driver_sees_links_that_carry_each_other_s_tensor():
    tg, arrays = two_branches()
    placed = split(tg, pipeline_placement(tg, 2), 2)
    first, second = placed.links
    assert first.shape == second.shape and (first.source, first.target) == (0, 1)
    swapped = (replace(first, input=second.input), replace(second, input=first.input))
    wrong = run_split(replace(placed, links=swapped), arrays)
    assert not np.array_equal(wrong["y"], taskgraph.evaluate(tg, arrays)["y"])
    assert_same_outputs(run_split(placed, arrays), taskgraph.evaluate(tg, arrays))


def test_the_driver_stops_when_devices_wait_for_each_other():
    """A link from the last device back into the first device's input "x": a cycle."""
    tg, arrays = chain()
    placed = split(tg, pipeline_placement(tg, 2), 2)
    (link,) = placed.links
    back = replace(link, source=1, target=0, output="y", input="x")
    cyclic = replace(placed, links=(link, back))
    with pytest.raises(Stuck):
        run_split(cyclic, arrays)
    with pytest.raises(Stuck):
        run_split(cyclic, arrays, per_device=True)
