"""Training steps equal PyTorch: the loss and gradients of the small random LLaMA and
GPT-2 models (`hf_models`) against `loss.backward()`, and the weights and states after
two `torch.optim.AdamW` / `torch.optim.SGD` (momentum, Nesterov) steps; then the same
step planned under budgets that force offloads (`einpage.compile`) and run on the NumPy
runtime in every mode, and partitioned whole.

Tolerances, float32: gradients within 1e-4 of each weight's gradient scale (floored at
1e-3 of the largest gradient: GPT-2's key bias has an analytically zero gradient, where
both sides hold rounding noise); weights and states within 2e-5 absolute. Mixed
precision (float16, bfloat16) has its own section and tolerances below.
"""

from __future__ import annotations

import copy
import functools
from dataclasses import replace

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from hf_models import hf_gpt2, hf_llama  # noqa: E402

import einpage as ep  # noqa: E402
import memgraph  # noqa: E402
import runtime  # noqa: E402
import taskgraph  # noqa: E402
from einpage.models import gpt2, llama  # noqa: E402
from einpage.program.optim import SGD, AdamW  # noqa: E402
from einpage.workloads.training import (  # noqa: E402
    MASTER,
    initial_states,
    loss_program,
    next_inputs,
    state_name,
    training_graph,
    training_inputs,
)
from memgraph import NodeKind, min_budget, streaming_minimum  # noqa: E402
from taskgraph.nodes import Input  # noqa: E402
from taskgraph.partition import partition, smallest_feasible_block_limit  # noqa: E402

torch.set_num_threads(1)

MODELS = {
    "llama-mha": (llama, lambda: hf_llama("mha")),
    "llama-gqa-tied": (llama, lambda: hf_llama("gqa-tied")),
    "gpt2-base": (gpt2, lambda: hf_gpt2("base")),
    "gpt2-n_inner": (gpt2, lambda: hf_gpt2("n_inner")),
}
BATCH, SEQ = 2, 7
# eps well above the rounding noise of GPT-2's key-bias gradient (zero in exact
# arithmetic, ~1e-9 here), which Adam's normalization would otherwise blow up to ±lr.
ADAMW = AdamW(lr=1e-2, betas=(0.8, 0.9), eps=1e-3, weight_decay=0.1)
OPTIMIZERS = {
    "adamw": ADAMW,
    "sgd-momentum": SGD(lr=0.1, momentum=0.9, weight_decay=0.01),
    "sgd-nesterov": SGD(lr=0.1, momentum=0.8, nesterov=True),
    "sgd": SGD(lr=0.1),
}


@functools.cache
def setup(model: str):
    """(family module, config, float32 weights, fresh HF model factory, tokens, labels)."""
    module, make = MODELS[model]
    hf = make()
    cfg = type(module.PRESETS["tiny"]).from_hf(hf.config)
    weights = module.weights_from_state_dict(cfg, hf.state_dict())
    rng = np.random.default_rng(len(model))
    tokens = rng.integers(0, cfg.vocab_size, (BATCH, SEQ))
    labels = rng.integers(0, cfg.vocab_size, (BATCH, SEQ))
    return module, cfg, weights, hf, tokens, labels


def torch_loss(hf, tokens: np.ndarray, labels: np.ndarray):
    logits = hf(torch.from_numpy(tokens)).logits
    flat = logits.reshape(-1, logits.shape[-1])
    return torch.nn.functional.cross_entropy(flat, torch.from_numpy(labels).reshape(-1))


def ours(module, cfg, tensors) -> dict[str, np.ndarray]:
    """HF-named tensors (parameters, gradients, states) in the program's layout."""
    return module.weights_from_state_dict(cfg, {k: v.detach() for k, v in tensors.items()})


def assert_gradients_close(got: dict, want: dict) -> None:
    largest = max(np.abs(w).max() for w in want.values())
    for name, w in want.items():
        scale = max(np.abs(w).max(), 1e-3 * largest)
        assert np.abs(got[name] - w).max() <= 1e-4 * scale, name


@pytest.mark.parametrize("model", sorted(MODELS))
def test_loss_and_gradients_equal_torch(model):
    module, cfg, weights, hf, tokens, labels = setup(model)
    names = list(cfg.weight_shapes())
    g = taskgraph.grad(loss_program(cfg, BATCH, SEQ).build(), "loss", names)
    inputs = training_inputs(cfg, SGD(), tokens, labels, weights)
    got = taskgraph.evaluate(g, {k: v for k, v in inputs.items() if k in g.inputs})
    hf.zero_grad()
    loss = torch_loss(hf, tokens, labels)
    loss.backward()
    assert abs(float(got["loss"]) - loss.item()) <= 1e-5 * abs(loss.item())
    grads = ours(module, cfg, {n: p.grad for n, p in hf.named_parameters()})
    assert_gradients_close({n: got["grad." + n] for n in names}, grads)


def torch_optimizer(optimizer, params):
    if isinstance(optimizer, AdamW):
        return torch.optim.AdamW(
            params,
            lr=optimizer.lr,
            betas=optimizer.betas,
            eps=optimizer.eps,
            weight_decay=optimizer.weight_decay,
        )
    return torch.optim.SGD(
        params,
        lr=optimizer.lr,
        momentum=optimizer.momentum,
        weight_decay=optimizer.weight_decay,
        nesterov=optimizer.nesterov,
    )


def torch_steps(model: str, optimizer, steps: int, lrs: list[float] | None = None):
    """Parameters and optimizer states (in the program's layout) after `steps` torch
    steps; the learning rate of step k is `lrs[k]` when given (a schedule)."""
    module, cfg, _, original, tokens, labels = setup(model)
    hf = copy.deepcopy(original)
    params = dict(hf.named_parameters())
    opt = torch_optimizer(optimizer, params.values())
    for step in range(steps):
        if lrs is not None:
            opt.param_groups[0]["lr"] = lrs[step]
        opt.zero_grad()
        torch_loss(hf, tokens, labels).backward()
        opt.step()
    result = ours(module, cfg, params)
    for state in optimizer.states:
        tensors = {n: opt.state[p][state] for n, p in params.items()}
        for w, value in ours(module, cfg, tensors).items():
            result[state_name(state, w)] = value
    return result


@pytest.mark.parametrize("optimizer", sorted(OPTIMIZERS))
@pytest.mark.parametrize("model", ["llama-gqa-tied", "gpt2-base"])
def test_two_training_steps_equal_torch_optim(model, optimizer):
    _, cfg, weights, _, tokens, labels = setup(model)
    opt = OPTIMIZERS[optimizer]
    tg = training_graph(cfg, BATCH, SEQ, opt)
    state = {**weights, **initial_states(cfg, opt)}
    for step in (1, 2):
        inputs = training_inputs(cfg, opt, tokens, labels, weights, step=step)
        inputs.update(state)
        state = next_inputs(tg, taskgraph.evaluate(tg, inputs))
    want = torch_steps(model, opt, 2)
    assert set(state) == set(want)
    for name, value in want.items():
        assert np.abs(state[name] - value).max() <= 2e-5, name


def test_the_training_step_updates_each_weight_right_after_its_gradient():
    _, cfg, *_ = setup("llama-gqa-tied")
    tg = training_graph(cfg, BATCH, SEQ, ADAMW)
    loss = tg.outputs["loss"]
    for task_id in tg.inputs.values():
        op = tg[task_id].op
        if op.role == "state":
            assert op.location == "host" and task_id > loss
            (reader,) = tg.consumers[task_id]  # read once, by the update
            assert tg[reader].label.startswith("adamw")
    # each update comes right after its gradient (only the two state inputs between)
    moments = [t for t in tg if t.label == "adamw.m"]
    assert len(moments) == len(cfg.weight_shapes())
    for m in moments:
        _, grad, _ = m.inputs  # exp_avg, the gradient, beta1
        assert m.id - grad <= 3, m.line()


# -- planned, run, partitioned ---------------------------------------------------------------


@functools.cache
def step_case(model: str, optimizer: str):
    _, cfg, weights, _, tokens, labels = setup(model)
    opt = OPTIMIZERS[optimizer]
    tg = training_graph(cfg, BATCH, SEQ, opt)
    inputs = training_inputs(cfg, opt, tokens, labels, weights, step=3)
    rng = np.random.default_rng(5)  # states of a run in progress
    for name in initial_states(cfg, opt):
        inputs[name] = rng.uniform(0.0, 1e-2, inputs[name].shape).astype("float32")
    return tg, inputs, taskgraph.evaluate(tg, inputs)


def assert_outputs_close(got: dict, want: dict) -> None:
    for name, value in want.items():
        scale = 1.0 + np.abs(value).max()
        assert np.abs(got[name] - value).max() <= 1e-5 * scale, name


def activations_offloaded(mg) -> int:
    """Offloads of forward tensors (not inputs, not outputs) that the backward reads."""
    tg = mg.taskgraph
    first_grad = min(t.id for t in tg if t.label.startswith("grad"))
    outputs = set(tg.outputs.values())
    return sum(
        1
        for node in mg.nodes
        if node.kind is NodeKind.OFFLOAD
        and node.tensor < first_grad
        and node.tensor not in outputs
        and not isinstance(tg[node.tensor].op, Input)
    )


@pytest.mark.parametrize("budget", ["min", "mid"])
@pytest.mark.parametrize("model", ["llama-gqa-tied", "gpt2-base"])
def test_planned_training_steps_offload_activations_and_run_in_every_mode(model, budget):
    tg, inputs, want = step_case(model, "adamw")
    smallest, _ = min_budget(tg)
    peak = streaming_minimum(tg, outputs="host")
    nbytes = smallest if budget == "min" else (smallest + peak) // 2
    compiled = ep.compile(tg, nbytes, outputs="host")
    mg = compiled.plan
    assert compiled.block_limit is None and mg.stats.peak_bytes <= nbytes < peak
    assert activations_offloaded(mg) > 0
    for mode in ("sequential", "threaded", "random"):
        got = runtime.run(mg, inputs, backend="numpy", mode=mode, seed=len(model))
        assert_outputs_close(got, want)


@pytest.mark.parametrize("model", ["llama-gqa-tied", "gpt2-base"])
def test_a_partitioned_training_step_computes_the_same(model):
    tg, inputs, want = step_case(model, "sgd-momentum")
    limit = 4 * smallest_feasible_block_limit(tg)
    parted = partition(tg, limit)
    assert len(parted) > len(tg)
    assert_outputs_close(taskgraph.evaluate(parted, inputs), want)


def test_a_training_step_planned_below_its_largest_task_is_partitioned_and_runs():
    tg, inputs, want = step_case("llama-gqa-tied", "sgd-momentum")
    smallest, _ = min_budget(tg)
    compiled = ep.compile(tg, smallest // 2, outputs="host")
    assert compiled.block_limit is not None
    got = runtime.run(compiled.plan, inputs, backend="numpy", mode="random")
    assert_outputs_close(got, want)


def test_written_back_outputs_are_not_reused_while_their_copy_runs():
    """With `outputs="host"` and memory to spare, no step waits for an output's write-back
    (its region is kept until the copy has ended), as a training step's many new weights
    and states need: the compute stream runs without a gap."""
    prog = ep.Program("write-backs")
    x = prog.input("x", (256, 256))
    h = x
    for i in range(6):
        w = prog.input(f"w{i}", (256, 256), location="device")
        prog.output(ep.tanh(prog.einsum("ij,jk->ik", h, w)), f"new{i}")
        h = ep.exp(h) * 0.5
    prog.output(ep.reduce_sum(h), "loss")
    tg = prog.build()
    compiled = ep.compile(tg, "16MiB", outputs="host")
    sim = memgraph.simulate(compiled.plan, "h100-pcie5", timeline=True)
    applies = sorted((e.start, e.end) for e in sim.events if e.stream == "compute")
    gaps = [b[0] - a[1] for a, b in zip(applies, applies[1:], strict=False)]
    assert max(gaps) < 1e-12


@pytest.mark.parametrize("bad", [-1, "vocab"])
def test_labels_outside_the_vocabulary_are_refused(bad):
    """The loss would pick no logit for such a label: a typed error names it."""
    _, cfg, weights, _, tokens, labels = setup(sorted(MODELS)[0])
    labels = np.array(labels)
    labels[0, 1] = cfg.vocab_size if bad == "vocab" else bad
    with pytest.raises(ep.InputError, match=r"label -?\d+ at \(0, 1\) is outside the vocabulary"):
        training_inputs(cfg, SGD(), tokens, labels, weights)


# -- mixed precision ---------------------------------------------------------------------
#
# A float16 or bfloat16 step runs forward and backward in that dtype and updates float32
# master weights with float32 states. Checked in two parts against PyTorch:
# * the gradients of the 16-bit forward/backward against float32 `loss.backward()`,
#   within 24 roundings of the dtype (u = 2^-8 bfloat16, 2^-11 float16) of each weight's
#   gradient scale, floored at 5% of the largest gradient (GPT-2's key bias has a zero
#   gradient in exact arithmetic: both sides hold noise there); the loss within 4u
#   relative. PyTorch's own 16-bit gradients (the model in that dtype) are held to the
#   same bound, so it is the dtype's noise, not slack.
# * the update: two steps whose masters and states equal `torch.optim` stepping float32
#   masters whose `.grad` is our 16-bit gradient cast to float32, within 1e-6 (float32
#   rounding; measured 1.2e-7), and whose 16-bit weights are the masters rounded.

MIXED = ("bfloat16", "float16")
ROUNDING = {"bfloat16": 2.0**-8, "float16": 2.0**-11}


def gradients(model: str, dtype: str, weights: dict) -> dict[str, np.ndarray]:
    """Our loss and gradients (`grad.{name}`) of the 16-bit program at `weights`."""
    _, cfg, _, _, tokens, labels = setup(model)
    names = list(cfg.weight_shapes())
    g = taskgraph.grad(loss_program(cfg, BATCH, SEQ, dtype).build(), "loss", names)
    inputs = training_inputs(cfg, SGD(), tokens, labels, weights, dtype=dtype)
    return taskgraph.evaluate(g, {k: v for k, v in inputs.items() if k in g.inputs})


@pytest.mark.parametrize("dtype", MIXED)
@pytest.mark.parametrize("model", sorted(MODELS))
def test_16_bit_gradients_are_within_the_dtypes_rounding_of_torch(model, dtype):
    module, cfg, weights, original, tokens, labels = setup(model)
    got = gradients(model, dtype, weights)
    exact, low = copy.deepcopy(original), copy.deepcopy(original).to(getattr(torch, dtype))
    want_loss, low_loss = torch_loss(exact, tokens, labels), torch_loss(low, tokens, labels)
    want_loss.backward()
    low_loss.backward()
    u = ROUNDING[dtype]
    assert abs(float(got["loss"]) - want_loss.item()) <= 4 * u * want_loss.item()
    want = ours(module, cfg, {n: p.grad for n, p in exact.named_parameters()})
    torch_low = ours(module, cfg, {n: p.grad.float() for n, p in low.named_parameters()})
    largest = max(np.abs(w).max() for w in want.values())
    for name, w in want.items():
        bound = 24 * u * max(np.abs(w).max(), 0.05 * largest)
        assert got["grad." + name].dtype == dtype
        assert np.abs(got["grad." + name].astype("float32") - w).max() <= bound, name
        assert np.abs(torch_low[name] - w).max() <= bound, name  # the bound is the dtype's


@pytest.mark.parametrize("dtype", MIXED)
@pytest.mark.parametrize("optimizer", ["adamw", "sgd-nesterov"])
@pytest.mark.parametrize("model", ["llama-gqa-tied", "gpt2-base"])
def test_mixed_precision_steps_update_float32_masters_as_torch(model, optimizer, dtype):
    _, cfg, weights, _, tokens, labels = setup(model)
    opt = OPTIMIZERS[optimizer]
    tg = training_graph(cfg, BATCH, SEQ, opt, dtype)
    names = list(cfg.weight_shapes())
    for name in names:  # 16-bit weights read by the forward pass, float32 masters and states
        assert tg[tg.inputs[name]].dtype == dtype
        master = tg[tg.inputs[state_name(MASTER, name)]]
        assert (master.dtype, master.op.role, master.op.location) == ("float32", "state", "host")
        assert {tg[tg.inputs[state_name(s, name)]].dtype for s in opt.states} <= {"float32"}
    params = {n: torch.nn.Parameter(torch.from_numpy(weights[n].copy())) for n in names}
    reference = torch_optimizer(opt, params.values())
    inputs = training_inputs(cfg, opt, tokens, labels, weights, step=1, dtype=dtype)
    for step in (1, 2):
        grads = gradients(model, dtype, {n: inputs[n] for n in names})
        state = next_inputs(tg, taskgraph.evaluate(tg, inputs))
        for name in names:
            params[name].grad = torch.from_numpy(grads["grad." + name].astype("float32"))
        reference.step()
        for name in names:
            master = state[state_name(MASTER, name)]
            assert np.abs(master - params[name].detach().numpy()).max() <= 1e-6, name
            np.testing.assert_array_equal(state[name], master.astype(dtype))
            for s in opt.states:
                want = reference.state[params[name]][s].numpy()
                assert np.abs(state[state_name(s, name)] - want).max() <= 1e-6, (s, name)
        inputs = training_inputs(cfg, opt, tokens, labels, weights, step=step + 1, dtype=dtype)
        inputs.update(state)


def test_a_planned_bfloat16_step_runs_on_the_numpy_runtime():
    _, cfg, weights, _, tokens, labels = setup("llama-gqa-tied")
    tg = training_graph(cfg, BATCH, SEQ, ADAMW, "bfloat16")
    inputs = training_inputs(cfg, ADAMW, tokens, labels, weights, step=1, dtype="bfloat16")
    want = taskgraph.evaluate(tg, inputs)
    smallest, _ = min_budget(tg)
    compiled = ep.compile(tg, smallest, outputs="host")
    got = runtime.run(compiled.plan, inputs, backend="numpy", mode="random", seed=3)
    for name, value in want.items():
        np.testing.assert_array_equal(got[name], value, err_msg=name)


def test_mixed_precision_needs_the_weights_for_its_masters():
    _, cfg, weights, *_ = setup("gpt2-base")
    with pytest.raises(ep.EinpageError, match=r"bfloat16 step trains in mixed precision .* lacks"):
        initial_states(cfg, ADAMW, "bfloat16")
    assert initial_states(cfg, ADAMW, "float32").keys() == {
        state_name(s, w) for s in ADAMW.states for w in cfg.weight_shapes()
    }


# -- hyperparameters and the step count as inputs ------------------------------------------


@pytest.mark.parametrize(
    "a, b",
    [
        (ADAMW, AdamW(lr=3e-4, betas=(0.5, 0.95), eps=1e-6, weight_decay=0.0)),
        (SGD(lr=0.1, momentum=0.9), SGD(lr=0.5, momentum=0.1, weight_decay=0.2)),
    ],
)
def test_hyperparameters_are_inputs_not_numbers_in_the_joins(a, b):
    """Two records with other values make the very same program (one plan serves both)."""
    _, cfg, *_ = setup("gpt2-base")
    assert (
        training_graph(cfg, BATCH, SEQ, a).to_json() == training_graph(cfg, BATCH, SEQ, b).to_json()
    )
    assert a.inputs(1, "float32") != b.inputs(1, "float32")


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32", "float64"])
def test_the_step_and_hyperparameters_are_never_16_bit(dtype):
    """The step count is int64 and the hyperparameters are float32 (float64 for a float64
    model), whatever the model's dtype: in bfloat16, step 257 read as 256."""
    _, cfg, *_ = setup("llama-gqa-tied")
    tg = training_graph(cfg, BATCH, SEQ, ADAMW, dtype)
    wide = "float64" if dtype == "float64" else "float32"
    got = {n: (tg[i].dtype, tg[i].op.domain) for n, i in tg.inputs.items() if n in ADAMW_INPUTS}
    assert got == {
        "step": ("int64", "positive"),
        "optim.lr": (wide, "nonnegative"),
        "optim.beta1": (wide, "fraction"),
        "optim.beta2": (wide, "fraction"),
        "optim.eps": (wide, "nonnegative"),
        "optim.weight_decay": (wide, "nonnegative"),
    }
    assert {n: v.dtype.name for n, v in ADAMW.inputs(257, wide).items()} == {
        n: dtype for n, (dtype, _) in got.items()
    }


ADAMW_INPUTS = ("step", "optim.lr", "optim.beta1", "optim.beta2", "optim.eps", "optim.weight_decay")


@pytest.mark.parametrize("dtype, step", [("bfloat16", 257), ("float16", 2049)])
def test_bias_correction_counts_steps_past_what_the_model_dtype_holds(dtype, step):
    """A bfloat16 (float16) step at t = 257 (2049), one past the last integer it holds
    exactly, equals torch's AdamW resumed at that step. Betas as float32 holds them (the
    program's hyperparameters are float32: 0.9999 is 0.99989998, and torch's double
    bias correction of 0.9999 itself differs by 1e-5 at this learning rate)."""
    _, cfg, weights, _, tokens, labels = setup("gpt2-base")
    betas = (float(np.float32(0.99)), float(np.float32(0.9999)))
    opt = AdamW(lr=0.1, betas=betas, eps=1e-3, weight_decay=0.1)
    names = list(cfg.weight_shapes())
    rng = np.random.default_rng(step)
    states = initial_states(cfg, opt, dtype, weights)  # states of a run in progress
    for name in names:
        states[state_name("exp_avg", name)] = rng.normal(0, 1e-2, weights[name].shape)
        states[state_name("exp_avg_sq", name)] = rng.uniform(0, 1e-3, weights[name].shape)
    states = {k: v.astype("float32") for k, v in states.items()}
    inputs = training_inputs(cfg, opt, tokens, labels, weights, states, step=step, dtype=dtype)
    tg = training_graph(cfg, BATCH, SEQ, opt, dtype)
    got = next_inputs(tg, taskgraph.evaluate(tg, inputs))
    grads = gradients("gpt2-base", dtype, {n: inputs[n] for n in names})

    def torch_masters(before: int) -> dict[str, np.ndarray]:
        params = {n: torch.nn.Parameter(torch.from_numpy(weights[n].copy())) for n in names}
        reference = torch_optimizer(opt, params.values())
        for name, p in params.items():
            p.grad = torch.from_numpy(grads["grad." + name].astype("float32"))
            reference.state[p] = {
                "step": torch.tensor(float(before)),
                "exp_avg": torch.from_numpy(states[state_name("exp_avg", name)].copy()),
                "exp_avg_sq": torch.from_numpy(states[state_name("exp_avg_sq", name)].copy()),
            }
        reference.step()
        return {n: p.detach().numpy() for n, p in params.items()}

    want, off_by_one = torch_masters(step - 1), torch_masters(step - 2)
    for name in names:
        master = got[state_name(MASTER, name)]
        assert np.abs(master - want[name]).max() <= 1e-6, name
    # the check can tell the step from its 16-bit rounding
    assert max(np.abs(want[n] - off_by_one[n]).max() for n in names) > 1e-5


@pytest.mark.parametrize("optimizer", ["adamw", "sgd-momentum"])
def test_a_learning_rate_schedule_runs_one_plan_and_equals_torch(optimizer):
    _, cfg, weights, _, tokens, labels = setup("llama-gqa-tied")
    opt = OPTIMIZERS[optimizer]
    lrs = [opt.lr, opt.lr * 0.3, opt.lr * 0.05]
    tg = training_graph(cfg, BATCH, SEQ, opt)
    smallest, _ = min_budget(tg)
    plan = ep.compile(tg, smallest, outputs="host").plan  # planned once
    state = {**weights, **initial_states(cfg, opt)}
    for step, lr in enumerate(lrs, start=1):
        inputs = training_inputs(cfg, replace(opt, lr=lr), tokens, labels, weights, step=step)
        inputs.update(state)
        state = next_inputs(plan.taskgraph, runtime.run(plan, inputs, backend="numpy"))
    want = torch_steps("llama-gqa-tied", opt, len(lrs), lrs)
    assert set(state) == set(want)
    for name, value in want.items():
        assert np.abs(state[name] - value).max() <= 2e-5, name
    # a constant learning rate ends elsewhere: the schedule is what was followed
    constant = torch_steps("llama-gqa-tied", opt, len(lrs))
    assert max(np.abs(constant[n] - want[n]).max() for n in cfg.weight_shapes()) > 1e-3


def test_a_step_count_below_one_is_refused():
    with pytest.raises(ep.InputError, match=r"AdamW: step must be an integer >= 1 .* got 0"):
        ADAMW.inputs(0, "float32")
    with pytest.raises(ep.InputError, match=r"got 2.5"):
        ADAMW.inputs(2.5, "float32")
