"""The cost model: a roofline per task, latency plus bandwidth per transfer, presets."""

from __future__ import annotations

import dataclasses
import doctest

import pytest

import einpage as ep
import memgraph.cost as cost_module
from einpage.errors import EinpageError
from memgraph.cost import PRESETS, CostModel, get_cost_model

H100 = PRESETS["h100-pcie5"]


def test_module_doctests():
    assert doctest.testmod(cost_module).failed == 0


def program():
    """%0 x f16[4096,4096], %1 w f16[4096,4096] (host), %2 x @ w, %3 exp(%2), %4 view, %5 %4*%4."""
    prog = ep.Program()
    x = prog.input("x", (4096, 4096), "float16")
    w = prog.input("w", (4096, 4096), "float16", role="weight")
    y = ep.exp(x @ w)
    flat = y.reshape(4096 * 4096)
    prog.output(flat * flat, "z")
    tg = prog.build()
    assert [t.kind for t in tg] == ["input", "input", "einsum", "einsum", "view", "einsum"]
    return tg


def test_a_large_matmul_is_compute_bound():
    tg = program()
    matmul = tg[2]
    assert matmul.flops == 2 * 4096**3
    compute = matmul.flops / H100.flops_per_s
    memory = 3 * 4096 * 4096 * 2 / H100.device_bytes_per_s
    assert compute > memory
    assert H100.task_seconds(tg, 2) == pytest.approx(H100.kernel_latency_s + compute)


def test_an_elementwise_op_is_memory_bound():
    tg = program()
    touched = 2 * 4096 * 4096 * 2  # read one f16 matrix, write one
    memory = touched / H100.device_bytes_per_s
    assert tg[3].flops / H100.flops_per_s < memory
    assert H100.task_seconds(tg, 3) == pytest.approx(H100.kernel_latency_s + memory)


def test_an_operand_read_twice_is_counted_once():
    tg = program()
    assert tg[5].inputs == (4, 4)
    memory = 2 * tg[5].nbytes / H100.device_bytes_per_s
    assert H100.task_seconds(tg, 5) == pytest.approx(H100.kernel_latency_s + memory)


def test_inputs_and_views_cost_nothing():
    tg = program()
    assert H100.task_seconds(tg, 0) == H100.task_seconds(tg, 1) == H100.task_seconds(tg, 4) == 0


def test_transfers_take_latency_plus_bytes_over_bandwidth():
    model = CostModel("link", 1e12, 1e12, h2d_bytes_per_s=4e9, d2h_bytes_per_s=2e9,
                      transfer_latency_s=1e-5)  # fmt: skip
    assert model.transfer_seconds(8e9, "h2d") == pytest.approx(1e-5 + 2.0)
    assert model.transfer_seconds(8e9, "d2h") == pytest.approx(1e-5 + 4.0)
    assert model.transfer_seconds(0, "h2d") == pytest.approx(1e-5)
    with pytest.raises(EinpageError, match="direction must be 'h2d' or 'd2h', got 'sideways'"):
        model.transfer_seconds(1, "sideways")


def test_presets_and_lookup():
    assert set(PRESETS) >= {"h100-pcie5", "cpu"}
    for name, model in PRESETS.items():
        assert model.name == name
        assert get_cost_model(name) is model
    custom = dataclasses.replace(H100, name="slow link", h2d_bytes_per_s=1e9)
    assert get_cost_model(custom) is custom
    # The H100 preset moves 1 GiB over PCIe in about 21.5 ms and runs fp16 matmuls at 400 TFLOP/s.
    assert H100.transfer_seconds(2**30, "h2d") == pytest.approx(0.0215, abs=5e-5)
    assert H100.flops_per_s == 400e12


def test_unknown_preset_lists_the_valid_ones():
    with pytest.raises(EinpageError, match="unknown cost model 'a100'; presets: h100-pcie5, cpu"):
        get_cost_model("a100")


@pytest.mark.parametrize(
    "field", ["flops_per_s", "device_bytes_per_s", "h2d_bytes_per_s", "d2h_bytes_per_s"]
)
@pytest.mark.parametrize("value", [0.0, -1.0])
def test_rates_must_be_positive(field, value):
    with pytest.raises(EinpageError, match=f"cost model 'bad': {field} must be positive"):
        dataclasses.replace(H100, name="bad", **{field: value})


def test_registered_cost_models_are_found_by_name(monkeypatch):
    import memgraph

    monkeypatch.setattr(cost_module, "PRESETS", dict(PRESETS))
    slow = CostModel("slow-link", 100e12, 1e12, 1e9, 1e9)
    memgraph.register_cost_model("slow-link", slow)
    assert get_cost_model("slow-link") is slow
    tg = program()
    mg = memgraph.plan(tg, "512MiB")
    assert memgraph.simulate(mg, "slow-link").cost_model is slow
    with pytest.raises(EinpageError, match="'slow-link' is already registered"):
        memgraph.register_cost_model("slow-link", slow)
    with pytest.raises(EinpageError, match="expected a CostModel"):
        memgraph.register_cost_model("other", {"flops_per_s": 1})
    with pytest.raises(EinpageError, match="unknown cost model 'tpu'.*slow-link"):
        get_cost_model("tpu")
