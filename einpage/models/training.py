"""Training steps of the model families: forward, cross-entropy loss, backward, update.

`training_program(cfg, batch, seq, optimizer)` is one optimizer step of a LLaMA or
GPT-2 model (any family of `einpage.models.FAMILIES`) as one einsum program:

1. the family's prefill forward pass over `tokens` [batch, seq] (its "logits" are not
   returned: they feed the loss);
2. the mean cross-entropy against `labels` [batch, seq] (`einpage.ops.cross_entropy`;
   every position counts, so pass the tokens shifted by one, as a causal LM trains),
   output "loss";
3. the backward pass (`Program.backward`, reverse accumulation over the program);
4. right after each weight's gradient is final, the optimizer's update of that weight
   (`einpage.optim`): the weight's states are inputs of role "state" named
   `"{state}.{weight}"` (e.g. `exp_avg.layers.0.attn.wq`) that start on the host and
   are read only there, each stating the domain of its values (`Optimizer.state_domain`:
   AdamW's `exp_avg_sq` is "nonnegative"), and the new weight and states are outputs named
   `"updated.{input}"`. `next_inputs(outputs)` turns them into the next step's inputs.

Placing each update right after its gradient keeps one weight's gradient alive at a
time (the update consumes it), so the plan's peak holds activations, not gradients.
Plan it with `outputs="host"` (`einpage.compile(step, budget, outputs="host")`): the
new weights and states are then written back to host memory as they are made.

>>> from einpage.models import llama
>>> from einpage.optim import AdamW
>>> tg = training_graph(llama.PRESETS["tiny"], 2, 8, AdamW())
>>> tg.name, tg[tg.outputs["loss"]].shape, "updated.exp_avg.embed" in tg.outputs
('llama-tiny-train-b2-s8', (), True)
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from einpage import ops
from einpage.models.base import ModelConfig, ModelFamily
from einpage.models.common import token_ids
from einpage.models.errors import ConfigError
from einpage.optim import Optimizer
from einpage.program import Program, Tensor
from einpage_core.errors import InputError
from taskgraph import dtypes
from taskgraph.graph import TaskGraph

__all__ = [
    "UPDATED",
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
"""Prefix of the outputs holding the new value of an input (a weight or a state)."""


def family_of(cfg: ModelConfig) -> ModelFamily:
    """The family of `einpage.models.FAMILIES` whose config class `cfg` is."""
    from einpage.models import FAMILIES

    for family in FAMILIES.values():
        if isinstance(cfg, family.config):
            return family
    known = ", ".join(f.config.__name__ for f in FAMILIES.values())
    raise ConfigError(f"no model family has the config {type(cfg).__name__} (known: {known})")


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
    tables), the weights, the optimizer's states and "step" (AdamW); outputs "loss" and
    `"updated.{name}"` for every weight and state."""
    prog = loss_program(cfg, batch, seq, dtype)
    name = dtypes.canonical(dtype)
    loss = prog.pop_output("loss")
    prog.output(loss, "loss")
    scalars = optimizer.scalars(prog, name)
    weights = [prog.input_tensor(w) for w in cfg.weight_shapes()]
    by_id = {t.id: w for t, w in zip(weights, cfg.weight_shapes(), strict=True)}

    def update(weight: Tensor, grad: Tensor) -> None:
        wname = by_id[weight.id]
        with prog.scope(weight.task.scope or "optim"):
            states = {
                s: prog.input(
                    state_name(s, wname),
                    weight.shape,
                    name,
                    role="state",
                    domain=optimizer.state_domain(s),
                )
                for s in optimizer.states
            }
            new = optimizer.update(prog, weight, grad, states, scalars)
        prog.output(new.weight, UPDATED + wname)
        for s, tensor in new.states.items():
            prog.output(tensor, UPDATED + state_name(s, wname))

    prog.backward(loss, weights, on_gradient=update)
    return prog


def training_graph(
    cfg: ModelConfig, batch: int, seq: int, optimizer: Optimizer, dtype: Any = "float32"
) -> TaskGraph:
    """`training_program(...).build()`, named `"{cfg.name}-train-b{batch}-s{seq}"`."""
    tg = training_program(cfg, batch, seq, optimizer, dtype).build()
    return TaskGraph(tg.tasks, tg.outputs, f"{cfg.name}-train-b{batch}-s{seq}")


def initial_states(
    cfg: ModelConfig, optimizer: Optimizer, dtype: Any = "float32"
) -> dict[str, np.ndarray]:
    """Every state input before the first step: zeros, as torch's optimizers start."""
    name = dtypes.canonical(dtype)
    return {
        state_name(s, w): np.zeros(shape, name)
        for w, shape in cfg.weight_shapes().items()
        for s in optimizer.states
    }


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
    family's prefill inputs (tokens, weights, ...), the labels, the states (zeros, the
    first step's, when None) and, for an optimizer that counts steps, "step" = `step`
    (1 on the first)."""
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
    inputs = family.prefill_inputs(cfg, ids, weights, name)
    inputs["labels"] = targets
    inputs.update(initial_states(cfg, optimizer, name) if states is None else states)
    if optimizer.counts_steps:
        inputs["step"] = np.array(step, name)
    return inputs


def next_inputs(outputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The new weights and states among a step's outputs, under their input names."""
    return {k[len(UPDATED) :]: v for k, v in outputs.items() if k.startswith(UPDATED)}
