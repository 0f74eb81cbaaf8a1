"""Training steps of the model families: forward, cross-entropy loss, backward, update.

`training_program(cfg, batch, seq, optimizer)` is one optimizer step of a LLaMA or
GPT-2 model (any family of `einpage.models.FAMILIES`) as one einsum program:

1. the family's prefill forward pass over `tokens` [batch, seq] (its "logits" are not
   returned: they feed the loss);
2. the mean cross-entropy against `labels` [batch, seq] (`einpage.program.ops.cross_entropy`;
   every position counts, so pass the tokens shifted by one, as a causal LM trains),
   output "loss";
3. the backward pass (`Program.backward`, reverse accumulation over the program);
4. right after each weight's gradient is final, the optimizer's update of that weight
   (`einpage.program.optim`): the weight's states are inputs of role "state" named
   `"{state}.{weight}"` (e.g. `exp_avg.layers.0.attn.wq`) that start on the host and
   are read only there, each stating the domain of its values (`Optimizer.state_domain`:
   AdamW's `exp_avg_sq` is "nonnegative"), and the new weight and states are outputs named
   `"updated.{input}"`. `next_inputs(tg, outputs)` turns them into the next step's inputs.

What each tensor is, is stated as a fact (`taskgraph.facts`), not spelled in its name:
a state input is `OptimizerState(of=weight, state)`, a master weight
`MasterWeight(of=weight)`, a weight's gradient `Gradient(of=weight)` and each new value
`Update(of=input)`; `next_inputs` reads the updates. The names are for people.
   The optimizer's hyperparameters and step count are scalar inputs too (float32, or
   float64 for a float64 model, and int64: `Optimizer.inputs`), so a learning-rate
   schedule reuses one plan.

Mixed precision: a float16 or bfloat16 step runs its forward and backward passes in
that dtype but updates in float32 (`einpage.program.optim.update_dtype`), as mixed-precision
training does: every weight has a float32 master copy, the state "master" (input
`master.{weight}`, role "state", read only at the update, like the optimizer's states,
which are float32 too); the gradient is cast to float32, the optimizer updates the
master, and the new 16-bit weight `updated.{weight}` is the new master
`updated.master.{weight}` rounded to the model's dtype. float32 and float64 steps update
their weights in place of a master.

Placing each update right after its gradient keeps one weight's gradient alive at a
time (the update consumes it), so the plan's peak holds activations, not gradients.
Plan it with `outputs="host"` (`einpage.compile(step, budget, outputs="host")`): the
new weights and states are then written back to host memory as they are made.

>>> from einpage.models import llama
>>> from einpage.program.optim import AdamW
>>> tg = training_graph(llama.PRESETS["tiny"], 2, 8, AdamW())
>>> tg.name, tg[tg.outputs["loss"]].shape, "updated.exp_avg.embed" in tg.outputs
('llama-tiny-train-b2-s8', (), True)
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from einpage.models import family_of
from einpage.models.base import ModelConfig
from einpage.models.common import token_ids
from einpage.models.errors import ConfigError
from einpage.program import ops
from einpage.program.optim import Optimizer, update_dtype
from einpage.program.program import Program, Tensor
from einpage_core.errors import InputError
from taskgraph import dtypes
from taskgraph.facts import MasterWeight, OptimizerState, Update, facts_of
from taskgraph.graph import TaskGraph

__all__ = [
    "UPDATED",
    "MASTER",
    "is_mixed",
    "family_of",
    "loss_program",
    "training_program",
    "training_graph",
    "state_name",
    "initial_states",
    "training_inputs",
    "next_inputs",
]

UPDATED = "updated."
"""Prefix of the names of the outputs holding the new value of an input (a weight or a
state), for people: the outputs state `Update(of=input)`, which `next_inputs` reads."""
MASTER = "master"
"""The state holding a weight's float32 master copy in mixed-precision training."""


def is_mixed(dtype: Any) -> bool:
    """Whether a step of a model in `dtype` trains in mixed precision: a float32 update
    of float32 master weights (float16 and bfloat16; not float32 or float64)."""
    name = dtypes.canonical(dtype)
    return update_dtype(name) != name


def state_name(state: str, weight: str) -> str:
    """The input name of a weight's optimizer state: `"exp_avg.layers.0.attn.wq"`."""
    return f"{state}.{weight}"


def loss_program(cfg: ModelConfig, batch: int, seq: int, dtype: Any = "float32") -> Program:
    """The forward pass and its loss, without the backward: the family's prefill program
    whose logits feed the mean cross-entropy against the input `labels` [batch, seq],
    the output "loss" (scope `loss`). `taskgraph.grad` of it gives the gradients alone."""
    prog = family_of(cfg).prefill_program(cfg, batch, seq, dtype)
    logits = prog.pop_output("logits")
    with prog.scope("loss"):
        labels = prog.input("labels", (batch, seq), "int64")
        prog.output(ops.cross_entropy(logits, labels), "loss")
    return prog


def training_program(
    cfg: ModelConfig, batch: int, seq: int, optimizer: Optimizer, dtype: Any = "float32"
) -> Program:
    """One training step of `cfg` over `batch` sequences of `seq` tokens (see the module
    docstring): inputs `tokens`, `labels`, the family's other activations (LLaMA's RoPE
    tables), the weights, the optimizer's states (and the master weights in mixed
    precision), its hyperparameters (`optim.lr`, ...) and "step" (AdamW); outputs "loss"
    and `"updated.{name}"` for every weight and state."""
    prog = loss_program(cfg, batch, seq, dtype)
    name = dtypes.canonical(dtype)
    wide = update_dtype(name)
    mixed = is_mixed(name)
    loss = prog.pop_output("loss")
    prog.output(loss, "loss")
    scalars = optimizer.scalars(prog, wide)
    weights = [prog.input_tensor(w) for w in cfg.weight_shapes()]

    def state(kind: str, weight: Tensor) -> Tensor:
        input_name = state_name(kind, weight.task.op.name)
        domain = optimizer.state_domain(kind) if kind != MASTER else "real"
        tensor = prog.input(input_name, weight.shape, wide, role="state", domain=domain)
        fact = MasterWeight(weight.id) if kind == MASTER else OptimizerState(weight.id, kind)
        return prog.fact(tensor, fact)

    def updated(new: Tensor, old: Tensor) -> None:
        """`new` is the next value of the input `old`: stated, then output for the host."""
        prog.output(prog.fact(new, Update(old.id)), UPDATED + old.task.op.name)

    def update(weight: Tensor, grad: Tensor) -> None:
        with prog.scope(weight.task.scope or "optim"):
            master, wide_grad = weight, grad
            if mixed:  # the float32 update of the master copy, from the gradient in float32
                master = state(MASTER, weight)
                wide_grad = prog.einsum("...->...", grad, dtype=wide, label="grad.wide")
            states = {s: state(s, weight) for s in optimizer.states}
            new = optimizer.update(prog, master, wide_grad, states, scalars)
            weight_out = new.weight
            if mixed:  # the new weight: the new master rounded to the model's dtype
                weight_out = prog.einsum("...->...", new.weight, dtype=name, label="master.round")
        updated(weight_out, weight)
        if mixed:
            updated(new.weight, master)
        for s, tensor in new.states.items():
            updated(tensor, states[s])

    prog.backward(loss, weights, on_gradient=update)
    return prog


def training_graph(
    cfg: ModelConfig, batch: int, seq: int, optimizer: Optimizer, dtype: Any = "float32"
) -> TaskGraph:
    """`training_program(...).build()`, named `"{cfg.name}-train-b{batch}-s{seq}"`."""
    tg = training_program(cfg, batch, seq, optimizer, dtype).build()
    return TaskGraph(tg.tasks, tg.outputs, f"{cfg.name}-train-b{batch}-s{seq}")


def initial_states(
    cfg: ModelConfig,
    optimizer: Optimizer,
    dtype: Any = "float32",
    weights: Mapping[str, np.ndarray] | None = None,
) -> dict[str, np.ndarray]:
    """Every state input of a step in `dtype` before the first step: the optimizer's
    states as zeros, as torch's optimizers start, in the update's dtype (float32 for a
    16-bit model); in mixed precision (`is_mixed`) also the master weights, `weights`
    (give them in float32, e.g. from the checkpoint, so nothing is lost) in float32."""
    name = dtypes.canonical(dtype)
    wide = update_dtype(name)
    states = {
        state_name(s, w): np.zeros(shape, wide)
        for w, shape in cfg.weight_shapes().items()
        for s in optimizer.states
    }
    if is_mixed(name):
        missing = [w for w in cfg.weight_shapes() if w not in (weights or {})]
        if missing:
            raise ConfigError(
                f"initial_states: a {name} step trains in mixed precision and makes its "
                f"{wide} master weights from `weights`, which lacks {len(missing)} of them "
                f"(first {missing[0]!r})"
            )
        for w in cfg.weight_shapes():
            states[state_name(MASTER, w)] = np.asarray(weights[w]).astype(wide)
    return states


def training_inputs(
    cfg: ModelConfig,
    optimizer: Optimizer,
    tokens: Any,
    labels: Any,
    weights: Mapping[str, np.ndarray],
    states: Mapping[str, np.ndarray] | None = None,
    step: int = 1,
    dtype: Any = "float32",
) -> dict[str, np.ndarray]:
    """Every input of `training_program(cfg, *tokens.shape, optimizer, dtype)`: the
    family's prefill inputs (tokens, the float weights in `dtype`, ...), the labels, the
    states (`initial_states(cfg, optimizer, dtype, weights)`, the first step's, when
    None: in mixed precision the master weights are then `weights`, so give them in
    float32) and the optimizer's inputs (`Optimizer.inputs`: its hyperparameters, from the
    record, and "step" = `step`, 1 on the first, for one that counts steps). A schedule
    passes another record each step: `dataclasses.replace(optimizer, lr=...)`."""
    family = family_of(cfg)
    ids, targets = token_ids(tokens), token_ids(labels)
    if ids.shape != targets.shape:
        raise ConfigError(f"training_inputs: tokens {ids.shape} and labels {targets.shape} differ")
    outside = np.flatnonzero((targets < 0) | (targets >= cfg.vocab_size))
    if outside.size:  # the loss would pick no logit for it: refuse, never a silent wrong loss
        where = np.unravel_index(outside[0], targets.shape)
        raise InputError(
            f"training_inputs: label {int(targets[where])} at {tuple(map(int, where))} is "
            f"outside the vocabulary [0, {cfg.vocab_size}) ({outside.size} such labels)"
        )
    name = dtypes.canonical(dtype)
    in_dtype = {
        w: value.astype(name, copy=False) if dtypes.is_float_array(value.dtype) else value
        for w, value in ((w, np.asarray(v)) for w, v in weights.items())
    }
    inputs = family.prefill_inputs(cfg, ids, in_dtype, name)
    inputs["labels"] = targets
    inputs.update(initial_states(cfg, optimizer, name, weights) if states is None else states)
    inputs.update(optimizer.inputs(step, update_dtype(name)))
    return inputs


def next_inputs(tg: TaskGraph, outputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The new weights and states among the `outputs` of a step of `tg` (the training
    graph, or the graph a plan of it planned: `plan.taskgraph`), under the names of the
    inputs they are the next values of: the outputs that state `Update(of=input)`.

    >>> from einpage.models import gpt2
    >>> from einpage.program.optim import SGD
    >>> tg = training_graph(gpt2.PRESETS["tiny"], 1, 4, SGD())
    >>> out = {name: f"<{name}>" for name in tg.outputs}  # what a run returns, by name
    >>> next_inputs(tg, out)["layers.0.mlp.w_fc"]
    '<updated.layers.0.mlp.w_fc>'
    """
    if not isinstance(tg, TaskGraph):
        raise InputError(
            f"next_inputs(tg, outputs): tg must be the step's TaskGraph (its outputs say "
            f"which input each updates), got {type(tg).__name__}"
        )
    found = {}
    for name, task_id in tg.outputs.items():
        for fact in facts_of(tg[task_id], Update):
            if name not in outputs:
                raise InputError(
                    f"next_inputs: the step's output {name!r} (the next "
                    f"{tg[fact.of].op.name!r}) is not among the outputs given"
                )
            found[tg[fact.of].op.name] = outputs[name]
    return found
