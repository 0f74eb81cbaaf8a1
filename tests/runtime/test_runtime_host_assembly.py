"""LLaMA (tiny) prefill with logits for every position, at half its streaming minimum.

The [1, 64, 256] logits are split and used to need their blocks and all of them on the
device at once (128 KiB, more than the budget): the planner refused. Assembled on the
host by sliced offloads, the plan fits, verifies, moves at least the lower bounds and
runs to the reference in every runtime mode, with and without host staging.
"""

from __future__ import annotations

import pytest
from cpu_cuda import CudaCopiesBackend
from runtime_cases import assert_outputs_match, make_inputs

import einpage as ep
import memgraph
import runtime
import taskgraph
from einpage.models import llama
from memgraph import NodeKind
from memgraph.bounds import host_inputs_of, transfer_lower_bounds
from runtime.numpy_backend import NumpyBackend
from runtime.schedule import MODES
from taskgraph.assembly import output_assemblies


class StagingNumpyBackend(NumpyBackend):
    """Host staging on, as on CuPy; records the box copies it is asked for."""

    host_staging = True

    def __init__(self):
        super().__init__()
        self.copies = []

    def copy_box(self, host, starts, device, direction, stream):
        self.copies.append((host.shape, tuple(starts), device.shape, direction))
        super().copy_box(host, starts, device, direction, stream)


@pytest.fixture(scope="module")
def case():
    tg = llama.prefill_program(llama.PRESETS["tiny"], 1, 64, "float32").build()
    mg = ep.compile(tg, "50%streaming", verify=False).plan  # partitioned: see the docstring
    inputs = make_inputs(tg, 0)
    return tg, mg, inputs, taskgraph.evaluate(tg, inputs)


def test_all_logits_fit_half_the_peak_once_assembled_on_the_host(case):
    tg, mg, _, _ = case
    logits = tg[tg.outputs["logits"]]
    assert mg.budget < 2 * logits.nbytes  # the device Concat could never fit
    report = memgraph.verify(mg)
    assert report.peak_bytes <= mg.budget
    parted = mg.taskgraph
    root = parted.outputs["logits"]
    assert parted[root].block.kind == "output"
    assert mg.info["outputs_on_host"] == ["logits"]
    fills = [n for n in mg.nodes if n.kind is NodeKind.OFFLOAD and n.into == root]
    assert len(fills) == mg.stats.sliced_offload_count > 1
    assert sum(parted[n.tensor].nbytes for n in fills) == logits.nbytes
    # Each block's box (from the Concats) is where its provenance says it is.
    for piece in output_assemblies(parted)[root]:
        block = parted[piece.task].block
        assert block.of == parted[root].block.of
        assert tuple(zip(block.starts, block.shape, strict=True)) == piece.box
    (output,) = [n for n in mg.of_kind(NodeKind.OUTPUT) if n.name == "logits"]
    assert output.storage is not None and set(output.deps) == {n.id for n in fills}


def test_the_plan_moves_at_least_the_lower_bounds(case):
    _, mg, _, _ = case
    order = [n.tensor for n in mg.of_kind(NodeKind.APPLY)]
    bounds = transfer_lower_bounds(mg.taskgraph, mg.budget, order, host_inputs_of(mg))
    stats = mg.stats
    assert bounds.reload_bytes <= stats.reload_bytes
    assert bounds.offload_bytes <= stats.offload_bytes


@pytest.mark.parametrize("mode", MODES)
def test_every_mode_gives_the_reference_logits(case, mode):
    _, mg, inputs, want = case
    got = runtime.run(mg, inputs, backend="numpy", mode=mode, seed=11)
    assert_outputs_match(got, want, mode)
    assert_outputs_match(got, taskgraph.evaluate(mg.taskgraph, inputs), mode)


def test_host_staging_gives_the_reference_logits(case):
    _, mg, inputs, want = case
    backend = StagingNumpyBackend()
    root = mg.taskgraph.outputs["logits"]
    fills = [n for n in mg.nodes if n.kind is NodeKind.OFFLOAD and n.into == root]
    with runtime.Session(mg, backend, mode="streams") as session:
        # The host buffer holds each storage once, at its size: no staged piece.
        slots = session.layout.storages
        assert {sid: (s.shape, s.dtype) for sid, s in slots.items()} == {
            sid: (s.shape, s.dtype) for sid, s in mg.storages.items()
        }
        assert_outputs_match(session.run(inputs), want, "staging")
    logits = mg.taskgraph[root].shape
    boxes = {(c[1], c[2]) for c in backend.copies if c[0] == logits and c[3] == "d2h"}
    assert boxes == {(n.box.starts, n.box.sizes) for n in fills}
    assert len(boxes) == mg.stats.sliced_offload_count


def test_the_cupy_box_copies_give_the_reference_logits(case):
    """The CuPy backend's copies (memcpy / memcpy2D planes, on the CPU stand-in) write
    each block straight into its box of the pinned logits."""
    _, mg, inputs, want = case
    backend = CudaCopiesBackend()
    assert_outputs_match(runtime.run(mg, inputs, backend, mode="streams"), want, "cupy copies")
    planes = [n for name, n in backend.cuda_runtime.calls if name == "memcpy2DAsync"]
    assert planes  # blocks of the logits are strided boxes of the host array
