"""`generate(..., plan=Planning(devices=N))` and `einpage generate --devices N`: the
unrolled generation placed on several devices (`einpage.compile_devices`), each under a
budget below its resident peak, choosing the tokens that transformers' greedy `generate`
chooses with the same weights (tests/models' small random models and their `hf_greedy`);
in one process and on Ray actors; and the refusals: more devices than layers, a device's
budget below its smallest, a runner without devices, the "streams" mode. Step plans on
several devices: test_generate_devices_steps."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
from cli_runner import cli
from hypothesis import given, settings
from hypothesis import strategies as st

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("tokenizers")  # test_generate_api, whose hf_greedy is reused, needs it

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "models"))
from hf_models import TOLERANCE, hf_gpt2, hf_llama, relative_error  # noqa: E402
from test_generate_api import hf_greedy  # noqa: E402
from test_ragged import hf_reference, left_padded, model_of, prompts_of  # noqa: E402

import taskgraph  # noqa: E402
from einpage.cli.commands import EXIT_BAD_INPUT, EXIT_OK  # noqa: E402
from einpage.cli.generate import random_weights  # noqa: E402
from einpage.models import gpt2, llama  # noqa: E402
from einpage.models.decode import Sampling  # noqa: E402
from einpage.models.errors import GenerationError  # noqa: E402
from einpage.models.generation import generation_inputs  # noqa: E402
from einpage.workloads.generate import Planning, Running, generate  # noqa: E402
from einpage.workloads.generation import (  # noqa: E402
    DevicesNotBuiltError,
    DevicesPlan,
    Transfers,
)
from einpage_core.errors import UnsupportedError  # noqa: E402
from memgraph import read_budget  # noqa: E402
from memgraph.multi import DeviceBudgetError  # noqa: E402
from memgraph.options import PlanOptions  # noqa: E402

torch.set_num_threads(1)

HOST = PlanOptions(outputs="host")
MODELS = {
    "llama": (llama, llama.LlamaConfig, lambda: hf_llama("gqa-tied")),  # a tied head
    "gpt2": (gpt2, gpt2.GPT2Config, lambda: hf_gpt2("base")),
}
NEW_TOKENS = 4


def model_case(name: str, batch: int = 2, prompt_len: int = 5, seed: int = 0):
    """(config, converted weights, prompt ids, transformers' greedy ids) of a tiny model."""
    family, config, make = MODELS[name]
    hf = make()
    cfg = config.from_hf(hf.config)
    weights = family.weights_from_state_dict(cfg, hf.state_dict())
    ids = np.random.default_rng(seed).integers(0, cfg.vocab_size, (batch, prompt_len))
    return cfg, weights, ids, hf_greedy(hf, ids, NEW_TOKENS)


def reloads_at(plan: DevicesPlan, budget: str) -> list[int]:
    """Each device's reloaded bytes when the same generation is planned at `budget`."""
    again = generate(
        plan.spec.cfg, np.zeros((plan.spec.batch, plan.spec.prompt_len), np.int64),
        plan.spec.new_tokens, budget, page_size=plan.spec.page_size,
        plan=Planning(devices=plan.devices), run=None,
    )  # fmt: skip
    return [p.mg.stats.reload_bytes for p in again.plan.plan.plans]


def assert_offloads_forced(plan: DevicesPlan) -> None:
    """Every device's budget is below its graph's resident peak, and it reloads more than
    it does at 100% (something was evicted and brought back)."""
    for part, device in zip(plan.plan.placed.parts, plan.plan.plans, strict=True):
        resident = read_budget(part.tg, "100%", HOST).nbytes
        assert device.mg.stats.peak_bytes <= device.budget < resident
    at_budget = [p.mg.stats.reload_bytes for p in plan.plan.plans]
    resident = reloads_at(plan, "100%")
    assert all(got > full for got, full in zip(at_budget, resident, strict=True))


@pytest.mark.parametrize("model", sorted(MODELS))
def test_two_devices_generate_transformers_greedy_tokens_under_budgets_that_force_offloads(model):
    cfg, weights, ids, want = model_case(model)
    out = generate(cfg, ids, NEW_TOKENS, "50%", weights=weights, page_size=4,
                   plan=Planning(devices=2))  # fmt: skip
    assert isinstance(out.plan, DevicesPlan) and out.plan.devices == 2
    assert {(k.source, k.target) for k in out.plan.plan.links} == {(0, 1), (1, 0)}
    assert_offloads_forced(out.plan)
    np.testing.assert_array_equal(out.ids, want)
    assert out.new_ids.shape == (2, NEW_TOKENS)
    assert out.stats.devices == 2 and out.stats.tokens == 2 * NEW_TOKENS
    assert out.stats.simulated_seconds > 0 and out.stats.transfers.weight_reload > 0
    assert "summed over 2 devices" in dict(out.stats.rows())["weights streamed"]
    each = out.plan.device_stats()
    assert [d.device for d in each] == [0, 1]
    assert all(0 < d.peak_bytes <= d.budget for d in each)
    assert sum((d.transfers for d in each), Transfers()) == out.stats.transfers
    assert max(d.finish_seconds for d in each) == pytest.approx(out.stats.simulated_seconds)
    links = out.plan.plan.links
    assert sum(d.sent_bytes for d in each) == sum(d.received_bytes for d in each) > 0
    assert sum(d.sent_bytes for d in each) == sum(k.nbytes for k in links)


def test_a_budget_per_device_in_random_order_chooses_the_same_tokens():
    cfg, weights, ids, want = model_case("llama", batch=3, prompt_len=6, seed=4)
    out = generate(cfg, ids, NEW_TOKENS, ["45%", "60%"], weights=weights, page_size=4,
                   plan=Planning(devices=2), run=Running(mode="random"))  # fmt: skip
    np.testing.assert_array_equal(out.ids, want)
    parts = out.plan.plan.placed.parts
    budgets = ["45%", "60%"]
    asked = [read_budget(part.tg, b, HOST).nbytes for part, b in zip(parts, budgets, strict=True)]
    assert [p.budget for p in out.plan.plan.plans] == asked


def test_a_ragged_batch_on_two_devices_matches_transformers_tokens_and_logits():
    """Prompts of different lengths, left padded (tests/models/test_ragged's reference:
    transformers given the padded ids and their attention mask), each step's logits out."""
    hf, _, cfg, weights = model_of("llama")
    rows = prompts_of(cfg)
    ids, mask = left_padded(rows)
    want_ids, want_logits = hf_reference(hf, ids, mask, NEW_TOKENS)
    out = generate(cfg, [list(r) for r in rows], NEW_TOKENS, "40%", weights=weights,
                   page_size=4, logits=True, plan=Planning(devices=2))  # fmt: skip
    assert out.spec.ragged and out.plan.devices == 2
    np.testing.assert_array_equal(out.new_ids, want_ids)
    assert relative_error(out.logits, want_logits) <= TOLERANCE


def test_sampling_on_two_devices_equals_the_reference_evaluator():
    cfg = llama.PRESETS["tiny"]
    weights = {n: w * 10 if w.ndim > 1 else w for n, w in random_weights(cfg, "float32", 1).items()}
    ids = np.random.default_rng(5).integers(0, cfg.vocab_size, (2, 6))
    sampling = Sampling(temperature=0.9, top_k=20, seed=4)
    out = generate(cfg, ids, 5, "50%", weights=weights, page_size=4, sampling=sampling,
                   plan=Planning(devices=2))  # fmt: skip
    spec = out.spec
    inputs = generation_inputs(llama.FAMILY, cfg, ids, 5, "float32", weights, spec.gumbel())
    want = taskgraph.evaluate(spec.generation_program().build(), inputs)["ids"]
    np.testing.assert_array_equal(out.new_ids, want)
    greedy = generate(cfg, ids, 5, "50%", weights=weights, page_size=4,
                      plan=Planning(devices=2)).new_ids  # fmt: skip
    assert not np.array_equal(out.new_ids, greedy)  # the noise was used


def test_a_sequence_stops_at_its_end_of_sequence_id_on_two_devices():
    """The unrolled plan runs whole on the devices; each sequence keeps its tokens up to
    its first end-of-sequence id, later ones are the pad id (here the eos id), as
    worked out here from transformers' ids."""
    cfg, weights, ids, want = model_case("llama")
    new = want[:, ids.shape[1] :]
    eos = int(new[0, 1])
    kept = [next((t + 1 for t in range(NEW_TOKENS) if row[t] == eos), NEW_TOKENS) for row in new]
    expected = new[:, : max(kept)].copy()
    for b, n in enumerate(kept):
        expected[b, n:] = eos
    out = generate(cfg, ids, NEW_TOKENS, "50%", weights=weights, page_size=4, eos=eos,
                   plan=Planning(devices=2))  # fmt: skip
    assert kept[0] <= 2 and list(out.new_lengths) == kept
    np.testing.assert_array_equal(out.new_ids, expected)
    assert out.stats.tokens == sum(kept)


@st.composite
def placed_generations(draw):
    """A random small LLaMA (2-3 layers, random weights), prompt and generation, placed
    on 2 .. layers devices at a budget of 45-100% of each device's resident peak, run in
    ready or random order, greedy or sampled."""
    layers = draw(st.integers(2, 3))
    kv_heads = draw(st.sampled_from([1, 2, 4]))
    cfg = llama.LlamaConfig(32, layers, 4, kv_heads, 48, vocab_size=64, name="llama-drawn")
    seed = draw(st.integers(0, 2**16))
    drawn = random_weights(cfg, "float32", seed)
    weights = {n: w * 10 if w.ndim > 1 else w for n, w in drawn.items()}  # sharper tokens
    batch, prompt_len = draw(st.integers(1, 2)), draw(st.integers(1, 6))
    ids = np.random.default_rng(seed).integers(0, cfg.vocab_size, (batch, prompt_len))
    sampling = None
    if draw(st.booleans()):
        sampling = Sampling(temperature=1.0, top_k=draw(st.integers(2, 8)), seed=seed)
    return {
        "cfg": cfg, "weights": weights, "ids": ids, "new_tokens": draw(st.integers(1, 4)),
        "devices": draw(st.integers(2, layers)), "budget": f"{draw(st.integers(45, 100))}%",
        "mode": draw(st.sampled_from([None, "random"])), "sampling": sampling,
        "page_size": draw(st.sampled_from([2, 4])),
    }  # fmt: skip


@settings(max_examples=12, deadline=None)
@given(placed_generations())
def test_random_generations_on_several_devices_equal_the_reference_evaluator(case):
    cfg, ids, new_tokens = case["cfg"], case["ids"], case["new_tokens"]
    out = generate(
        cfg, ids, new_tokens, case["budget"], weights=case["weights"],
        page_size=case["page_size"], sampling=case["sampling"],
        plan=Planning(devices=case["devices"]), run=Running(mode=case["mode"]),
    )  # fmt: skip
    assert out.plan.devices == case["devices"]
    inputs = generation_inputs(llama.FAMILY, cfg, ids, new_tokens, "float32", case["weights"],
                               out.spec.gumbel())  # fmt: skip
    want = taskgraph.evaluate(out.spec.generation_program().build(), inputs)["ids"]
    np.testing.assert_array_equal(out.new_ids, want)


def test_on_two_ray_actors(cluster):
    cfg, weights, ids, want = model_case("gpt2", seed=2)
    out = generate(cfg, ids, NEW_TOKENS, "50%", weights=weights, page_size=4,
                   plan=Planning(devices=2), run=Running(runner="ray"))  # fmt: skip
    assert out.plan.runner == "ray"
    np.testing.assert_array_equal(out.ids, want)


# -- refusals ----------------------------------------------------------------------------

CFG = llama.PRESETS["tiny"]  # two layers
PROMPT = np.zeros((1, 4), np.int64)


def test_more_devices_than_layers_are_refused():
    words = "3 devices needs at least 3 layers; 'llama-tiny' has 2"
    with pytest.raises(GenerationError, match=words):
        generate(CFG, PROMPT, 3, "1MiB", plan=Planning(devices=3), run=None)


def test_a_device_budget_below_its_smallest_names_the_device():
    planning = Planning(devices=2, options={"partition": "off"})
    with pytest.raises(DeviceBudgetError) as caught:
        generate(CFG, PROMPT, 3, "4KiB", page_size=4, plan=planning, run=None)
    err = caught.value
    assert f"device {err.device}" in str(err) and f"{err.needed} B" in str(err)
    assert err.needed > err.budget == 4096


@pytest.mark.parametrize(
    "make, words",
    [
        (lambda: Planning(devices=0), "devices must be a positive int, got 0"),
        (
            lambda: Planning(devices=2, options={"max_blocks": 9}),
            "'max_blocks' is einpage.compile's",
        ),
        (lambda: Running(runner="mpi"), "runner must be one of 'local', 'ray'"),
        (
            lambda: generate(CFG, PROMPT, 2, "1MiB", devices=2, run=None),
            "devices= is now plan=Planning\\(devices=2\\)",
        ),
        (
            lambda: generate(CFG, PROMPT, 2, "1MiB", weights={}, run=Running(runner="ray")),
            "give plan=Planning\\(devices=N\\)",
        ),
    ],
)
def test_bad_device_settings_are_refused(make, words):
    with pytest.raises(GenerationError, match=words):
        make()


def test_the_streams_mode_is_refused_on_several_devices_before_planning(monkeypatch):
    import einpage.workloads.generate as generate_module

    def never(*args, **kwargs):
        raise AssertionError("planned before the mode was checked")

    monkeypatch.setattr(generate_module, "plan_generation", never)
    cfg, weights, ids, _ = model_case("llama")
    with pytest.raises(DevicesNotBuiltError, match="mode='streams'\\) is not built") as caught:
        generate(cfg, ids, 2, "100%", weights=weights, page_size=4, plan=Planning(devices=2),
                 run=Running(mode="streams"))  # fmt: skip
    assert isinstance(caught.value, GenerationError)
    assert isinstance(caught.value, UnsupportedError)


def test_a_plan_for_several_devices_refuses_the_streams_mode_when_run():
    cfg, weights, ids, _ = model_case("llama")
    planned = generate(cfg, ids, 2, "100%", page_size=4, plan=Planning(devices=2), run=None)
    with pytest.raises(DevicesNotBuiltError, match="mode 'streams' is not built"):
        planned.plan.run(weights, ids, mode="streams")


def test_a_budget_per_device_needs_several_devices():
    with pytest.raises(GenerationError, match="a budget per device \\(2 given\\)"):
        generate(CFG, PROMPT, 2, ["1MiB", "1MiB"], run=None)


# -- the command line --------------------------------------------------------------------


def printed_tokens(out: str) -> tuple[np.ndarray, np.ndarray]:
    """(prompt ids, new ids) of the "tokens (prompt | new)" table."""
    rows = out.split("tokens (prompt | new)")[1].strip().splitlines()
    prompts, news = [], []
    for row in rows:
        _, line = row.split(maxsplit=1)
        head, tail = line.split(" | ")
        prompts.append([int(i) for i in head.split()])
        news.append([int(i) for i in tail.split()])
    return np.array(prompts), np.array(news)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A tiny random LLaMA checkpoint folder (save_pretrained), and its model."""
    hf = hf_llama("mha")
    folder = tmp_path_factory.mktemp("llama-mha")
    hf.save_pretrained(folder)
    return folder, hf


def generate_checkpoint(capsys, folder, *flags):
    """`einpage generate --checkpoint folder` on 2 devices at 50%, run (no eos stop)."""
    return cli(
        capsys, "generate", "--checkpoint", folder, "--batch", "2", "--prompt-len", "5",
        "--new-tokens", NEW_TOKENS, "--page-size", "4", "--budget", "50%", "--devices", "2",
        "--ignore-eos", "--run", "--backend", "numpy", *flags,
    )  # fmt: skip


def assert_greedy_tokens(out: str, hf) -> None:
    prompt, new = printed_tokens(out)
    np.testing.assert_array_equal(new, hf_greedy(hf, prompt, NEW_TOKENS)[:, prompt.shape[1] :])


def test_the_command_line_generates_on_two_devices_from_a_checkpoint(capsys, tmp_path, checkpoint):
    folder, hf = checkpoint
    plan_file = tmp_path / "two.json"
    code, out, err = generate_checkpoint(capsys, folder, "-o", plan_file)
    assert code == EXIT_OK, err
    assert "generation (unrolled, on 2 devices)" in out and "summed over 2 devices" in out
    assert "devices\n  device" in out and "2 devices, each in a thread of this process" in out
    assert f"wrote unrolled plan for 2 devices: {plan_file}" in out
    assert_greedy_tokens(out, hf)
    code, out, err = cli(capsys, "run", plan_file, "--random-inputs", "1", "--check")
    assert code == EXIT_OK, err


def test_the_command_line_generates_on_two_ray_actors(capsys, cluster, checkpoint):
    folder, hf = checkpoint
    code, out, err = generate_checkpoint(capsys, folder, "--ray", "--seed", "3")
    assert code == EXIT_OK, err
    assert "2 devices, each in a Ray actor" in out
    assert_greedy_tokens(out, hf)


@pytest.mark.parametrize(
    "argv, words",
    [
        (["--devices", "3"], "needs at least 3 layers"),
        (["--ray"], "--ray runs a generation placed on several devices"),
        (["--devices", "2", "--render", "plan.svg"], "--render draws the plan of one device"),
        (["--devices", "2", "--ray"], "--ray says where --run runs"),
        (["--devices", "2", "--run", "--mode", "streams"], "--mode streams is not built"),
    ],
)
def test_the_command_line_refuses_what_is_not_built(capsys, argv, words):
    code, _, err = cli(capsys, "generate", "llama:tiny", "--budget", "60%", *argv)
    assert code == EXIT_BAD_INPUT and words in err, err
