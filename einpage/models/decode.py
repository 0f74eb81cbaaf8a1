"""The paged KV cache, attention over its pages, and the choice of the next token.

Pages
-----
Each layer's keys and values are kept as *pages*: tensors [b, heads, n, e] of at most
`page_size` positions, each its own tensor of the program, so the planner keeps a page
on the device or sends it to host memory by its reuse distance like any other tensor,
under the one budget shared with the weights. A page is written once:

* the prefill cuts the prompt's K and V into whole pages (a Slice per page; a prompt of
  exactly one page is used as it is);
* tensors are immutable, so the last, partly filled page is a *new small tensor per
  step*: a decode step appends its position by a Concat of the previous partial page
  and the new [b, heads, 1, e] key (or value), so a step copies at most `page_size - 1`
  old positions per layer – never the whole cache. When the partial page reaches
  `page_size` positions it is a full page and is never copied again; the next step
  starts a new partial page with its own position alone (no copy at all).

Page tensors state what they are: the fact `taskgraph.facts.KVPage(layer, part, page)`
(part "k" or "v"; the page's number, or None for a page of the new positions of a decode
step plan, whose place in the cache is known only when it runs), which is how reports,
memory maps and the step loop tell KV pages from other tensors. Their labels (`kv.k`,
`kv.v`) and a decode step plan's input names (`kv.{layer}.k.{page}`) are for people.

Attention over pages
--------------------
A query reads the pages, never a concatenation of the cache. Per page j (spec letters:
batch b, heads h – or kv-head g and group member r –, query q, key k, feature e):
scores `s_j = q·k_j` (`bhqe,bhke->bhqk`), the page's maximum `m_j` (agg "max"), its
sum `l_j = Σ_k exp(s_j - m_j)` and output `o_j = Σ_k exp(s_j - m_j) v_j`. The pages
combine by the online-softmax identity: with `M = max_j m_j`,

    softmax(s) v = Σ_j exp(m_j - M) o_j / Σ_j exp(m_j - M) l_j,

computed from the per-page statistics stacked along a page axis n (a Concat of the
small m_j, l_j, o_j, never of the pages): `M` by agg "max" over n, then two sums.

A page may carry a mask [n] (1 at filled positions, 0 at unfilled ones): a decode step
plan reused for many cache lengths reads pages of which only a prefix is filled; in a
ragged batch the mask is [b, n], hiding each sequence's left padding too. Its
statistics read `where(mask, s, masked_score(dtype))` in place of `s`: an unfilled
position scores `masked_score` – a power of two, exactly representable, far below any
real score – so its weight `exp(masked_score - M)` is exactly 0. The score is replaced,
not shifted by an additive mask, so that a page's stored maximum equals a score exactly
even in float16 (a shifted maximum, rounded to float16, would not cancel against the
float32 shifted scores and could overflow the page's sum). A page with no filled
position has maximum `masked_score`, finite, and weight 0 in the combination, since the
newest position is never masked and so `M` is always a real score.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from einpage.models.errors import GenerationError
from einpage.program import ops
from einpage.program.program import Tensor
from taskgraph import dtypes
from taskgraph.facts import KVPage

__all__ = [
    "Page",
    "LayerCache",
    "Sampling",
    "paged_attention",
    "masked_score",
    "choose_tokens",
    "check_sampling",
]


def masked_score(dtype: str) -> float:
    """The score of an unfilled cache position: -2**(maxexp - 1) of the float dtype
    (-32768 for float16, about -1.7e38 for float32), exact and finite, so that a page with
    no filled position has a finite maximum (no -inf - -inf = NaN) and weight 0.

    >>> masked_score("float16")
    -32768.0
    >>> masked_score("bfloat16")  # its limits from taskgraph.dtypes: numpy.finfo has none
    -1.7014118346046923e+38
    """
    return -(2.0 ** (dtypes.finfo(dtype).maxexp - 1))


@dataclass(frozen=True)
class Page:
    """One page of a layer's cache: `k` and `v` [b, heads, n, e], and an optional `mask`
    [n], 1 at filled positions and 0 at unfilled ones (None: every position is filled),
    or [b, n], one row per sequence (a ragged batch, whose left padding is masked)."""

    k: Tensor
    v: Tensor
    mask: Tensor | None = None

    @property
    def size(self) -> int:
        """Positions in the page."""
        return self.k.shape[-2]


@dataclass
class LayerCache:
    """A layer's cache while a generation program is being built: the full `pages` and
    the `partial` last page (None when the cache ends on a page boundary). `layer` is the
    layer's number and `first_page` the number of its first page in the whole cache (0
    for a cache that starts with the prompt; None for the new positions of a decode step
    plan, placed in the cache when it runs): the pages it makes say which they are
    (`KVPage`)."""

    page_size: int
    layer: int = 0
    first_page: int | None = 0
    pages: list[Page] = field(default_factory=list)
    partial: Page | None = None

    @classmethod
    def of_prompt(cls, k: Tensor, v: Tensor, page_size: int, layer: int = 0) -> LayerCache:
        """The cache of layer `layer` from a prompt's keys and values [b, heads, s, e], cut
        into pages."""
        cache = cls(page_size, layer)
        seq = k.shape[-2]
        if seq <= page_size:  # the prompt's K and V are the page: no copy
            page = Page(k, v)
            cache.pages, cache.partial = ([page], None) if seq == page_size else ([], page)
            return cache
        for start in range(0, seq, page_size):
            size = min(page_size, seq - start)
            number = start // page_size
            page = Page(
                cache._page(_page_slice(k, start, size, "kv.k"), "k", number),
                cache._page(_page_slice(v, start, size, "kv.v"), "v", number),
            )
            if size == page_size:
                cache.pages.append(page)
            else:
                cache.partial = page
        return cache

    def _page(self, tensor: Tensor, part: str, number: int) -> Tensor:
        """`tensor`, a page copied for the cache, stated to be page `number` (counted from
        this cache's first) of the layer's `part`."""
        page = None if self.first_page is None else self.first_page + number
        return tensor.program.fact(tensor, KVPage(self.layer, part, page))

    def append(self, k: Tensor, v: Tensor) -> None:
        """Add one position's key and value [b, heads, 1, e] (see the module docstring)."""
        if self.partial is None:
            page = Page(k, v)
        else:
            prog = k.program
            number = len(self.pages)
            page = Page(
                self._page(prog.concat([self.partial.k, k], axis=-2, label="kv.k"), "k", number),
                self._page(prog.concat([self.partial.v, v], axis=-2, label="kv.v"), "v", number),
            )
        if page.size == self.page_size:
            self.pages.append(page)
            self.partial = None
        else:
            self.partial = page

    @property
    def all_pages(self) -> list[Page]:
        """The pages attention reads: the full ones, then the partial one."""
        return self.pages + ([self.partial] if self.partial is not None else [])

    @property
    def length(self) -> int:
        """Positions held."""
        return sum(page.size for page in self.all_pages)


def _page_slice(x: Tensor, start: int, size: int, label: str) -> Tensor:
    """Positions [start, start + size) of x [b, heads, s, e], copied into a page."""
    *lead, _, e = x.shape
    starts = (0,) * len(lead) + (start, 0)
    return x.program.slice(x, starts, (*lead, size, e), label=label)


def _head_letters(q: Tensor) -> tuple[str, str]:
    """Index letters of q's heads and of the cache's: grouped-query or multi-head."""
    if q.ndim == 5:
        return "bgr", "bg"
    if q.ndim == 4:
        return "bh", "bh"
    raise GenerationError(f"paged_attention: q must have rank 4 or 5, got shape {q.shape}")


def paged_attention(q: Tensor, pages: Sequence[Page]) -> Tensor:
    """`softmax(q kᵀ) v` over every position of `pages` (all visible to every query:
    the queries come after the cache), page by page with the online-softmax identity
    (module docstring). `q` [b, h, s, e] or [b, g, r, s, e] is already scaled; returns
    the attention output with q's shape."""
    if not pages:
        raise GenerationError("paged_attention: there must be at least one page")
    prog = q.program
    qh, kh = _head_letters(q)
    stats = []
    for page in pages:
        s = prog.einsum(f"{qh}qe,{kh}ke->{qh}qk", q, page.k, label="scores")
        if page.mask is None:
            operands, terms, score = [s], [f"{qh}qk"], "a"
        else:
            floor = masked_score(q.dtype)
            positions = "bk" if page.mask.ndim == 2 else "k"  # per sequence, or shared
            operands, terms = [s, page.mask], [f"{qh}qk", positions]
            score = f"where(b, a, {floor!r})"
        stat = ",".join(terms)
        join = None if page.mask is None else score
        m = prog.einsum(f"{stat}->{qh}q", *operands, join=join, agg="max", label="page.max")
        m_var = "abc"[len(operands)]
        weight = f"exp({score} - {m_var})"
        total = prog.einsum(f"{stat},{qh}q->{qh}q", *operands, m, join=weight, label="page.sum")
        v_var = "abcd"[len(operands) + 1]
        out = prog.einsum(
            f"{stat},{qh}q,{kh}ke->{qh}qe",
            *operands,
            m,
            page.v,
            join=f"{weight} * {v_var}",
            label="page.out",
        )
        stats.append((m, total, out))
    if len(stats) == 1:
        _, total, out = stats[0]
        return prog.einsum(f"{qh}qe,{qh}q->{qh}qe", out, total, join="a / b", label="attn")
    return _combine(stats, qh)


def _combine(stats: list[tuple[Tensor, Tensor, Tensor]], qh: str) -> Tensor:
    """The attention output from the pages' (max, sum, output), stacked along a page axis."""
    prog = stats[0][0].program

    def stack(parts: list[Tensor], axis: int, label: str) -> Tensor:
        views = []
        for part in parts:
            shape = list(part.shape)
            shape.insert(axis if axis >= 0 else len(shape) + 1 + axis, 1)
            views.append(prog.view(part, shape))
        return prog.concat(views, axis=axis, label=label)

    maxes = stack([m for m, _, _ in stats], -1, "pages.max")
    sums = stack([t for _, t, _ in stats], -1, "pages.sum")
    outs = stack([o for _, _, o in stats], -2, "pages.out")
    peak = prog.einsum(f"{qh}qn->{qh}q", maxes, agg="max", label="attn.max")
    total = prog.einsum(
        f"{qh}qn,{qh}qn,{qh}q->{qh}q", sums, maxes, peak, join="a * exp(b - c)", label="attn.sum"
    )
    return prog.einsum(
        f"{qh}qne,{qh}qn,{qh}q,{qh}q->{qh}qe",
        outs,
        maxes,
        peak,
        total,
        join="a * exp(b - c) / d",
        label="attn",
    )


# -- the next token ----------------------------------------------------------------------


@dataclass(frozen=True)
class Sampling:
    """How the next token is drawn instead of the greedy argmax: from
    `softmax(logits / temperature)`, restricted to the `top_k` largest logits when given
    (Gumbel-max with the noise an input of the program; the host draws it from `seed`,
    so a sampled generation is the same for the same seed, whichever way it is planned).
    The seed belongs here because only sampling draws noise: greedy decoding has none.

    >>> Sampling(temperature=0.8, top_k=50, seed=1)
    Sampling(temperature=0.8, top_k=50, seed=1)
    """

    temperature: float = 1.0
    top_k: int | None = None
    seed: int = 0

    def __post_init__(self) -> None:
        t = self.temperature
        ok = isinstance(t, int | float) and not isinstance(t, bool)
        if not ok or not np.isfinite(t) or t <= 0:
            raise GenerationError(f"Sampling: temperature must be a number > 0, got {t!r}")
        k = self.top_k
        if k is not None and (isinstance(k, bool) or not isinstance(k, int) or k <= 0):
            raise GenerationError(f"Sampling: top_k must be a positive int or None, got {k!r}")
        s = self.seed
        if isinstance(s, bool) or not isinstance(s, int | np.integer) or s < 0:
            raise GenerationError(f"Sampling: seed must be an int >= 0, got {s!r}")


def check_sampling(sampling: Sampling | None, vocab_size: int) -> None:
    """`GenerationError` for a `top_k` larger than the vocabulary."""
    if sampling is not None and not isinstance(sampling, Sampling):
        raise GenerationError(f"sampling must be a Sampling or None, got {sampling!r}")
    if sampling is not None and sampling.top_k is not None and sampling.top_k > vocab_size:
        raise GenerationError(
            f"Sampling: top_k={sampling.top_k} exceeds the vocabulary ({vocab_size} tokens)"
        )


def choose_tokens(logits: Tensor, sampling: Sampling | None, gumbel: Tensor | None) -> Tensor:
    """The next ids (int64 [b]) from logits [b, vocab]: argmax, or Gumbel-max sampling
    with the noise `gumbel` [b, vocab]."""
    if sampling is None:
        return ops.argmax(logits, label="next")
    assert gumbel is not None
    return ops.sample_gumbel(logits, gumbel, sampling.temperature, sampling.top_k, label="next")
