"""FlexGen's policy search (`memgraph.flexgen`): the LP's policy fits the budget (bytes
summed here by hand), is at least as fast as every policy of a grid, keeps everything on
the GPU when everything fits, searches the block, and refuses impossible budgets with
typed errors."""

from __future__ import annotations

import doctest
import itertools

import pytest

import memgraph.flexgen as flexgen_module
from einpage.errors import EinpageError, InfeasibleBudgetError, PlanError
from memgraph.cost import CostModel
from memgraph.flexgen import (
    FlexGenPolicy,
    FlexGenWorkload,
    block_choices,
    policy_cost,
    search_policy,
)

MIB = 2**20
# A slow link and a fast GPU, so transfers dominate and the fractions matter.
MODEL = CostModel("test-link", 1e12, 1e12, 1e9, 1e9)


def workload(batch: int = 4, **changes) -> FlexGenWorkload:
    """A small generation: 4 layers of 1 MiB, a prompt of 16, 4 tokens."""
    fields = {
        "layers": 4,
        "batch": batch,
        "prompt": 16,
        "new_tokens": 4,
        "weight_bytes": 4 * MIB,
        "kv_bytes_per_token": 4096,
        "hidden_bytes_per_token": 2048,
        "act_bytes_per_token": 8192,
        "score_bytes_per_key": 64,
        "compute_seconds": (2e-3, 2e-4, 2e-4, 2e-4),
    }
    fields.update(changes)
    return FlexGenWorkload(**fields)


def gpu_bytes_by_hand(w: FlexGenWorkload, p: FlexGenPolicy) -> float:
    """The module's memory model written out part by part, largest over the steps."""
    wg, cg, hg = p.weights_gpu, p.cache_gpu, p.activations_gpu
    gbs = w.batch // p.gpu_batches
    layer = w.weight_bytes / w.layers
    cache_all = w.layers * w.batch * (w.prompt + w.new_tokens) * w.kv_bytes_per_token
    peaks = []
    for t in range(w.new_tokens):
        q = w.prompt if t == 0 else 1
        ctx = w.prompt if t == 0 else w.prompt + t
        resident = (
            wg * w.weight_bytes + cg * cache_all + hg * w.batch * q * w.hidden_bytes_per_token
        )
        weight_buffers = 2 * (1 - wg) * layer
        cache_buffers = 2 * (1 - cg) * gbs * ctx * w.kv_bytes_per_token
        hidden_buffers = 2 * (1 - hg) * gbs * q * w.hidden_bytes_per_token
        working = gbs * q * max(w.act_bytes_per_token, ctx * w.score_bytes_per_key)
        peaks.append(resident + weight_buffers + cache_buffers + hidden_buffers + working)
    return max(peaks)


def seconds_by_hand(w: FlexGenWorkload, p: FlexGenPolicy, model: CostModel) -> float:
    """Per layer and step: the longest of compute, the copies in and the copies out."""
    wg, cg, hg = p.weights_gpu, p.cache_gpu, p.activations_gpu
    layer = w.weight_bytes / w.layers
    total = 0.0
    for t in range(w.new_tokens):
        q = w.prompt if t == 0 else 1
        hidden = w.batch * q * w.hidden_bytes_per_token
        cache_before = 0 if t == 0 else w.batch * (w.prompt + t - 1) * w.kv_bytes_per_token
        new_cache = w.batch * q * w.kv_bytes_per_token
        weights_in = layer if t == 0 else (1 - wg) * layer
        h2d = weights_in + (1 - cg) * cache_before + (1 - hg) * hidden
        d2h = (1 - cg) * new_cache + (1 - hg) * hidden
        compute = w.compute_seconds[t] / w.layers
        compute += (p.gpu_batches - 1) * layer / model.device_bytes_per_s
        total += w.layers * max(compute, h2d / model.h2d_bytes_per_s, d2h / model.d2h_bytes_per_s)
    return total


def everything_resident(w: FlexGenWorkload) -> float:
    return gpu_bytes_by_hand(w, FlexGenPolicy(1.0, 1.0, 1.0, 1, w.batch))


def test_module_doctests():
    assert doctest.testmod(flexgen_module).failed == 0


@pytest.mark.parametrize("share", [0.45, 0.55, 0.7, 0.9])
def test_the_policy_fits_the_budget_counted_by_hand(share):
    w = workload()
    budget = int(share * everything_resident(w))
    policy = search_policy(w, budget, MODEL)
    assert gpu_bytes_by_hand(w, policy) <= budget
    assert abs(policy.cost.gpu_peak - gpu_bytes_by_hand(w, policy)) <= 1
    # below everything-resident something is left on the host
    assert min(policy.weights_gpu, policy.cache_gpu, policy.activations_gpu) < 1
    assert policy.cost.seconds == pytest.approx(seconds_by_hand(w, policy, MODEL), rel=1e-9)


def test_a_bounded_host_is_respected():
    """The unbounded policy fills the budget, so a host that holds what it offloads works,
    and a smaller host asks for more device memory."""
    w = workload()
    budget = int(0.6 * everything_resident(w))
    free = search_policy(w, budget, MODEL)
    offloaded = (
        (1 - free.weights_gpu) * w.weight_bytes
        + (1 - free.cache_gpu) * w.layers * w.batch * 20 * w.kv_bytes_per_token
        + (1 - free.activations_gpu) * w.batch * 16 * w.hidden_bytes_per_token
    )
    assert offloaded > 0 and free.cost.host_bytes == pytest.approx(offloaded, abs=1)
    bounded = search_policy(w, budget, MODEL, host_bytes=int(offloaded * 1.001))
    assert bounded.cost.host_bytes <= offloaded * 1.001
    assert gpu_bytes_by_hand(w, bounded) <= budget
    with pytest.raises(InfeasibleBudgetError) as caught:
        search_policy(w, budget, MODEL, host_bytes=int(offloaded * 0.9))
    assert caught.value.needed > budget
    assert search_policy(w, caught.value.needed, MODEL, host_bytes=int(offloaded * 0.9))


@pytest.mark.parametrize("share", [0.42, 0.5, 0.6, 0.8])
def test_no_policy_of_a_grid_is_faster(share):
    w = workload()
    budget = int(share * everything_resident(w))
    best = search_policy(w, budget, MODEL)
    grid = [i / 10 for i in range(11)]
    feasible = 0
    for k in block_choices(w.batch):
        for wg, cg, hg in itertools.product(grid, grid, grid):
            candidate = FlexGenPolicy(wg, cg, hg, k, w.batch // k)
            if gpu_bytes_by_hand(w, candidate) > budget:
                continue
            feasible += 1
            assert best.cost.seconds <= seconds_by_hand(w, candidate, MODEL) * (1 + 1e-9), (
                candidate,
                best,
            )
    assert feasible > 0  # the comparison was made


def test_everything_on_the_gpu_when_everything_fits():
    w = workload()
    policy = search_policy(w, int(1.01 * everything_resident(w)), MODEL)
    assert (policy.weights_gpu, policy.cache_gpu, policy.activations_gpu) == (1.0, 1.0, 1.0)
    assert policy.gpu_batches == 1
    # the weights cross once, for the prefill; nothing goes back
    assert policy.cost.h2d_bytes == w.weight_bytes and policy.cost.d2h_bytes == 0


def test_compute_bound_budgets_still_keep_all_they_can():
    """When compute hides every copy many policies are equally fast: the search keeps the
    one that moves the fewest bytes (here, everything resident)."""
    w = workload(compute_seconds=(1.0, 1.0, 1.0, 1.0))
    policy = search_policy(w, "64MiB", MODEL)
    assert (policy.weights_gpu, policy.cache_gpu, policy.activations_gpu) == (1.0, 1.0, 1.0)
    assert policy.cost.seconds == pytest.approx(4.0)


def test_a_block_of_gpu_batches_when_one_batch_does_not_fit():
    """Large attention scores: the whole batch's working set does not fit, a GPU batch of
    a quarter of it does (the zig-zag block)."""
    w = workload(batch=8, score_bytes_per_key=16384)
    one = gpu_bytes_by_hand(w, FlexGenPolicy(0.0, 0.0, 0.0, 1, 8))
    four = gpu_bytes_by_hand(w, FlexGenPolicy(0.0, 0.0, 0.0, 4, 2))
    budget = int((one + four) / 2)
    policy = search_policy(w, budget, MODEL)
    assert policy.gpu_batches >= 2 and policy.gpu_batch_size == 8 // policy.gpu_batches
    assert gpu_bytes_by_hand(w, policy) <= budget
    with pytest.raises(InfeasibleBudgetError):
        search_policy(w, budget, MODEL, gpu_batches=(1,))


def test_an_impossible_budget_is_a_typed_error_with_the_budget_that_works():
    w = workload()
    with pytest.raises(InfeasibleBudgetError) as caught:
        search_policy(w, "1MiB", MODEL)
    err = caught.value
    assert err.budget == MIB and err.needed > MIB
    assert "1.0 MiB" in str(err) and str(err.needed) in str(err)
    assert search_policy(w, err.needed, MODEL).cost.gpu_peak <= err.needed
    with pytest.raises(InfeasibleBudgetError):  # and it is the smallest, up to rounding
        search_policy(w, int(err.needed * 0.999), MODEL)


def test_a_host_too_small_is_a_typed_error():
    w = workload()
    budget = int(0.5 * everything_resident(w))
    with pytest.raises(InfeasibleBudgetError) as caught:
        search_policy(w, budget, MODEL, host_bytes=1024)
    assert "host" in str(caught.value)
    # the host holds next to nothing: the device must hold about everything
    resident = min(
        gpu_bytes_by_hand(w, FlexGenPolicy(1.0, 1.0, 1.0, k, w.batch // k))
        for k in block_choices(w.batch)
    )
    assert caught.value.needed >= resident - 2 * 1024
    policy = search_policy(w, caught.value.needed, MODEL, host_bytes=1024)
    assert policy.cost.host_bytes <= 1024


@pytest.mark.parametrize(
    "changes, words",
    [
        ({"layers": 0}, "layers must be an int >= 1"),
        ({"weight_bytes": -1}, "weight_bytes must be an int >= 0"),
        ({"compute_seconds": (1e-3,)}, "one entry per step"),
        ({"compute_seconds": (1e-3, -1.0, 0.0, 0.0)}, "compute_seconds must be >= 0"),
    ],
)
def test_bad_workloads_are_refused(changes, words):
    with pytest.raises(PlanError, match=words):
        workload(**changes)


def test_bad_policies_and_blocks_are_refused():
    w = workload()
    with pytest.raises(PlanError, match="must divide the batch"):
        search_policy(w, "64MiB", MODEL, gpu_batches=(3,))
    with pytest.raises(PlanError, match=r"in \[0, 1\]"):
        policy_cost(w, FlexGenPolicy(1.5, 0.0, 0.0, 1, 4), MODEL)
    with pytest.raises(EinpageError, match="unknown cost model"):
        search_policy(w, "64MiB", "no-such-machine")
