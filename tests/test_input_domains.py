"""Each input states the domain of its values (`taskgraph.nodes.DOMAINS`, a typed field
of `Input` set where the input is made, kept by the TaskGraph JSON), and random inputs
respect it: AdamW's second moment is never drawn negative, so `einpage run
--random-inputs --check` on a training step computes no NaN."""

from __future__ import annotations

import json

import pytest

import einpage as ep
from einpage.cli.commands import EXIT_OK, main
from einpage.cli.presets import random_inputs
from einpage.models import llama
from einpage.program.optim import SGD, AdamW
from einpage.workloads.training import training_graph
from einpage_core.errors import DTypeError, ProgramError, SerializationError
from taskgraph import TaskGraph
from taskgraph.nodes import DOMAINS, Input


def domain_program() -> TaskGraph:
    prog = ep.Program("domains")
    xs = {
        "real": prog.input("real", (64, 32)),
        "nonnegative": prog.input("nonnegative", (64, 32), domain="nonnegative"),
        "positive": prog.input("positive", (64, 32), "float16", domain="positive"),
        "fraction": prog.input("fraction", (64, 32), "bfloat16", domain="fraction"),
        "count": prog.input("count", (64,), "int64", domain="positive"),
    }
    for name, x in xs.items():
        prog.output(x * 1, name + ".out")
    return prog.build()


def test_random_inputs_respect_each_inputs_domain():
    tg = domain_program()
    for seed in range(3):
        arrays = random_inputs(tg, seed)
        assert (arrays["real"] < 0).any()  # an unstated domain is any real value
        assert (arrays["nonnegative"] >= 0).all() and (arrays["nonnegative"] > 0).any()
        assert (arrays["positive"].astype("float32") > 0).all()
        fraction = arrays["fraction"].astype("float32")
        assert (fraction >= 0).all() and (fraction < 1).all()
        assert (arrays["count"] >= 1).all()


def test_the_domain_is_data_of_the_graph_and_survives_json():
    tg = domain_program()
    back = TaskGraph.from_json(tg.to_json())
    assert {n: back[i].op.domain for n, i in back.inputs.items()} == {
        "real": "real",
        "nonnegative": "nonnegative",
        "positive": "positive",
        "fraction": "fraction",
        "count": "positive",
    }
    assert 'input["fraction", activation, device, fraction]' in str(tg)
    assert 'input["real", activation, device]' in str(tg)


def test_json_written_before_domains_existed_still_loads_and_a_bad_one_is_refused():
    data = json.loads(domain_program().to_json())
    stated = [t for t in data["tasks"] if t["op"] == "input" and "domain" in t["attrs"]]
    assert stated, "the program states some domains"
    for task in stated:
        del task["attrs"]["domain"]
    old = TaskGraph.from_json(json.dumps(data))
    assert {old[i].op.domain for i in old.inputs.values()} == {"real"}
    data["tasks"][0]["attrs"]["domain"] = "small"
    with pytest.raises(SerializationError, match=r"tasks\[0\].*domain must be one of"):
        TaskGraph.from_json(json.dumps(data))
    data["tasks"][0]["attrs"]["domain"] = "real"
    data["tasks"][0]["attrs"]["colour"] = "red"
    with pytest.raises(SerializationError, match=r"domain optional\), got"):
        TaskGraph.from_json(json.dumps(data))


def test_a_domain_outside_the_closed_set_or_its_dtype_is_refused():
    prog = ep.Program()
    with pytest.raises(ProgramError, match="domain must be one of .*'fraction'.*got 'small'"):
        prog.input("x", (2,), domain="small")
    with pytest.raises(DTypeError, match="domain 'fraction' .* needs a float dtype, got int64"):
        prog.input("k", (2,), "int64", domain="fraction")
    assert set(DOMAINS) == {"real", "nonnegative", "positive", "fraction"}


@pytest.mark.parametrize(
    "optimizer, want",
    [
        (AdamW(), {"exp_avg": "real", "exp_avg_sq": "nonnegative"}),
        (SGD(momentum=0.9), {"momentum_buffer": "real"}),
    ],
)
def test_training_states_state_their_domain(optimizer, want):
    tg = training_graph(llama.PRESETS["tiny"], 1, 4, optimizer)
    states = [tg[i] for i in tg.inputs.values() if tg[i].op.role == "state"]
    assert len(states) == len(want) * len(llama.PRESETS["tiny"].weight_shapes())
    for task in states:
        state = next(s for s in want if task.op.name.startswith(s + "."))
        assert task.op.domain == want[state], task.line()


def test_einpage_run_with_random_inputs_checks_a_training_step(tmp_path, capsys):
    """AdamW's exp_avg_sq drawn negative made NaN weights (and `--check` said ok)."""
    tg = training_graph(llama.PRESETS["tiny"], 2, 8, AdamW())
    plan = tmp_path / "train.json"
    plan.write_text(ep.compile(tg, "100%", outputs="host").plan.to_json())
    arrays = random_inputs(tg, 0)
    squares = [n for n, i in tg.inputs.items() if tg[i].op.domain == "nonnegative"]
    assert squares and all((arrays[n] >= 0).all() for n in squares)
    code = main(["run", str(plan), "--backend", "numpy", "--random-inputs", "0", "--check"])
    captured = capsys.readouterr()
    assert code == EXIT_OK, captured.err
    assert "not finite" not in captured.out
    assert captured.out.count("  ok") == len(tg.outputs)
    assert all(isinstance(tg[i].op, Input) for i in tg.inputs.values())
