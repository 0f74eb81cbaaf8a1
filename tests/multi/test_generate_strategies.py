"""Generation placed by tensor parallelism and by "auto" (`Planning(strategy=...)`,
`einpage generate --strategy`): the unrolled way and step plans, equal token for token
to transformers' greedy generation (the tiny models of test_generate_devices) and to
the pipeline's; the refusals of `Planning`."""

from __future__ import annotations

import numpy as np
import pytest
from test_generate_devices import NEW_TOKENS, cli, model_case, printed_tokens

from einpage.cli.commands import EXIT_OK
from einpage.models.errors import GenerationError
from einpage.workloads.generate import Planning, generate
from taskgraph.facts import TensorPart, fact_of


def tensor_parts(compiled) -> set[tuple[int, int]]:
    """The (index, count) of every TensorPart fact of a compiled plan's placed graph."""
    found = {fact_of(t, TensorPart) for t in compiled.graph} - {None}
    return {(f.index, f.count) for f in found}


@pytest.mark.parametrize("model", ["gpt2", "llama"])
@pytest.mark.parametrize("way", ["unrolled", "steps"])
def test_tensor_parallel_generation_chooses_transformers_tokens(model, way):
    cfg, weights, ids, want = model_case(model)
    planning = Planning(way=way, devices=2, strategy="tensor")
    out = generate(cfg, ids, NEW_TOKENS, "60%", weights=weights, page_size=4, plan=planning)
    np.testing.assert_array_equal(out.ids, want)
    for compiled in out.plan.plans.values():
        assert compiled.strategy == "tensor"
        assert tensor_parts(compiled) == {(0, 2), (1, 2)}
        assert len(compiled.plan.links) > 0  # partial sums cross between the devices


def test_auto_generation_keeps_the_fastest_strategy_and_its_tokens():
    cfg, weights, ids, want = model_case("llama")
    planning = Planning(devices=2, strategy="auto", cost_model="8xh100-sxm")
    out = generate(cfg, ids, NEW_TOKENS, "60%", weights=weights, page_size=4, plan=planning)
    np.testing.assert_array_equal(out.ids, want)
    (compiled,) = out.plan.plans.values()
    choice = compiled.choice
    assert set(choice.seconds) == {"pipeline", "tensor"}
    assert choice.chosen == min(choice.seconds, key=choice.seconds.get) == compiled.strategy


@pytest.mark.parametrize(
    "fields,needle",
    [
        ({"strategy": "ring", "devices": 2}, "strategy must be one of"),
        ({"strategy": "tensor"}, "give devices=N (N > 1) too"),
        ({"strategy": "auto", "devices": 2, "way": "steps"}, "strategy='auto' would choose"),
    ],
)
def test_planning_refuses_strategies_it_cannot_use(fields, needle):
    with pytest.raises(GenerationError, match=needle.replace("(", r"\(").replace(")", r"\)")):
        Planning(**fields)


def test_the_command_line_generates_tensor_parallel_the_pipeline_s_tokens(capsys):
    """The same random weights (--seed) and prompt: the tensor-parallel run prints the
    tokens the pipeline prints."""
    printed = {}
    for strategy in ("pipeline", "tensor"):
        code, out, err = cli(
            capsys, "generate", "llama:tiny", "--new-tokens", 3, "--devices", 2,
            "--strategy", strategy, "-b", "60%", "--run",
        )  # fmt: skip
        assert code == EXIT_OK, err
        assert f"{strategy} on 2 devices" in out
        printed[strategy] = printed_tokens(out)
    prompt, new = printed["tensor"]
    assert new.shape == (1, 3)
    np.testing.assert_array_equal(prompt, printed["pipeline"][0])
    np.testing.assert_array_equal(new, printed["pipeline"][1])
