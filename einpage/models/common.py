"""Program pieces every model family shares: the prefill scaffolding, the layer loop, the
logits head, causal attention, and the checks of `prefill_program`/`prefill_inputs`.

A family's `prefill_program` reads as: `begin_prefill` (check the arguments, make the
program, declare the tokens), the family's own embedding, `decoder_layers` (scopes
`layers.{i}.attn` and `layers.{i}.mlp` around the family's attention and MLP), and
`logits_head` (scope `head`: the last position when asked, the final norm, the
projection onto the vocabulary, output "logits").

Attention is written with explicit indices – batch `b`, head `h` (or kv-head `g` and
group `r` for grouped-query attention), query position `q`, key position `k`, head
feature `e` – so a partitioning pass can split it by batch, head and query block. The
key index `k` is reduced only by the softmax's max and sum and by the product with V,
never split by the layout.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from einpage.models.base import ModelConfig
from einpage.models.checkpoint import to_numpy
from einpage.models.errors import ConfigError
from einpage.program import ops
from einpage.program.program import Program, Tensor
from einpage_core.errors import ProgramError
from taskgraph import dtypes
from taskgraph.facts import Shard

__all__ = [
    "LOGITS",
    "Weight",
    "Positions",
    "Heads",
    "Decoder",
    "Prefill",
    "begin_prefill",
    "decoder_layers",
    "decoder_layer",
    "logits_head",
    "head_logits",
    "token_ids",
    "causal_attention",
    "last_position",
    "check_prefill_args",
    "scaled",
    "weight_input",
    "cached_weight_input",
    "shard",
]

Weight = Callable[[str], Tensor]
"""`weight(name)`: declares the weight input `name` (with its shape) and returns it."""

LOGITS = ("all", "last")
"""What `prefill_program(..., logits=...)` may return: every position's logits, or the last's."""


def causal_attention(q: Tensor, k: Tensor, v: Tensor, keys: Tensor | None = None) -> Tensor:
    """`softmax(q kᵀ + causal mask) v` per batch and head; `q` is already scaled by
    1/sqrt(head_dim). `keys` [b, k] (1 at a sequence's real positions, 0 at its left
    padding: a ragged batch) also masks the padding: a padded key's score is replaced by
    `decode.masked_score`, as the paged attention's masks do, so its weight is exactly 0.

    Multi-head: q, k, v are [b, h, s, e]; the specs are `bhqe,bhke->bhqk` and
    `bhqk,bhke->bhqe`. Grouped-query: q is [b, g, r, s, e] (kv-head g, group member r)
    and k, v are [b, g, s, e]; the specs are `bgrqe,bgke->bgrqk` and `bgrqk,bgke->bgrqe`,
    so K and V are shared by the r query heads of a group without being repeated.
    Returns the attention output with q's shape.
    """
    prog = q.program
    if q.ndim == 5:
        qh, kh = "bgr", "bg"
    elif q.ndim == 4:
        qh, kh = "bh", "bh"
    else:
        raise ProgramError(f"causal_attention: q must have rank 4 or 5, got shape {q.shape}")
    scores = prog.einsum(f"{qh}qe,{kh}ke->{qh}qk", q, k, label="scores")
    if keys is not None:
        from einpage.models.decode import masked_score

        floor = masked_score(scores.dtype)
        scores = prog.einsum(
            f"{qh}qk,bk->{qh}qk", scores, keys, join=f"where(b, a, {floor!r})", label="padding"
        )
    probs = ops.softmax(ops.causal_mask(scores), axis=-1)
    return prog.einsum(f"{qh}qk,{kh}ke->{qh}qe", probs, v, label="attn")


def last_position(x: Tensor) -> Tensor:
    """The hidden states of the last position: [b, s, d] -> [b, d] (a slice, then a view)."""
    prog = x.program
    batch, seq, width = x.shape
    if seq > 1:
        x = prog.slice(x, (0, seq - 1, 0), (batch, 1, width), label="last")
    return prog.view(x, (batch, width))


def check_prefill_args(batch: Any, seq: Any, dtype: Any, logits: Any) -> str:
    """Validate `prefill_program` arguments; returns the canonical dtype name."""
    for what, value in (("batch", batch), ("seq", seq)):
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ProgramError(f"prefill_program: {what} must be a positive int, got {value!r}")
    name = dtypes.canonical(dtype)
    if not dtypes.is_float(name):
        raise ProgramError(f"prefill_program: dtype must be a float type, got {name}")
    if logits not in LOGITS:
        raise ProgramError(f"prefill_program: logits must be one of {LOGITS}, got {logits!r}")
    return name


def token_ids(tokens: Any) -> np.ndarray:
    """The token ids of `prefill_inputs` as an int64 array [batch, seq] (a NumPy array or
    a torch tensor); `ConfigError` for another rank or a non-integer dtype."""
    ids = to_numpy(tokens)
    if ids.ndim != 2 or not np.issubdtype(ids.dtype, np.integer):
        raise ConfigError(
            f"prefill_inputs: tokens must be an integer array [batch, seq], got "
            f"{ids.dtype}{list(ids.shape)}"
        )
    return ids.astype(np.int64)


def scaled(join: str, factor: float) -> str:
    """`join` multiplied by `factor` (left alone when the factor is 1)."""
    return join if factor == 1.0 else f"({join}) * {float(factor)!r}"


def weight_input(
    prog: Program,
    shapes: Mapping[str, tuple[int, ...]],
    dtype: str,
    quant: Any = None,
    quantized: Collection[str] = (),
) -> Weight:
    """A function `weight(name)` declaring the weight input `name` with its shape; with
    `quant` (an `einpage.program.quantize.Quantization`), the weights named in `quantized`
    (the model's `quantized_weights()`) are declared as their quantized inputs and rebuilt
    on the device (`dequantized_weight`). `quant` may also map weight names to their
    own quantizations (a GGUF file's tensors each have their type): those named are
    quantized, the others are not."""
    from einpage.program.quantize import dequantized_weight

    def weight(name: str) -> Tensor:
        chosen = quant.get(name) if isinstance(quant, Mapping) else quant
        if chosen is not None and (name in quantized or isinstance(quant, Mapping)):
            return dequantized_weight(prog, name, shapes[name], dtype, chosen)
        return prog.input(name, shapes[name], dtype, role="weight")

    return weight


def cached_weight_input(
    prog: Program,
    shapes: Mapping[str, tuple[int, ...]],
    dtype: str,
    quant: Any = None,
    quantized: Collection[str] = (),
) -> Weight:
    """Like `weight_input`, but a weight asked for again is the same input: a generation
    program reads every weight once per step. A quantized weight (with `quant`, one
    named in `quantized`) declares its quantized inputs once and is rebuilt from them at
    every call (`rebuilt_weight`): each step's float weight is a transient of that step,
    so what stays on the host and crosses PCIe between steps is the quantized bytes.
    `quant` may map weight names to their own quantizations, as `weight_input`'s."""
    from einpage.program.quantize import quantized_weight_inputs, rebuilt_weight

    declared: dict[str, Tensor] = {}
    stored: dict[str, dict[str, Tensor]] = {}

    def weight(name: str) -> Tensor:
        chosen = quant.get(name) if isinstance(quant, Mapping) else quant
        if chosen is not None and (name in quantized or isinstance(quant, Mapping)):
            if name not in stored:
                stored[name] = quantized_weight_inputs(prog, name, shapes[name], dtype, chosen)
            return rebuilt_weight(prog, name, stored[name], shapes[name], chosen)
        if name not in declared:
            declared[name] = prog.input(name, shapes[name], dtype, role="weight")
        return declared[name]

    return weight


def shard(weight: Tensor, axis: int = 0) -> Tensor:
    """`weight` (as a `Weight` returns it: the input, or a quantized weight's float tensor
    rebuilt on the device, the one the einsums read) stating `taskgraph.facts.Shard(axis)`:
    tensor parallelism may split it along `axis` (attention's heads, the MLP's columns).
    A weight read again (`cached_weight_input`) states it once."""
    return weight.program.fact(weight, Shard(axis))


# -- what prefill and decode steps share ----------------------------------------------


@dataclass(frozen=True)
class Positions:
    """The positions of a chunk of tokens: `count` positions from `start`, known when the
    program is built, or – with `ids`, an int64 tensor [count] – given when it runs (one
    plan then serves every position, as a decode step plan reused across steps does).
    `ids` [batch, count] gives each sequence its own positions (a ragged batch, left
    padded): the rows are then [batch, count, width]."""

    count: int
    start: int = 0
    ids: Tensor | None = None

    def rows(self, table: Tensor, label: str = "") -> Tensor:
        """The rows of `table` [n, width] at these positions: [count, width] – the table
        itself when it is exactly those rows, else a slice (or a gather of `ids`, [batch,
        count, width] for ids per sequence)."""
        prog = table.program
        n, width = table.shape
        if self.ids is not None:
            return prog.gather(table, self.ids, label=label)
        if self.start == 0 and self.count == n:
            return table
        return prog.slice(table, (self.start, 0), (self.count, width), label=label)


@dataclass(frozen=True)
class Heads:
    """A layer's attention heads for a chunk of s positions: `q` [b, h, s, e] (or
    [b, g, r, s, e] with grouped-query attention), already scaled by 1/sqrt(e), and `k`,
    `v` [b, h, s, e] (or [b, g, s, e]): what a KV cache keeps."""

    q: Tensor
    k: Tensor
    v: Tensor


@dataclass(frozen=True)
class Decoder:
    """A family's program pieces over one program, shared by prefill chunks and decode
    steps (`einpage.models.generation` builds generation programs from them alone).

    A family's `decoder(cfg, prog, weight, dtype, positions)` makes one: it declares the
    program inputs its positions need for `positions` positions (LLaMA's rotary
    tables), and returns:

    * `features(where)`: what the blocks need of a chunk's `Positions` (LLaMA: the
      rotation tables; GPT-2: the position embeddings), computed once per chunk;
    * `embed(tokens, features)`: int64 ids [b, s] -> hidden states [b, s, d];
    * `qkv(x, prefix, features)`: the layer's normalized projections as `Heads`;
    * `attn_out(x, attention, prefix)`: the output projection of the attention (with
      q's shape) plus the residual;
    * `mlp(x, prefix)`: the MLP block with its residual;
    * `head(x)`: hidden states [b, d] -> logits [b, vocab] (final norm, projection);
    * `max_positions`: the most positions the model has (None: no limit).
    """

    features: Callable[[Positions], Any]
    embed: Callable[[Tensor, Any], Tensor]
    qkv: Callable[[Tensor, str, Any], Heads]
    attn_out: Callable[[Tensor, Tensor, str], Tensor]
    mlp: Callable[[Tensor, str], Tensor]
    head: Callable[[Tensor], Tensor]
    max_positions: int | None = None


# -- the prefill scaffolding -------------------------------------------------------------


@dataclass(frozen=True)
class Prefill:
    """A prefill program being built: the `prog`, its canonical float `dtype`, the
    `tokens` input (int64 [batch, seq]) and `weight(name)`, which declares a weight input
    with the shape the config's `weight_shapes` gives it."""

    prog: Program
    dtype: str
    tokens: Tensor
    weight: Weight


def begin_prefill(
    cfg: ModelConfig,
    batch: Any,
    seq: Any,
    dtype: Any,
    logits: Any,
    max_positions: int | None = None,
    quant: Any = None,
) -> Prefill:
    """Check `prefill_program`'s arguments (`seq` at most `max_positions` when the model
    has a longest prompt) and start the program `"{cfg.name}-prefill-b{batch}-s{seq}"`
    with its tokens input."""
    dtype = check_prefill_args(batch, seq, dtype, logits)
    if max_positions is not None and seq > max_positions:
        raise ProgramError(
            f"prefill_program: seq={seq} exceeds the model's {max_positions} positions"
        )
    suffix = ""
    if quant is not None:
        from einpage.program.quantize import Quantization

        if isinstance(quant, Mapping):
            shapes = cfg.weight_shapes()
            for name, chosen in quant.items():
                if name not in shapes:
                    raise ProgramError(f"prefill_program: quant names {name!r}, not a weight")
                if not isinstance(chosen, Quantization):
                    raise ProgramError(
                        f"prefill_program: quant[{name!r}] must be a Quantization, got {chosen!r}"
                    )
            suffix = "-quantized"
        elif not isinstance(quant, Quantization):
            raise ProgramError(
                f"prefill_program: quant must be an einpage.quantize.Quantization (or a "
                f"mapping of weight names to them), got {quant!r}"
            )
        else:
            suffix = f"-int{quant.bits}"
    prog = Program(f"{cfg.name}-prefill-b{batch}-s{seq}{suffix}")
    quantized = cfg.quantized_weights() if quant is not None else frozenset()
    weight = weight_input(prog, cfg.weight_shapes(), dtype, quant, quantized)
    tokens = prog.input("tokens", (batch, seq), "int64")
    return Prefill(prog, dtype, tokens, weight)


Block = Callable[[Tensor, str], Tensor]
"""`block(x, prefix) -> x`: a layer's attention or MLP; `prefix` is `"layers.{i}.attn."`
(or `.mlp.`), the start of its weights' names."""


def decoder_layers(x: Tensor, num_layers: int, attention: Block, mlp: Block) -> Tensor:
    """`num_layers` layers of `attention` then `mlp`, in scopes `layers.{i}.attn` and
    `layers.{i}.mlp`; returns the last layer's hidden states."""
    for i in range(num_layers):
        x = decoder_layer(x, i, attention, mlp)
    return x


def decoder_layer(x: Tensor, layer: int, attention: Block, mlp: Block) -> Tensor:
    """Layer number `layer` of `decoder_layers`: `attention` then `mlp`, in scopes
    `layers.{layer}.attn` and `layers.{layer}.mlp` (a caller that must know which layer it
    builds – a KV cache's pages say so – loops over the layers with this). The weights
    declared inside state the fact `Layer(layer)` (`Program.layer`)."""
    prog = x.program
    with prog.layer(layer), prog.scope(f"layers.{layer}"):
        with prog.scope("attn"):
            x = attention(x, f"layers.{layer}.attn.")
        with prog.scope("mlp"):
            x = mlp(x, f"layers.{layer}.mlp.")
    return x


def logits_head(
    x: Tensor,
    logits: str,
    norm: Callable[[Tensor], Tensor],
    table: Callable[[], Tensor],
) -> None:
    """The head, in scope `head`: the last position's hidden states when `logits` is
    "last", the final `norm`, then `bsd,vd->bsv` (or `bd,vd->bv`) against `table()`
    (the LM head, or the tied embedding), as the program's output "logits"."""
    prog = x.program
    with prog.scope("head"):
        if logits == "last":
            x = last_position(x)
        prog.output(head_logits(x, norm, table), "logits")


def head_logits(x: Tensor, norm: Callable[[Tensor], Tensor], table: Callable[[], Tensor]) -> Tensor:
    """`norm(x)` projected onto the vocabulary by `table()` [vocab, d]: `bsd,vd->bsv` for
    hidden states [b, s, d], `bd,vd->bv` for [b, d]."""
    h = norm(x)
    spec = "bsd,vd->bsv" if x.ndim == 3 else "bd,vd->bv"
    return x.program.einsum(spec, h, table(), label="logits")
