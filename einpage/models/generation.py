"""Generation programs for any family: a prefill and decode steps over a paged KV cache.

Both programs are built from a family's `common.Decoder` (its embedding, attention
projections, MLP and head – the same blocks its prefill program uses), so a family
that provides `decoder` (and `position_inputs`) in its `ModelFamily` generates.

* `generation_program(family, cfg, batch, prompt_len, new_tokens)`: the whole
  generation unrolled into one program – the prefill of the prompt, whose last
  position's logits give the first new token, then `new_tokens - 1` decode steps, each
  embedding the previous step's ids (an int64 tensor the previous step chose on the
  device: no host round trip from one token to the next), attending over the layer's KV
  pages (`einpage.models.decode`) and choosing the next ids. The ids are also kept for
  the `ids` output, planned like any tensor (under pressure, a plan may offload a
  step's ids and reload them for that output's concat). Planned once, the planner sees
  every future use of every weight and page. Scopes: `prefill.*`, `step{t}.*` (t = 1 ..
  new_tokens - 1), each with the family's `layers.{i}.attn`, `layers.{i}.mlp`, `head`.
* `decode_program(family, cfg, batch, pages, steps=1, positions=None)`: one decode
  step (or a chunk of `steps` consecutive ones) for any cache length up to
  `pages * page_size` – a length bucket – in a generation that fills `positions`
  positions (default: all the bucket reaches). The positions, the mask of filled cache
  positions and the pages are inputs, so one plan serves every step (chunk) of the
  bucket (`einpage.workloads.generation` runs the loop).

A generation of a prompt of P tokens and N new ones fills P + N - 1 positions (the last
new token is chosen, never fed back). Both programs check that against the model's
positions (GPT-2's learned ones) and its sliding window (Mistral) where they are built,
so a generation either way is refused at plan time, with the same numbers, never at
run time; a step plan's bucket may hold more positions than the generation fills.

Inputs of a generation program: `tokens` int64 [batch, prompt_len]; the family's
position inputs for prompt_len + new_tokens - 1 positions (LLaMA's `rope.cos`,
`rope.sin`); with sampling, `gumbel` [new_tokens, batch, vocab] (standard Gumbel
noise, one slice per step, read from host memory slice by slice); the weights.
Outputs: `ids` int64 [batch, new_tokens]; with `logits=True`, `logits`
[batch, new_tokens, vocab] (each step's, for checks). With `cache_outputs=True` (the
prefill of the step loop, `new_tokens=1`), also the prompt's keys and values
`kv.{i}.k`, `kv.{i}.v` [batch, kv heads, prompt_len, head_dim] of each layer.

With `ragged=True` (prompts of different lengths, left padded to `prompt_len`: a
batch as Hugging Face pads it with `padding_side="left"`), a generation program also
takes `position_ids` int64 and `attention_mask` [batch, prompt_len + new_tokens - 1]
(`padding_inputs`: each sequence's position at each cache slot, and 0 on its padding):
the position features are each sequence's rows, and the padding is masked in the
prefill's causal attention and on every page holding prompt slots. A ragged decode
program takes `positions` [batch, steps] and `kv.mask` [batch, pages, page_size]
(`decode_inputs(..., pads=...)`). The cache keeps one slot index for the batch, so
pages, buckets and the step loop are those of a batch of equal prompts.

With `quant=` (int8 or int4, `einpage.program.quantize`; or one `Quantization` per
weight, as a GGUF file stores them), each weight the model quantizes is the inputs
`{name}.q` and `{name}.scale` (and `{name}.min`, with minimums) instead
(`quantize_weights` makes them from float weights; a GGUF file holds them), rebuilt
on the device by tasks at every step that reads it: each step's float weight is a
transient of the step, and what the planner keeps on the host and moves is the
quantized bytes.

Inputs of a decode program of `steps` steps: `tokens` int64 [batch] (the previous ids),
`positions` int64 [steps] (L, L + 1, ...: the cache length L is the first new token's
position), the position inputs for its `positions` positions, `kv.mask`
[pages, page_size] (1 at the positions below L, 0 from L on), the pages `kv.{i}.k.{j}`
and `kv.{i}.v.{j}` [batch, kv heads, page_size, head_dim] (in host memory, like
weights), `gumbel` [steps, batch, vocab] when sampling, and the weights. Outputs:
`ids` [batch, steps], the new positions' `kv.{i}.k.new` and `kv.{i}.v.new` [batch, kv
heads, steps, head_dim], and `logits` [batch, steps, vocab] with `logits=True`.

What the step loop needs to know of these tensors is stated as facts
(`taskgraph.facts`), not spelled in their names: a page input is `KVPage(layer, part,
page)`, a layer's keys or values output `KVEntries(layer, part)`, the pages an unrolled
program makes `KVPage` too, and the ids an unrolled program chooses at step t
`ChosenIds(t)`. The names above are for people (and for the inputs a caller passes).

>>> from einpage.models import llama
>>> tg = llama.generation_program(llama.PRESETS["tiny"], 1, 5, 3, page_size=4).build()
>>> tg.tasks[tg.outputs["ids"]].shape
(1, 3)
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from einpage.models.base import ModelConfig, ModelFamily
from einpage.models.common import (
    Decoder,
    Heads,
    Positions,
    cached_weight_input,
    causal_attention,
    decoder_layer,
    last_position,
    token_ids,
)
from einpage.models.decode import (
    LayerCache,
    Page,
    Sampling,
    check_sampling,
    choose_tokens,
    paged_attention,
)
from einpage.models.errors import GenerationError
from einpage.program.program import Program, Tensor
from einpage.program.quantize import Quantization
from taskgraph import dtypes
from taskgraph.facts import ChosenIds, KVEntries, KVPage

__all__ = [
    "DEFAULT_PAGE_SIZE",
    "generation_program",
    "decode_program",
    "generation_inputs",
    "decode_inputs",
    "check_generation",
    "check_page_size",
    "check_tokens",
    "check_quant",
    "quant_by_weight",
    "check_lengths",
    "pad_prompts",
    "padding_inputs",
    "kv_mask",
    "QUANT_NAMES",
]

DEFAULT_PAGE_SIZE = 64
"""Positions per KV page unless told otherwise."""

QUANT_NAMES = {"int8": 8, "int4": 4}
"""The names `quant=` takes for weight-only quantization, and their bits."""


def _positive(what: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int | np.integer) or value <= 0:
        raise GenerationError(f"{what} must be a positive int, got {value!r}")
    return int(value)


def check_page_size(page_size: Any) -> int:
    """The page size, or `GenerationError` unless it is a positive int."""
    return _positive("page_size", page_size)


def check_generation(
    family: ModelFamily,
    cfg: ModelConfig,
    batch: Any,
    prompt_len: Any,
    new_tokens: Any,
    dtype: Any,
    page_size: Any,
    sampling: Sampling | None,
) -> str:
    """Check a generation's arguments; returns the canonical float dtype. Raises
    `GenerationError` naming the bad value (the positions limit is checked by
    `generation_program`, which knows the family's)."""
    if family.decoder is None or family.position_inputs is None:
        raise GenerationError(f"model family {family.name!r} has no decoder: it cannot generate")
    if not isinstance(cfg, family.config):
        raise GenerationError(
            f"the {family.name} family needs a {family.config.__name__}, got {type(cfg).__name__}"
        )
    _positive("batch", batch)
    _positive("prompt_len", prompt_len)
    _positive("new_tokens", new_tokens)
    check_page_size(page_size)
    check_sampling(sampling, cfg.vocab_size)
    name = dtypes.canonical(dtype)
    if not dtypes.is_float(name):
        raise GenerationError(f"dtype must be a float type, got {name}")
    return name


def _check_positions(decoder: Decoder, cfg: ModelConfig, needed: int, what: str) -> None:
    """`GenerationError` when `what` (a phrase ending in its verb: "... needs") fills more
    positions than the model has (the window is the family decoder's to check)."""
    limit = decoder.max_positions
    if limit is not None and needed > limit:
        raise GenerationError(
            f"{what} {needed} positions, but {cfg.name!r} has {limit} "
            f"(max_positions): shorten the prompt or generate fewer tokens"
        )


def check_tokens(tokens: Any, vocab_size: int) -> np.ndarray:
    """The prompt as int64 [batch, prompt_len]; `GenerationError` for an id outside
    [0, vocab_size) (naming it and where), `ConfigError` for a bad array."""
    ids = token_ids(tokens)
    bad = np.argwhere((ids < 0) | (ids >= vocab_size))
    if len(bad):
        row, col = (int(i) for i in bad[0])
        raise GenerationError(
            f"token {int(ids[row, col])} at prompt [{row}, {col}] is outside the vocabulary "
            f"[0, {vocab_size}) ({len(bad)} such ids)"
        )
    return ids


def check_quant(quant: Any) -> Quantization | dict[str, Quantization] | None:
    """`quant` as a `Quantization` (None: float weights): a `Quantization`, or "int8" /
    "int4" (the default group); or a mapping of weight names to their own
    `Quantization`s (a GGUF file's, `GGUFModel.quantization()`), as a dict (an empty one
    is None); `GenerationError` naming what is valid otherwise."""
    if quant is None or isinstance(quant, Quantization):
        return quant
    if isinstance(quant, Mapping):
        bad = {name: q for name, q in quant.items() if not isinstance(q, Quantization)}
        if bad:
            name, value = next(iter(bad.items()))
            raise GenerationError(
                f"quant maps weight names to einpage.quantize.Quantization, but "
                f"{name!r} maps to {value!r}"
            )
        return dict(quant) or None
    if isinstance(quant, str) and quant in QUANT_NAMES:
        return Quantization(bits=QUANT_NAMES[quant])
    raise GenerationError(
        f"quant must be one of {', '.join(map(repr, QUANT_NAMES))}, an "
        f"einpage.quantize.Quantization, a mapping of weight names to them, or None, got "
        f"{quant!r}"
    )


def quant_by_weight(cfg: ModelConfig, quant: Any) -> dict[str, Quantization]:
    """Each quantized weight of `cfg` and its `Quantization`: one `quant` for every
    weight the model quantizes (`cfg.quantized_weights()`), or a mapping's own (its names
    checked against the program's weights: `GenerationError` naming one that is not)."""
    quant = check_quant(quant)
    if quant is None:
        return {}
    if isinstance(quant, Quantization):
        return dict.fromkeys(sorted(cfg.quantized_weights()), quant)
    shapes = cfg.weight_shapes()
    unknown = sorted(name for name in quant if name not in shapes)
    if unknown:
        raise GenerationError(
            f"quant names {unknown[0]!r}, not a weight of {cfg.name} (its weights: "
            "cfg.weight_shapes())"
        )
    return quant


def _quant_suffix(quant: Any) -> str:
    """The programs' name suffix: `-int8`, `-int4`, or for one quantization per weight
    the labels of those used (`-int8-uint4+min`)."""
    quant = check_quant(quant)
    if quant is None:
        return ""
    if isinstance(quant, Quantization):
        return f"-int{quant.bits}"
    return "".join(f"-{label}" for label in sorted({q.label for q in quant.values()}))


def _weights(prog: Program, cfg: ModelConfig, dtype: str, quant: Any) -> Any:
    """The program's `weight(name)`: each weight one input, or with `quant` the weights
    the model quantizes as their quantized inputs, rebuilt at each use."""
    quants = quant_by_weight(cfg, quant)
    return cached_weight_input(prog, cfg.weight_shapes(), dtype, quants or None, quants)


@dataclass
class _Padding:
    """A ragged batch's inputs in an unrolled program: `position_ids` int64 [batch,
    slots] (each sequence's position at each cache slot; 0 at its left padding) and
    `mask` [batch, slots] (1 at its real slots, 0 at its padding), of a prompt of
    `prompt_len` slots. Slices of them are made once per slot range."""

    position_ids: Tensor
    mask: Tensor
    prompt_len: int
    made: dict[tuple[int, int, int], Tensor] = field(default_factory=dict)

    def slots(self, table: Tensor, start: int, count: int) -> Tensor:
        """`table`'s columns `start` .. `start + count - 1`: [batch, count]."""
        key = (table.id, start, count)
        if key not in self.made:
            batch, slots = table.shape
            if start == 0 and count == slots:
                self.made[key] = table
            else:
                label = "positions" if table is self.position_ids else "kv.mask"
                part = table.program.slice(table, (0, start), (batch, count), label=label)
                self.made[key] = part
        return self.made[key]


@dataclass
class _Build:
    """What the builders share: the program, the config, the family's decoder, options."""

    prog: Program
    cfg: ModelConfig
    decoder: Decoder
    dtype: str
    sampling: Sampling | None
    batch: int
    padding: _Padding | None = None

    def positions(self, count: int, start: int) -> Positions:
        """The positions of slots `start` .. `start + count - 1` of the cache: the slots
        themselves, or in a ragged batch each sequence's own (`position_ids`)."""
        if self.padding is None:
            return Positions(count, start)
        ids = self.padding.slots(self.padding.position_ids, start, count)
        return Positions(count, start, ids=ids)

    def page_masks(self, pages: list[Page]) -> list[Page]:
        """`pages` (the cache from slot 0, in order) with each sequence's padding masked
        on the pages that hold prompt slots (none without padding)."""
        if self.padding is None:
            return pages
        masked, start = [], 0
        for page in pages:
            if start < self.padding.prompt_len:
                mask = self.padding.slots(self.padding.mask, start, page.size)
                page = Page(page.k, page.v, mask)
            masked.append(page)
            start += page.size
        return masked

    def choose(self, logits: Tensor, gumbel: Tensor | None, step: int | None = None) -> Tensor:
        """The next ids from `logits`; `step`: the generation step they are chosen at (0:
        the prefill), stated on them (`ChosenIds`) when the program knows it."""
        with self.prog.scope("head"):
            ids = choose_tokens(logits, self.sampling, gumbel)
        return ids if step is None else self.prog.fact(ids, ChosenIds(step))

    def step_gumbel(self, gumbel: Tensor | None, step: int) -> Tensor | None:
        """Step `step`'s slice [batch, vocab] of the noise input [steps, batch, vocab]."""
        if gumbel is None:
            return None
        prog, shape = self.prog, gumbel.shape
        if shape[0] == 1:
            return prog.view(gumbel, shape[1:])
        part = prog.slice(gumbel, (step, 0, 0), (1, *shape[1:]), label="gumbel")
        return prog.view(part, shape[1:])


def generation_program(
    family: ModelFamily,
    cfg: ModelConfig,
    batch: int,
    prompt_len: int,
    new_tokens: int,
    dtype: Any = "float32",
    *,
    page_size: int = DEFAULT_PAGE_SIZE,
    sampling: Sampling | None = None,
    logits: bool = False,
    cache_outputs: bool = False,
    quant: Quantization | Mapping[str, Quantization] | None = None,
    ragged: bool = False,
) -> Program:
    """The prefill and `new_tokens - 1` decode steps of `family`'s model `cfg`, unrolled
    (module docstring). `sampling` None is greedy decoding; `quant` (a `Quantization`)
    stores the weights the model quantizes in int8 or int4, rebuilt on the device at
    each step that reads them. `ragged`: prompts of different lengths, left padded to
    `prompt_len` (module docstring: the inputs `position_ids` and `attention_mask`).
    Raises `GenerationError` for bad arguments (also a prompt plus new tokens beyond the
    model's positions)."""
    dtype = check_generation(family, cfg, batch, prompt_len, new_tokens, dtype, page_size, sampling)
    if cache_outputs and new_tokens != 1:
        raise GenerationError(f"cache_outputs needs new_tokens=1, got {new_tokens}")
    name = f"{cfg.name}-generate-b{batch}-p{prompt_len}-n{new_tokens}{_quant_suffix(quant)}"
    prog = Program(name)
    weight = _weights(prog, cfg, dtype, quant)
    tokens = prog.input("tokens", (batch, prompt_len), "int64")
    positions = prompt_len + new_tokens - 1
    decoder = family.decoder(cfg, prog, weight, dtype, positions)  # type: ignore[misc]
    what = f"a prompt of {prompt_len} tokens and {new_tokens} new ones needs"
    if ragged:
        longest = f"a batch whose longest prompt has {prompt_len} tokens"
        what = f"{longest}, and {new_tokens} new ones, needs"
    _check_positions(decoder, cfg, positions, what)
    padding = None
    if ragged:
        padding = _Padding(
            prog.input("position_ids", (batch, positions), "int64"),
            prog.input("attention_mask", (batch, positions), dtype),
            prompt_len,
        )
    build = _Build(prog, cfg, decoder, dtype, sampling, batch, padding)
    gumbel = None
    if sampling is not None:
        gumbel = prog.input("gumbel", (new_tokens, batch, cfg.vocab_size), dtype, location="host")
    with prog.scope("prefill"):
        caches, x = _prefill(build, tokens, page_size, cache_outputs)
        with prog.scope("head"):
            step_logits = [build.decoder.head(last_position(x))]
        ids = [build.choose(step_logits[0], build.step_gumbel(gumbel, 0), 0)]
    for t in range(1, new_tokens):
        with prog.scope(f"step{t}"):
            x = _decode_step(build, ids[-1], build.positions(1, prompt_len + t - 1), caches)
            with prog.scope("head"):
                step_logits.append(build.decoder.head(prog.view(x, (batch, cfg.hidden_size))))
            ids.append(build.choose(step_logits[-1], build.step_gumbel(gumbel, t), t))
    prog.output(_stack(prog, ids, "ids"), "ids")
    if logits:
        prog.output(_stack(prog, step_logits, "logits"), "logits")
    return prog


def _stack(prog: Program, parts: list[Tensor], label: str) -> Tensor:
    """[batch, ...] tensors, one per step, as [batch, steps, ...]."""
    views = [prog.view(p, (p.shape[0], 1, *p.shape[1:])) for p in parts]
    return views[0] if len(views) == 1 else prog.concat(views, axis=1, label=label)


LayerAttention = Callable[[Tensor, str, int], Tensor]
"""`attention(x, prefix, layer)`: a layer's attention block, told which layer it is."""


def _layers(build: _Build, x: Tensor, attention: LayerAttention) -> Tensor:
    """Every layer of the model (`common.decoder_layer`), its attention told its number."""
    for i in range(build.cfg.num_layers):

        def block(x: Tensor, prefix: str, layer: int = i) -> Tensor:
            return attention(x, prefix, layer)

        x = decoder_layer(x, i, block, build.decoder.mlp)
    return x


def _prefill(
    build: _Build, tokens: Tensor, page_size: int, cache_outputs: bool
) -> tuple[dict[int, LayerCache], Tensor]:
    """The prompt through every layer; returns each layer's cache (by layer number) and
    the last hidden states [batch, prompt_len, d]. With `cache_outputs`, each layer's keys
    and values are outputs instead (`kv.{i}.k`, `kv.{i}.v`, stating `KVEntries`)."""
    prog, decoder = build.prog, build.decoder
    caches: dict[int, LayerCache] = {}
    prompt_len = tokens.shape[1]
    feats = decoder.features(build.positions(prompt_len, 0))
    padding = build.padding
    keys = None if padding is None else padding.slots(padding.mask, 0, prompt_len)
    with prog.scope("embed"):
        x = decoder.embed(tokens, feats)

    def attention(x: Tensor, prefix: str, layer: int) -> Tensor:
        heads = decoder.qkv(x, prefix, feats)
        if cache_outputs:
            for part, tensor in (("k", heads.k), ("v", heads.v)):
                prog.output(prog.fact(tensor, KVEntries(layer, part)), f"kv.{layer}.{part}")
        else:
            caches[layer] = LayerCache.of_prompt(heads.k, heads.v, page_size, layer)
        return decoder.attn_out(x, causal_attention(heads.q, heads.k, heads.v, keys), prefix)

    return caches, _layers(build, x, attention)


def _decode_step(
    build: _Build,
    previous: Tensor,
    where: Positions,
    caches: dict[int, LayerCache],
    before: Callable[[int, Heads], list[Page]] | None = None,
) -> Tensor:
    """One decode step: the previous ids through every layer, each appending its new
    position to its cache and attending over the pages (after `before(layer, heads)`,
    the layer's pages that are inputs, when given)."""
    prog, decoder = build.prog, build.decoder
    feats = decoder.features(where)
    with prog.scope("embed"):
        x = decoder.embed(prog.view(previous, (build.batch, 1)), feats)

    def attention(x: Tensor, prefix: str, layer: int) -> Tensor:
        heads = decoder.qkv(x, prefix, feats)
        cache = caches[layer]
        with prog.scope("kv"):
            cache.append(heads.k, heads.v)
        if before is None:  # the cache from slot 0
            pages = build.page_masks(cache.all_pages)
        else:  # the pages before this run (masked by the plan's inputs), then its own
            pages = before(layer, heads) + cache.all_pages
        return decoder.attn_out(x, paged_attention(heads.q, pages), prefix)

    return _layers(build, x, attention)


def decode_program(
    family: ModelFamily,
    cfg: ModelConfig,
    batch: int,
    pages: int,
    dtype: Any = "float32",
    *,
    steps: int = 1,
    page_size: int = DEFAULT_PAGE_SIZE,
    sampling: Sampling | None = None,
    logits: bool = False,
    positions: int | None = None,
    quant: Quantization | Mapping[str, Quantization] | None = None,
    ragged: bool = False,
) -> Program:
    """`steps` decode steps (1: one step; more: a chunk of consecutive steps, which then
    keep weights on the device from one step to the next) of `family`'s model `cfg`
    over a cache of up to `pages` pages of `page_size` positions (module docstring): the
    plan of a length bucket. Scopes `step{s}.*`, s = 1 .. steps.

    `positions`: the positions the whole generation fills (prompt + new tokens - 1):
    the rows of the position tables (one table serves every bucket of a generation),
    checked against the model's positions and sliding window. It must exceed `steps` (a
    cache of at least one position, then the steps); by default it is what the bucket
    reaches, `pages * page_size + steps`. A run at cache length L needs L + steps <=
    `positions`. `quant`: quantized weights, as `generation_program`'s. `ragged`: a
    left-padded batch of prompts of different lengths, whose `positions` [batch, steps]
    and `kv.mask` [batch, pages, page_size] are per sequence. Raises `GenerationError`
    (`UnsupportedConfigError` beyond a sliding window)."""
    dtype = check_generation(family, cfg, batch, 1, 1, dtype, page_size, sampling)
    pages, steps = _positive("pages", pages), _positive("steps", steps)
    filled = pages * page_size + steps if positions is None else _positive("positions", positions)
    if filled <= steps:
        raise GenerationError(
            f"decode_program: positions={filled} leaves no cache before the {steps} "
            f"step{'s' * (steps > 1)}: a generation fills at least {steps + 1} positions"
        )
    chunk = "" if steps == 1 else f"-steps{steps}"
    prog = Program(
        f"{cfg.name}-decode-b{batch}-pages{pages}x{page_size}{chunk}{_quant_suffix(quant)}"
    )
    weight = _weights(prog, cfg, dtype, quant)
    tokens = prog.input("tokens", (batch,), "int64")
    at_positions = prog.input("positions", (batch, steps) if ragged else (steps,), "int64")
    decoder = family.decoder(cfg, prog, weight, dtype, filled)  # type: ignore[misc]
    _check_positions(decoder, cfg, filled, f"decode steps up to position {filled - 1} need")
    build = _Build(prog, cfg, decoder, dtype, sampling, batch)
    rows = (batch,) if ragged else ()
    mask = prog.input("kv.mask", (*rows, pages, page_size), dtype)
    gumbel = None
    if sampling is not None:
        gumbel = prog.input("gumbel", (steps, batch, cfg.vocab_size), dtype)
    with prog.scope("kv"):
        starts, sizes = (0,) * len(rows), rows
        masks = [
            prog.view(
                prog.slice(mask, (*starts, j, 0), (*sizes, 1, page_size), label="kv.mask"),
                (*rows, page_size),
            )
            for j in range(pages)
        ]
    inputs: dict[int, list[Page]] = {}

    def before(layer: int, heads: Heads) -> list[Page]:
        """The layer's cached pages: inputs in host memory, masked beyond the length."""
        if layer not in inputs:
            shape = (*heads.k.shape[:-2], page_size, heads.k.shape[-1])

            def page(part: str, j: int) -> Tensor:
                tensor = prog.input(f"kv.{layer}.{part}.{j}", shape, dtype, location="host")
                return prog.fact(tensor, KVPage(layer, part, j))

            inputs[layer] = [Page(page("k", j), page("v", j), masks[j]) for j in range(pages)]
        return inputs[layer]

    # The chunk's own new positions: pages placed in the cache only when the plan runs.
    caches = {i: LayerCache(page_size, i, first_page=None) for i in range(cfg.num_layers)}
    ids, step_logits = [tokens], []
    for s in range(steps):
        with prog.scope(f"step{s + 1}"):
            if steps == 1:
                at = at_positions
            elif ragged:
                at = prog.slice(at_positions, (0, s), (batch, 1), label="position")
            else:
                at = prog.slice(at_positions, (s,), (1,), label="position")
            x = _decode_step(build, ids[-1], Positions(1, ids=at), caches, before)
            with prog.scope("head"):
                step_logits.append(decoder.head(prog.view(x, (batch, cfg.hidden_size))))
            ids.append(build.choose(step_logits[-1], build.step_gumbel(gumbel, s)))
    for layer, cache in caches.items():
        for part in "kv":
            new = [getattr(page, part) for page in cache.all_pages]
            whole = new[0] if len(new) == 1 else prog.concat(new, axis=-2, label=f"kv.{part}.new")
            prog.output(prog.fact(whole, KVEntries(layer, part)), f"kv.{layer}.{part}.new")
    prog.output(_stack(prog, ids[1:], "ids"), "ids")
    if logits:
        prog.output(_stack(prog, step_logits, "logits"), "logits")
    return prog


# -- inputs ------------------------------------------------------------------------------


def generation_inputs(
    family: ModelFamily,
    cfg: ModelConfig,
    tokens: Any,
    new_tokens: int,
    dtype: Any = "float32",
    weights: Mapping[str, np.ndarray] | None = None,
    gumbel: np.ndarray | None = None,
    lengths: Sequence[int] | None = None,
) -> dict[str, np.ndarray]:
    """Every input of `generation_program(family, cfg, *tokens.shape, new_tokens, dtype)`
    but the weights unless given: the tokens (checked against the vocabulary), the
    position inputs, when sampling the noise `gumbel` [new_tokens, batch, vocab], and
    for a ragged program the prompts' `lengths` as `padding_inputs`."""
    ids = check_tokens(tokens, cfg.vocab_size)
    name = dtypes.canonical(dtype)
    inputs = {"tokens": ids}
    slots = ids.shape[1] + new_tokens - 1
    inputs.update(family.position_inputs(cfg, slots, name))  # type: ignore[misc]
    if lengths is not None:
        inputs.update(padding_inputs(lengths, ids.shape[1], slots, name))
    if gumbel is not None:
        inputs["gumbel"] = np.asarray(gumbel, dtype=name)
    return {**inputs, **(weights or {})}


def check_lengths(lengths: Any, prompt_len: int, batch: int) -> tuple[int, ...]:
    """The prompt lengths of a left-padded batch, one per sequence, each in [1,
    prompt_len]; `GenerationError` naming the sequence otherwise."""
    lengths = tuple(int(n) for n in lengths)
    if len(lengths) != batch:
        raise GenerationError(f"{len(lengths)} prompt lengths for a batch of {batch}")
    for row, n in enumerate(lengths):
        if not 1 <= n <= prompt_len:
            raise GenerationError(
                f"prompt {row} has {n} tokens: a prompt has 1 to {prompt_len} (the padded length)"
                if n
                else f"prompt {row} is empty: every prompt needs a token"
            )
    return lengths


def pad_prompts(rows: Sequence[Any], vocab_size: int) -> tuple[np.ndarray, tuple[int, ...]]:
    """Prompts of token ids of different lengths as one left-padded batch: ids int64
    [batch, longest] (padding id 0, never attended to) and each prompt's length.
    `GenerationError` for an empty prompt or an id outside the vocabulary (naming it).

    >>> pad_prompts([[5, 6, 7], [8]], 10)
    (array([[5, 6, 7],
           [0, 0, 8]]), (3, 1))
    """
    rows = [np.asarray(row).reshape(-1) for row in rows]
    if not rows:
        raise GenerationError("no prompt given: a batch needs at least one")
    for i, row in enumerate(rows):
        if row.size == 0:
            raise GenerationError(f"prompt {i} is empty: every prompt needs a token")
        if not np.issubdtype(row.dtype, np.integer):
            raise GenerationError(f"prompt {i} has {row.dtype} ids: token ids are integers")
    lengths = tuple(len(row) for row in rows)
    ids = np.zeros((len(rows), max(lengths)), np.int64)
    for i, row in enumerate(rows):
        ids[i, ids.shape[1] - len(row) :] = row
    return check_tokens(ids, vocab_size), lengths


def padding_inputs(
    lengths: Sequence[int], prompt_len: int, slots: int, dtype: Any = "float32"
) -> dict[str, np.ndarray]:
    """The inputs of a ragged generation program of `slots` cache slots whose prompts of
    `lengths` are left padded to `prompt_len`: `position_ids` [batch, slots] (slot minus
    the sequence's padding; 0 on the padding) and `attention_mask` [batch, slots] (0 on
    the padding, 1 after it), as Hugging Face derives them from its attention mask.

    >>> padding_inputs([3, 1], 3, 4)["position_ids"]
    array([[0, 1, 2, 3],
           [0, 0, 0, 1]])
    """
    pads = prompt_len - np.asarray(lengths, np.int64)
    positions = np.arange(slots, dtype=np.int64)[None, :] - pads[:, None]
    real = positions >= 0
    return {
        "position_ids": np.where(real, positions, 0),
        "attention_mask": real.astype(dtypes.canonical(dtype)),
    }


def kv_mask(pages: int, page_size: int, length: int, dtype: Any = "float32") -> np.ndarray:
    """The `kv.mask` input of a decode step over `pages` pages when `length` positions are
    filled: 1 below `length`, 0 from it on.

    >>> kv_mask(2, 3, 4)
    array([[1., 1., 1.],
           [1., 0., 0.]], dtype=float32)
    """
    name = dtypes.canonical(dtype)
    flat = np.zeros(pages * page_size, dtype=name)
    flat[:length] = 1
    return flat.reshape(pages, page_size)


def decode_inputs(
    previous: np.ndarray,
    length: int,
    pages: int,
    page_size: int,
    dtype: Any = "float32",
    steps: int = 1,
    pads: Sequence[int] | None = None,
) -> dict[str, np.ndarray]:
    """The inputs of `decode_program(family, cfg, batch, pages, steps=steps)` that change
    from run to run, at cache length `length`: the previous ids, the positions of the
    steps and the mask (the position tables – `family.position_inputs(cfg, positions,
    dtype)` for the program's `positions` –, the pages, the noise and the weights are the
    caller's). `pads`: a ragged program's left padding per sequence, which its positions
    start after and its mask hides."""
    name = dtypes.canonical(dtype)
    slots = np.arange(length, length + steps, dtype=np.int64)
    mask = kv_mask(pages, page_size, length, name)
    if pads is not None:
        pad = np.asarray(pads, np.int64)[:, None]
        slots = slots[None, :] - pad
        cache = np.arange(pages * page_size).reshape(1, pages, page_size)
        mask = mask[None] * (cache >= pad[:, :, None]).astype(name)
    return {
        "tokens": np.asarray(previous, dtype=np.int64).reshape(-1),
        "positions": slots,
        "kv.mask": mask,
    }
