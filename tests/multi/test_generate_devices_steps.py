"""Step plans on several devices (`Planning(way="steps", devices=N)`, `DevicesStepPlans`):
the prefill and each decode program placed by pipeline, each device under a budget below
its resident peak, run by the step loop with a session per device – tokens equal to the
one-device step plans', the unrolled generation's and transformers' greedy ones (the tiny
models and helpers of test_generate_devices); chunks of steps and buckets of pages; a
stop id ending the loop early; the weights staged once per device; on Ray actors; the
command line; and the refusals (more devices than layers, a device's budget below its
smallest, weights placed apart in two plans)."""

from __future__ import annotations

import numpy as np
import pytest
from test_generate_devices import (
    HOST,
    NEW_TOKENS,
    TOLERANCE,
    cli,
    model_case,
    printed_tokens,
    relative_error,
)

import runtime.multi
from einpage.cli.commands import EXIT_OK
from einpage.cli.generate import random_weights
from einpage.models import llama
from einpage.models.decode import Sampling
from einpage.models.errors import GenerationError
from einpage.workloads import generation
from einpage.workloads.generate import Planning, Running, generate
from einpage.workloads.generation import (
    DevicesNotBuiltError,
    DevicesStepPlans,
    Transfers,
    weight_devices,
)
from memgraph import read_budget
from memgraph.multi import DeviceBudgetError
from taskgraph.facts import KVPage, fact_of


def steps(devices: int, **options) -> Planning:
    return Planning(way="steps", devices=devices, **options)


def assert_offloads_forced(plan: DevicesStepPlans) -> None:
    """In every plan, every device's budget is below its graph's resident peak (it cannot
    keep all it reads: weights are dropped after use), and the plans reload more in all
    than the same plans do at 100% (something was evicted and brought back)."""
    spec = plan.spec
    again = generate(
        spec.cfg, np.zeros((spec.batch, spec.prompt_len), np.int64), spec.new_tokens, "100%",
        page_size=spec.page_size, plan=plan.planning, run=None,
    ).plan  # fmt: skip
    for name, compiled in plan.plans.items():
        parts, devices = compiled.plan.placed.parts, compiled.plan.plans
        for part, device in zip(parts, devices, strict=True):
            resident = read_budget(part.tg, "100%", HOST).nbytes
            assert device.mg.stats.peak_bytes <= device.budget < resident, name

    def reloaded(planned: DevicesStepPlans) -> int:
        return sum(p.mg.stats.reload_bytes for c in planned.plans.values() for p in c.plan.plans)

    assert reloaded(plan) > reloaded(again)


@pytest.mark.parametrize("model", ["gpt2", "llama"])
def test_two_devices_step_plans_choose_the_tokens_of_one_device_unrolled_and_transformers(model):
    cfg, weights, ids, want = model_case(model)
    args = (cfg, ids, NEW_TOKENS, "50%")
    out = generate(*args, weights=weights, page_size=4, plan=steps(2))
    assert isinstance(out.plan, DevicesStepPlans) and out.plan.devices == 2
    assert out.plan.way == "steps" and out.plan.runner == "local"
    assert_offloads_forced(out.plan)
    np.testing.assert_array_equal(out.ids, want)
    one = generate(*args, weights=weights, page_size=4, plan=steps(1))
    unrolled = generate(*args, weights=weights, page_size=4)
    np.testing.assert_array_equal(out.new_ids, one.new_ids)
    np.testing.assert_array_equal(out.new_ids, unrolled.new_ids)
    stats = out.stats
    assert stats.devices == 2 and stats.way == "steps" and stats.plans == len(out.plan.plans)
    assert stats.simulated_seconds > 0 and stats.transfers.weight_reload > 0
    assert "summed over 2 devices" in dict(stats.rows())["weights streamed"]
    each = out.plan.device_stats()
    assert [d.device for d in each] == [0, 1]
    assert all(0 < d.peak_bytes <= d.budget for d in each)
    assert sum((d.transfers for d in each), Transfers()) == stats.transfers
    assert max(d.finish_seconds for d in each) == pytest.approx(stats.simulated_seconds)
    assert sum(d.sent_bytes for d in each) == sum(d.received_bytes for d in each) > 0


@pytest.mark.parametrize(
    "model, planning",
    [("llama", steps(2, chunk_steps=2)), ("gpt2", steps(2, bucket_pages=2))],
    ids=["chunks-of-2-steps", "buckets-of-2-pages"],
)
def test_chunks_and_buckets_on_two_devices_equal_one_device_tokens_and_logits(model, planning):
    cfg, weights, ids, want = model_case(model, seed=1)
    out = generate(cfg, ids, NEW_TOKENS, "50%", weights=weights, page_size=2, logits=True,
                   plan=planning)  # fmt: skip
    chunks = out.plan.chunks
    if planning.chunk_steps > 1:
        assert chunks[0].steps == 2
    else:  # a bucket's plan serves several steps
        assert len(out.plan.decoders) < len(chunks)
    np.testing.assert_array_equal(out.ids, want)
    one = generate(cfg, ids, NEW_TOKENS, "50%", weights=weights, page_size=2, logits=True,
                   plan=Planning(way="steps", chunk_steps=planning.chunk_steps,
                                 bucket_pages=planning.bucket_pages))  # fmt: skip
    assert relative_error(out.logits, one.logits) <= TOLERANCE


@pytest.mark.parametrize("devices", [3, 4])
def test_three_and_four_devices_equal_one_device_step_plans_and_the_unrolled_generation(devices):
    """A 4-layer LLaMA (random weights, sharpened), sampled, each device in random order
    on 3 devices."""
    cfg = llama.LlamaConfig(32, 4, 4, 2, 48, vocab_size=64, name="llama-4-layers")
    weights = {n: w * 10 if w.ndim > 1 else w for n, w in random_weights(cfg, "float32", 3).items()}
    ids = np.random.default_rng(devices).integers(0, cfg.vocab_size, (2, 5))
    sampling = Sampling(temperature=1.0, top_k=8, seed=7) if devices == 3 else None
    mode = "random" if devices == 3 else None
    args = (cfg, ids, 5, "50%")
    out = generate(*args, weights=weights, page_size=2, sampling=sampling, plan=steps(devices),
                   run=Running(mode=mode))  # fmt: skip
    assert out.plan.devices == devices
    placed = weight_devices(out.plan.prefill)
    assert {d for ds in placed.values() for d in ds} == set(range(devices))
    one = generate(*args, weights=weights, page_size=2, sampling=sampling, plan=steps(1))
    unrolled = generate(*args, weights=weights, page_size=2, sampling=sampling)
    np.testing.assert_array_equal(out.new_ids, one.new_ids)
    np.testing.assert_array_equal(out.new_ids, unrolled.new_ids)


def test_a_stop_id_ends_the_loop_on_the_devices_early(monkeypatch):
    """One sequence stopping at its second token: the prefill and one decode run, no more
    (the runs of every device counted), and the stats of those runs."""
    cfg, weights, ids, want = model_case("llama", batch=1, seed=3)
    new = want[:, ids.shape[1] :]
    eos = int(new[0, 1])
    kept = next(t + 1 for t in range(NEW_TOKENS) if new[0, t] == eos)
    assert kept < NEW_TOKENS
    runs = []
    real = runtime.multi.LocalDevices.run

    def counted(self, inputs, *, plan=None, timeout=None):
        runs.append(plan)
        return real(self, inputs, plan=plan, timeout=timeout)

    monkeypatch.setattr(runtime.multi.LocalDevices, "run", counted)
    out = generate(cfg, ids, NEW_TOKENS, "50%", weights=weights, page_size=4, eos=eos,
                   plan=steps(2))  # fmt: skip
    assert runs[0] == "prefill" and len(runs) == kept
    np.testing.assert_array_equal(out.new_ids, new[:, :kept])
    assert list(out.new_lengths) == [kept] and out.stats.tokens == kept
    whole = out.plan.stats()
    assert out.stats.simulated_seconds < whole.simulated_seconds


def test_the_weights_are_staged_once_per_device_and_pages_only_where_read(monkeypatch):
    cfg = llama.PRESETS["tiny"]
    weights = random_weights(cfg, "float32", 2)
    ids = np.random.default_rng(2).integers(0, cfg.vocab_size, (1, 6))
    staged: list[tuple[int, str]] = []
    real = runtime.multi.DeviceRunner.stage

    def recorded(self, arrays):
        staged.extend((self.device, name) for name in arrays)
        return real(self, arrays)

    monkeypatch.setattr(runtime.multi.DeviceRunner, "stage", recorded)
    out = generate(cfg, ids, 6, "50%", weights=weights, page_size=2, plan=steps(2))
    plan = out.plan
    readers = {}
    for compiled in plan.plans.values():
        for part in compiled.plan.placed.parts:
            for name in part.tg.inputs:
                readers.setdefault(name, set()).add(part.device)
    for name, devices in weight_devices(plan.prefill).items():
        assert sorted(d for d, n in staged if n == name) == list(devices), name
    assert {d for d, n in staged if n in weights} == {0, 1}  # each device has its share
    for device, name in staged:
        assert device in readers[name], (device, name)  # pages and tables where read
    pages = {
        name
        for decoder in plan.decoders.values()
        for name, task_id in decoder.program.inputs.items()
        if fact_of(decoder.program[task_id], KVPage) is not None
    }
    assert pages and pages <= {name for _, name in staged}
    for name in pages:  # a page on its layer's device only
        assert {d for d, n in staged if n == name} == readers[name] and len(readers[name]) == 1


def test_on_two_ray_actors(cluster):
    cfg, weights, ids, want = model_case("gpt2", seed=2)
    out = generate(cfg, ids, NEW_TOKENS, "50%", weights=weights, page_size=4,
                   plan=steps(2, chunk_steps=2), run=Running(runner="ray"))  # fmt: skip
    assert out.plan.runner == "ray"
    np.testing.assert_array_equal(out.ids, want)


def test_the_command_line_runs_step_plans_on_two_devices(capsys, tmp_path):
    """`einpage generate --way steps --devices 2 --run` chooses the tokens of one device's
    step plans (a preset's random weights, the same seed), writes each plan's file for
    several devices, and `einpage run` checks one of them."""
    argv = ["generate", "llama:tiny", "--budget", "50%", "--way", "steps", "--new-tokens", "4",
            "--page-size", "4", "--prompt-len", "5", "--batch", "2", "--seed", "3", "--run",
            "--backend", "numpy"]  # fmt: skip
    code, out, err = cli(capsys, *argv, "--devices", "2", "-o", tmp_path / "plan.json")
    assert code == EXIT_OK, err
    assert "generation (steps, on 2 devices)" in out and "devices (prefill plan)" in out
    assert "2 devices, each in a thread of this process" in out
    assert "wrote prefill plan for 2 devices" in out
    code, alone, err = cli(capsys, *argv)
    assert code == EXIT_OK, err
    for got, want in zip(printed_tokens(out), printed_tokens(alone), strict=True):
        np.testing.assert_array_equal(got, want)
    prefill = tmp_path / "plan.prefill.json"
    code, _, err = cli(capsys, "run", prefill, "--random-inputs", "1", "--check")
    assert code == EXIT_OK, err


# -- refusals ----------------------------------------------------------------------------

CFG = llama.PRESETS["tiny"]  # two layers
PROMPT = np.zeros((1, 4), np.int64)


def test_step_plans_on_several_devices_are_planned_not_refused():
    planned = generate(CFG, PROMPT, 3, "100%", page_size=4, plan=steps(2), run=None)
    assert isinstance(planned.plan, DevicesStepPlans)
    assert "DevicesStepPlans" in repr(planned.plan) and "2 devices" in repr(planned.plan)
    assert planned.plan.on("ray").runner == "ray"
    assert set(planned.plan.budgets) == set(planned.plan.plans)


def test_more_devices_than_layers_are_refused():
    words = "3 devices needs at least 3 layers; 'llama-tiny' has 2"
    with pytest.raises(GenerationError, match=words):
        generate(CFG, PROMPT, 3, "1MiB", plan=steps(3), run=None)


def test_a_device_budget_below_its_smallest_names_the_device_and_the_plan():
    planning = steps(2, options={"partition": "off"})
    with pytest.raises(DeviceBudgetError) as caught:
        generate(CFG, PROMPT, 3, "4KiB", page_size=4, plan=planning, run=None)
    err = caught.value
    message = str(err)
    assert f"device {err.device}" in message and f"{err.needed} B" in message
    assert message.startswith("the prefill plan of ")
    assert err.needed > err.budget == 4096


def test_weights_placed_apart_in_two_step_plans_are_refused(monkeypatch):
    real = generation.weight_devices

    def moved(compiled):
        found = real(compiled)
        if compiled.program.name.startswith(f"{CFG.name}-decode"):
            name = next(iter(found))
            found[name] = tuple(d + 1 for d in found[name])
        return found

    monkeypatch.setattr(generation, "weight_devices", moved)
    with pytest.raises(GenerationError, match="in the prefill plan but .* in the decode"):
        generate(CFG, PROMPT, 3, "100%", page_size=4, plan=steps(2), run=None)


def test_the_streams_mode_is_refused_when_step_plans_on_devices_run():
    cfg, weights, ids, _ = model_case("llama")
    planned = generate(cfg, ids, 2, "100%", page_size=4, plan=steps(2), run=None)
    with pytest.raises(DevicesNotBuiltError, match="mode 'streams' is not built"):
        planned.plan.run(weights, ids, mode="streams")
