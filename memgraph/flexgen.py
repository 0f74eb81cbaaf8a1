"""FlexGen's policy search (Sheng et al., ICML 2023, §4.2–4.3) on einpage's cost model.

FlexGen runs a generation layer by layer over a *block* of `gpu_batches` GPU batches
(the zig-zag schedule: for each layer, each GPU batch in turn, while the next layer's
weights, the next batch's cache and activations are copied in), and keeps fixed
fractions of the weights (`wg`), of the KV cache (`cg`) and of the activations between
layers (`hg`) on the GPU, the rest on the host. Which fractions, and how many GPU
batches, it chooses by linear programming over its cost model: each layer of each step
takes the longest of its compute, its host-to-device copies and its device-to-host
copies (they overlap perfectly), subject to the peak GPU memory fitting the budget (and
the host memory, when it is bounded).

`search_policy(workload, budget, cost_model)` does that search here: an LP (HiGHS,
through `scipy.optimize.linprog`) over (wg, cg, hg) and one time variable per step, for
each number of GPU batches that divides the batch (powers of two, as FlexGen enumerates
them), keeping the fastest. Among equally fast policies the LP keeps the one that moves
the fewest bytes, so a budget that holds everything gives wg = cg = hg = 1.
`policy_cost(workload, policy, cost_model)` evaluates any policy by plain arithmetic –
how the tests check the LP against a grid of policies.

The cost model, per layer of step t (0 is the prefill, t >= 1 decode step t), for the
whole batch (b sequences of `gpu_batches` GPU batches of b / gpu_batches each), with
w = weight bytes / layers and the KV cache of t' positions c(t') = b * t' * kv per token:

* compute: the workload's compute seconds of step t / layers (einpage's per-step
  compute, `memgraph.cost.CostModel.task_seconds` summed over the step's tasks), plus
  (gpu_batches - 1) * w / device bandwidth: each further GPU batch reads the layer's
  weights from device memory again;
* host -> device: the prefill reads every weight from the host (they start there, as
  in einpage's plans); a decode step reads the non-resident (1 - wg) * w, the
  non-resident (1 - cg) of the cache so far, and (1 - hg) of the activations;
* device -> host: (1 - cg) of the step's new keys and values, (1 - hg) of the
  activations.

Peak GPU memory at step t: the resident part – wg of all weights, cg of the cache of
the whole generation (prompt + new tokens, reserved up front as FlexGen does), hg of
one layer boundary's activations of the whole batch – plus the working buffers of one
GPU batch: two layers of streamed weights (double buffering), two GPU batches' share
of a layer's non-resident cache (loading the next while one computes) and two of its
non-resident activations (load and store), and the largest intermediate of the layer
for one GPU batch (the larger of the MLP's and the attention scores').

Simplifications, each in FlexGen's favour unless said: weights are spread evenly over
the layers (the embedding and the output head included); copies and kernels have no
latency; transfers overlap compute perfectly; no CPU delegation of attention (FlexGen
may compute attention on the CPU where the cache lives; on this cost model the host
reads memory at 20 GB/s, the "cpu" preset, slower than the 50 GB/s link, so moving the
cache is the faster choice); no disk tier, and host memory unbounded unless
`host_bytes` is given. Against it: the buffers are counted as the zig-zag schedule
holds them (two layers of weights, two GPU batches' cache), where FlexGen's own model
counts one of each and scales the budget by 0.8 instead; here the whole budget is
usable. The LP keeps a margin of one millionth of the budget so HiGHS's tolerances
cannot push the policy over it.

>>> w = FlexGenWorkload(layers=4, batch=2, prompt=8, new_tokens=3, weight_bytes=4 << 20,
...     kv_bytes_per_token=1024, hidden_bytes_per_token=512, act_bytes_per_token=2048,
...     score_bytes_per_key=16, compute_seconds=(1e-3, 1e-4, 1e-4))
>>> p = search_policy(w, "64MiB")   # everything fits: nothing is offloaded
>>> (p.weights_gpu, p.cache_gpu, p.activations_gpu, p.gpu_batches)
(1.0, 1.0, 1.0, 1)
>>> p = search_policy(w, "3MiB")
>>> p.weights_gpu < 1 and p.cost.gpu_peak <= 3 << 20
True
"""

from __future__ import annotations

from dataclasses import dataclass

from einpage_core.errors import InfeasibleBudgetError, PlanError
from einpage_core.units import format_bytes, parse_bytes
from memgraph.cost import CostModel, get_cost_model

__all__ = ["FlexGenPolicy", "FlexGenWorkload", "PolicyCost", "policy_cost", "search_policy"]

MARGIN = 1e-6
"""The share of the budget the LP leaves unused, against the solver's tolerances."""


@dataclass(frozen=True)
class FlexGenWorkload:
    """One generation as FlexGen's cost model sees it (bytes and seconds).

    `weight_bytes`: every weight; `kv_bytes_per_token`: the keys and values of one
    layer for one sequence at one position; `hidden_bytes_per_token`: the activation
    between two layers for one sequence at one position; `act_bytes_per_token`: the
    largest intermediate working set of a layer's non-attention ops per position (e.g.
    the MLP's gate, up and product); `score_bytes_per_key`: the attention scores and
    probabilities per query position per key; `compute_seconds[t]`: the compute of step
    t for the whole model and batch (0: the prefill, which makes the first token), so
    there are `new_tokens` of them.
    """

    layers: int
    batch: int
    prompt: int
    new_tokens: int
    weight_bytes: int
    kv_bytes_per_token: int
    hidden_bytes_per_token: int
    act_bytes_per_token: int
    score_bytes_per_key: int
    compute_seconds: tuple[float, ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "compute_seconds", tuple(self.compute_seconds))
        for name in ("layers", "batch", "prompt", "new_tokens"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise PlanError(f"FlexGenWorkload.{name} must be an int >= 1, got {value!r}")
        for name in (
            "weight_bytes",
            "kv_bytes_per_token",
            "hidden_bytes_per_token",
            "act_bytes_per_token",
            "score_bytes_per_key",
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise PlanError(f"FlexGenWorkload.{name} must be an int >= 0, got {value!r}")
        if len(self.compute_seconds) != self.new_tokens:
            raise PlanError(
                f"FlexGenWorkload.compute_seconds needs one entry per step (the prefill and "
                f"{self.new_tokens - 1} decode steps: {self.new_tokens}), "
                f"got {len(self.compute_seconds)}"
            )
        if any(not s >= 0 for s in self.compute_seconds):
            raise PlanError(
                f"FlexGenWorkload.compute_seconds must be >= 0, got {self.compute_seconds}"
            )

    @property
    def layer_weight_bytes(self) -> float:
        """w: one layer's share of the weights."""
        return self.weight_bytes / self.layers

    def queries(self, t: int) -> int:
        """Positions computed per sequence at step t."""
        return self.prompt if t == 0 else 1

    def context(self, t: int) -> int:
        """Positions attended to at step t (the cache so far and the step's own)."""
        return self.prompt if t == 0 else self.prompt + t

    def cache_read(self, t: int) -> int:
        """KV bytes of one layer, whole batch, that step t reads from before it."""
        return 0 if t == 0 else self.batch * (self.prompt + t - 1) * self.kv_bytes_per_token

    def cache_written(self, t: int) -> int:
        """KV bytes of one layer, whole batch, that step t adds."""
        return self.batch * self.queries(t) * self.kv_bytes_per_token

    def cache_total(self) -> int:
        """The cache of the whole generation, every layer (FlexGen's reservation)."""
        positions = self.prompt + self.new_tokens
        return self.layers * self.batch * positions * self.kv_bytes_per_token

    def hidden(self, t: int) -> int:
        """One layer boundary's activations at step t, whole batch."""
        return self.batch * self.queries(t) * self.hidden_bytes_per_token


@dataclass(frozen=True)
class PolicyCost:
    """What a policy costs: `seconds` of the whole generation, the GPU peak (bytes, the
    largest over the steps), the host bytes it keeps, and the bytes it copies each way."""

    seconds: float
    gpu_peak: int
    host_bytes: int
    h2d_bytes: int
    d2h_bytes: int


@dataclass(frozen=True)
class FlexGenPolicy:
    """A FlexGen policy: GPU shares of weights, cache and activations, and the block
    (`gpu_batches` GPU batches of `gpu_batch_size`); `cost` as `policy_cost` finds it."""

    weights_gpu: float
    cache_gpu: float
    activations_gpu: float
    gpu_batches: int
    gpu_batch_size: int
    cost: PolicyCost | None = None

    def __repr__(self) -> str:
        text = (
            f"FlexGenPolicy(wg={self.weights_gpu:.1%}, cg={self.cache_gpu:.1%}, "
            f"hg={self.activations_gpu:.1%}, block={self.gpu_batches}x{self.gpu_batch_size}"
        )
        if self.cost is not None:
            text += f", {self.cost.seconds:.4g} s, peak {format_bytes(self.cost.gpu_peak)}"
        return text + ")"


@dataclass(frozen=True)
class _Linear:
    """const + wg * x_w + cg * x_c + hg * x_h: one quantity as a function of the policy."""

    const: float
    wg: float = 0.0
    cg: float = 0.0
    hg: float = 0.0

    def at(self, wg: float, cg: float, hg: float) -> float:
        return self.const + self.wg * wg + self.cg * cg + self.hg * hg


def _h2d(w: FlexGenWorkload, t: int) -> _Linear:
    """Bytes host -> device per layer at step t."""
    weights = w.layer_weight_bytes
    cache, hidden = w.cache_read(t), w.hidden(t)
    if t == 0:  # every weight comes in: the resident part into its home
        return _Linear(weights + cache + hidden, 0.0, -cache, -hidden)
    return _Linear(weights + cache + hidden, -weights, -cache, -hidden)


def _d2h(w: FlexGenWorkload, t: int) -> _Linear:
    """Bytes device -> host per layer at step t."""
    cache, hidden = w.cache_written(t), w.hidden(t)
    return _Linear(cache + hidden, 0.0, -cache, -hidden)


def _gpu_bytes(w: FlexGenWorkload, t: int, gpu_batches: int) -> _Linear:
    """Peak GPU bytes at step t (module docstring): resident homes plus one GPU batch's
    working buffers."""
    gbs = w.batch // gpu_batches
    layer = w.layer_weight_bytes
    cache_home = w.cache_total()
    hidden_home = w.hidden(t)
    # a GPU batch's share of a layer's cache that step t reads or writes
    cache_buffer = 2 * gbs * w.context(t) * w.kv_bytes_per_token
    hidden_buffer = 2 * gbs * w.queries(t) * w.hidden_bytes_per_token
    working = gbs * w.queries(t) * max(w.act_bytes_per_token, w.context(t) * w.score_bytes_per_key)
    # wg*W + 2(1-wg)w + cg*C + (1-cg)cache_buffer + hg*H + (1-hg)hidden_buffer + working
    return _Linear(
        2 * layer + cache_buffer + hidden_buffer + working,
        w.weight_bytes - 2 * layer,
        cache_home - cache_buffer,
        hidden_home - hidden_buffer,
    )


def _host_bytes(w: FlexGenWorkload) -> _Linear:
    """Host bytes the policy keeps: the non-resident weights, cache and activations."""
    hidden = w.hidden(0)
    total = w.weight_bytes + w.cache_total() + hidden
    return _Linear(total, -w.weight_bytes, -w.cache_total(), -hidden)


def _compute(w: FlexGenWorkload, t: int, gpu_batches: int, model: CostModel) -> float:
    """Seconds of one layer's compute at step t (module docstring)."""
    reread = (gpu_batches - 1) * w.layer_weight_bytes / model.device_bytes_per_s
    return w.compute_seconds[t] / w.layers + reread


def policy_cost(
    workload: FlexGenWorkload, policy: FlexGenPolicy, cost_model: str | CostModel = "h100-pcie5"
) -> PolicyCost:
    """The cost of `policy` on `workload` by the module's cost model, step by step."""
    w, model = workload, get_cost_model(cost_model)
    _check_block(w, policy.gpu_batches)
    f = (policy.weights_gpu, policy.cache_gpu, policy.activations_gpu)
    if any(not 0.0 <= x <= 1.0 for x in f):
        raise PlanError(f"policy fractions must lie in [0, 1], got {f}")
    seconds = peak = h2d = d2h = 0.0
    for t in range(w.new_tokens):
        up, down = _h2d(w, t).at(*f), _d2h(w, t).at(*f)
        layer_seconds = max(
            _compute(w, t, policy.gpu_batches, model),
            up / model.h2d_bytes_per_s,
            down / model.d2h_bytes_per_s,
        )
        seconds += w.layers * layer_seconds
        h2d += w.layers * up
        d2h += w.layers * down
        peak = max(peak, _gpu_bytes(w, t, policy.gpu_batches).at(*f))
    return PolicyCost(
        seconds=seconds,
        gpu_peak=round(peak),
        host_bytes=round(_host_bytes(w).at(*f)),
        h2d_bytes=round(h2d),
        d2h_bytes=round(d2h),
    )


def _check_block(w: FlexGenWorkload, gpu_batches: int) -> None:
    if isinstance(gpu_batches, bool) or not isinstance(gpu_batches, int) or gpu_batches < 1:
        raise PlanError(f"gpu_batches must be an int >= 1, got {gpu_batches!r}")
    if w.batch % gpu_batches:
        raise PlanError(f"gpu_batches must divide the batch ({w.batch}), got {gpu_batches}")


def block_choices(batch: int) -> list[int]:
    """The numbers of GPU batches FlexGen's enumeration tries: powers of two dividing
    `batch`.

    >>> block_choices(12)
    [1, 2, 4]
    """
    choices, k = [], 1
    while k <= batch and batch % k == 0:
        choices.append(k)
        k *= 2
    return choices


def _linprog():
    try:
        from scipy.optimize import linprog
    except ImportError as err:  # pragma: no cover - the test extra installs scipy
        from memgraph.optimal.solve import SolverMissingError

        raise SolverMissingError(
            "memgraph.flexgen needs scipy >= 1.9 (HiGHS): pip install 'einpage[test]' "
            "or pip install scipy"
        ) from err
    return linprog


def _solve_block(
    w: FlexGenWorkload, gpu_batches: int, limit: float, host: float | None, model: CostModel
) -> FlexGenPolicy | None:
    """The LP for one block: the fastest fractions, then among those the fewest bytes
    moved; None when no fractions fit. Variables: wg, cg, hg, then one per-layer time (in
    milliseconds) per step."""
    linprog = _linprog()
    n = w.new_tokens
    rows: list[list[float]] = []
    rhs: list[float] = []

    def add(form: _Linear, scale: float, step: int | None, bound: float) -> None:
        # scale * form(x) - [T_step in ms] <= bound
        row = [form.wg * scale, form.cg * scale, form.hg * scale] + [0.0] * n
        if step is not None:
            row[3 + step] = -1.0
        rows.append(row)
        rhs.append(bound - form.const * scale)

    ms_h2d, ms_d2h = 1e3 / model.h2d_bytes_per_s, 1e3 / model.d2h_bytes_per_s
    for t in range(n):
        add(_h2d(w, t), ms_h2d, t, 0.0)
        add(_d2h(w, t), ms_d2h, t, 0.0)
        add(_gpu_bytes(w, t, gpu_batches), 1.0 / limit, None, 1.0)
    if host is not None:
        add(_host_bytes(w), 1.0 / max(host, 1.0), None, 1.0)
    bounds = [(0.0, 1.0)] * 3 + [(1e3 * _compute(w, t, gpu_batches, model), None) for t in range(n)]
    time_objective = [0.0, 0.0, 0.0] + [1.0] * n
    first = linprog(time_objective, A_ub=rows, b_ub=rhs, bounds=bounds, method="highs")
    if first.status == 2:  # infeasible
        return None
    if first.status != 0:  # pragma: no cover - a bounded LP with a feasible point solves
        raise PlanError(f"FlexGen's policy LP failed: {first.message}")
    # Second pass: no slower than the optimum, the fewest bytes over PCIe.
    moved = [0.0, 0.0, 0.0]
    for t in range(n):
        for form in (_h2d(w, t), _d2h(w, t)):
            moved[0] += form.wg
            moved[1] += form.cg
            moved[2] += form.hg
    scale = max(abs(c) for c in moved) or 1.0
    rows.append(time_objective)
    rhs.append(first.fun * (1 + 1e-9) + 1e-9)
    second = linprog(
        [c / scale for c in moved] + [0.0] * n, A_ub=rows, b_ub=rhs, bounds=bounds, method="highs"
    )
    x = second.x if second.status == 0 else first.x
    wg, cg, hg = (min(1.0, max(0.0, float(v))) for v in x[:3])
    policy = FlexGenPolicy(wg, cg, hg, gpu_batches, w.batch // gpu_batches)
    return FlexGenPolicy(
        wg, cg, hg, gpu_batches, w.batch // gpu_batches, policy_cost(w, policy, model)
    )


def _smallest_peak(w: FlexGenWorkload, gpu_batches: int, host: int | None) -> float:
    """The smallest GPU peak of any fractions with this block (and the host bound): an
    LP over wg, cg, hg and the peak. Offloading is not always smaller – keeping the
    activations resident needs one copy of them, offloading them two buffers."""
    linprog = _linprog()
    scale = max(1.0, _gpu_bytes(w, 0, gpu_batches).at(1.0, 1.0, 1.0))
    rows, rhs = [], []
    for t in range(w.new_tokens):
        form = _gpu_bytes(w, t, gpu_batches)
        rows.append([form.wg / scale, form.cg / scale, form.hg / scale, -1.0])
        rhs.append(-form.const / scale)
    if host is not None:
        form = _host_bytes(w)
        h = max(host, 1.0)
        rows.append([form.wg / h, form.cg / h, form.hg / h, 0.0])
        rhs.append(1.0 - form.const / h)
    bounds = [(0.0, 1.0)] * 3 + [(None, None)]
    result = linprog([0.0, 0.0, 0.0, 1.0], A_ub=rows, b_ub=rhs, bounds=bounds, method="highs")
    if result.status != 0:  # pragma: no cover - everything on the device needs no host
        raise PlanError(f"FlexGen's smallest-peak LP failed: {result.message}")
    return result.fun * scale


def search_policy(
    workload: FlexGenWorkload,
    budget: int | str,
    cost_model: str | CostModel = "h100-pcie5",
    *,
    host_bytes: int | str | None = None,
    gpu_batches: tuple[int, ...] | None = None,
) -> FlexGenPolicy:
    """FlexGen's policy for `workload` within `budget` device bytes (module docstring).

    Tries each number of GPU batches in `gpu_batches` (default `block_choices` of the
    batch) and keeps the fastest policy (the fewest GPU batches among equals).
    `host_bytes` bounds the host memory (default: unbounded).

    Raises `InfeasibleBudgetError` when no policy fits: its `needed` is the smallest
    device budget at which one does (an LP over the fractions for each block, rounded up
    by the LP's margin).
    """
    w, model = workload, get_cost_model(cost_model)
    budget = parse_bytes(budget)
    host = None if host_bytes is None else parse_bytes(host_bytes)
    choices = block_choices(w.batch) if gpu_batches is None else list(gpu_batches)
    if not choices:
        raise PlanError("gpu_batches must name at least one number of GPU batches")
    for k in choices:
        _check_block(w, k)
    limit = budget * (1 - MARGIN)
    best: FlexGenPolicy | None = None
    for k in choices:
        policy = _solve_block(w, k, limit, host, model) if limit > 0 else None
        if policy is not None and (
            best is None or policy.cost.seconds < best.cost.seconds * (1 - 1e-9)
        ):
            best = policy
    if best is not None:
        assert best.cost.gpu_peak <= budget, best  # the margin covers the solver's tolerance
        return best

    needed, smallest = min((_smallest_peak(w, k, host), k) for k in choices)
    needed = int(needed * (1 + 10 * MARGIN) / (1 - MARGIN)) + 1
    host_text = "" if host is None else f" (with {format_bytes(host)} of host memory)"
    raise InfeasibleBudgetError(
        f"FlexGen's policy needs at least {format_bytes(needed)} ({needed} B) of device "
        f"memory{host_text}, with {smallest} GPU batches of {w.batch // smallest}; the "
        f"budget is {format_bytes(budget)} ({budget} B)",
        budget,
        needed,
    )
