"""Issue 25 on a real GPU: plans with a host tier on the CuPy backend – a pinned host arena,
reads and writes as host functions on the disk streams (`launch_host_func`), copies
between slots and the device waiting on events. The same runs on the CPU stand-in of
CUDA streams (tests/tiers/test_run_tiers_cupy.py, test_generate_tiers.py); these run
them against CUDA itself, whose host functions, pinned memory and copies the stand-in
only imitates.

Skipped cleanly without CuPy or a usable GPU.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import numpy as np
import pytest

import runtime

if not runtime.cupy_usable():
    pytest.skip(
        "needs CuPy and a CUDA GPU (pip install 'einpage[gpu]' or '.[gpu-cuda13]')",
        allow_module_level=True,
    )

TESTS = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(TESTS / "tiers"), str(TESTS / "models")]
from test_run_tiers import case, reference  # noqa: E402, F401  (the fixture is used)

from memgraph.nodes import NodeKind  # noqa: E402
from runtime.cupy_backend import CupyBackend  # noqa: E402
from runtime.tiers import host_arena_bytes  # noqa: E402

pytestmark = pytest.mark.gpu


class Counting(CupyBackend):
    """The CuPy backend, counting its pinned allocations."""

    def __init__(self, **options):
        super().__init__(**options)
        self.hosts: list[int] = []

    def allocate_host(self, nbytes):
        self.hosts.append(nbytes)
        return super().allocate_host(nbytes)


@pytest.mark.parametrize("poison", [False, True])
@pytest.mark.parametrize("mode", ["sequential", "streams"])
def test_a_tier_plan_runs_to_the_reference_on_the_gpu(case, mode, poison):  # noqa: F811
    mg, spill, weights, xs = case
    assert any(n.kind is NodeKind.WRITE for n in mg.nodes)  # spills, then reads back
    backend = Counting()
    got = runtime.run(mg, xs, backend=backend, mode=mode, spill=spill, poison=poison)
    expected = reference(mg, weights, xs)
    np.testing.assert_allclose(got["y"], expected["y"], rtol=1e-5, atol=1e-6)
    assert host_arena_bytes(mg) in backend.hosts  # the host arena: pinned, once
    assert os.listdir(spill) == []


def test_a_hugging_face_checkpoint_generates_transformers_tokens_on_the_gpu(tmp_path):
    """Weights read in place (o_proj and down_proj transposed back in host functions),
    streamed under a small host budget, on CUDA streams."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    pytest.importorskip("tokenizers")
    from hf_models import hf_llama
    from test_generate_api import hf_greedy

    from einpage.workloads.generate import Planning, Running, generate, reads_in_place

    model = hf_llama("gqa-tied")
    model.save_pretrained(tmp_path / "llama")
    prompt = np.array([[3, 14, 15, 9, 26], [5, 35, 8, 1, 32]])
    out = generate(
        tmp_path / "llama", prompt, 5, "60%", page_size=4, eos=(),
        plan=Planning(host_budget="35%", spill=tmp_path),
        run=Running(backend="cupy", mode="streams"),
    )  # fmt: skip
    assert reads_in_place(out.plan) and out.reports[-1].backend == "cupy"
    np.testing.assert_array_equal(out.ids, hf_greedy(model, prompt, 5))
