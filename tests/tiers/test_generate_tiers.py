"""Generation with a host tier: a Hugging Face checkpoint's weights read where they are.

`generate(folder, ..., plan=Planning(host_budget=, spill=))` and `einpage generate
--checkpoint DIR --host-budget SIZE --spill DIR` plan host memory too: the weights are
read from the `save_pretrained` folder's safetensors at the offsets its header gives –
`o_proj` and `down_proj`, which Hugging Face stores transposed, transposed back as they
are read – and never loaded whole. The reference is transformers' own greedy `generate`
on the model that was saved; the plan is checked to read every weight from the file,
and a small host budget to read weights more than once (streamed, not kept).
"""

from __future__ import annotations

import copy
import re
import sys
from pathlib import Path

import numpy as np
import pytest
from cli_runner import cli

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("tokenizers")  # test_generate_api, whose hf_greedy is reused, needs it

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "models"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "runtime"))
from cpu_cuda import CXX  # noqa: E402
from cuda_streams import StandInCupyBackend  # noqa: E402
from gguf_files import hf_model, write_gguf  # noqa: E402
from hf_models import hf_gpt2, hf_llama  # noqa: E402
from test_generate_api import hf_greedy  # noqa: E402  (never stops: eos is no id)
from test_llama_variants import hf_model as variant_model  # noqa: E402

from einpage.cli.commands import EXIT_BAD_INPUT, EXIT_OK  # noqa: E402
from einpage.errors import CheckpointError, GenerationError  # noqa: E402
from einpage.models import llama  # noqa: E402
from einpage.pipeline import compile as compile_program  # noqa: E402
from einpage.workloads.generate import Running, generate, reads_in_place  # noqa: E402
from einpage.workloads.generation import GenerationSpec, Planning  # noqa: E402
from einpage_core.errors import PlanError  # noqa: E402
from memgraph.tiers import CheckpointPlace  # noqa: E402
from runtime.tiers import disk_inputs  # noqa: E402

PROMPT = np.array([[3, 14, 15, 9, 26], [5, 35, 8, 1, 32]])
NEW = 5


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """{variant: (folder, model)}: the tiny LLaMAs of `hf_models` saved by save_pretrained."""
    made = {}
    for variant in ("mha", "gqa-tied"):
        folder = tmp_path_factory.mktemp(f"llama-{variant}")
        model = hf_llama(variant)
        model.save_pretrained(folder)
        made[variant] = (folder, model)
    return made


def weight_bytes(out) -> int:
    return sum(out.plan.plan.storages[sid].nbytes for sid in disk_inputs(out.plan.plan).values())


@pytest.mark.parametrize("variant", ["mha", "gqa-tied"])
@pytest.mark.parametrize("host_budget", ["100%", "35%"])
def test_generate_reads_a_hugging_face_checkpoint_in_place(saved, tmp_path, variant, host_budget):
    folder, model = saved[variant]
    want = hf_greedy(model, PROMPT, NEW)
    out = generate(
        folder, PROMPT, NEW, "60%", page_size=4, eos=(),
        plan=Planning(host_budget=host_budget, spill=tmp_path),
    )  # fmt: skip
    np.testing.assert_array_equal(out.ids, want)
    mg = out.plan.plan
    assert reads_in_place(out.plan)
    assert set(disk_inputs(mg)) == set(out.spec.cfg.weight_shapes())  # every weight
    places = {name: mg.storages[sid].disk for name, sid in disk_inputs(mg).items()}
    transposed = {name for name, place in places.items() if place.transposed is not None}
    assert transposed == {f"layers.{i}.{w}" for i in range(2) for w in ("attn.wo", "mlp.w_down")}
    assert out.stats.cost_model == "h100-pcie5+nvme-pcie4"  # simulated over a disk too
    assert out.stats.simulated_seconds >= mg.stats.disk_read_bytes / 7e9
    stats = mg.stats
    assert stats.host_peak_bytes <= stats.host_budget
    if host_budget == "35%":  # streamed: weights read again before later uses
        assert stats.checkpoint_read_bytes > weight_bytes(out)
    else:  # all kept: each read once
        assert stats.checkpoint_read_bytes == weight_bytes(out)


@pytest.mark.parametrize("mode", ["sequential", "streams", "random"])
@pytest.mark.parametrize("direct_io", [False, True])
def test_every_runtime_mode_reads_the_same_tokens(saved, tmp_path, mode, direct_io):
    """Buffered and, where the file system allows it (the report says), O_DIRECT."""
    folder, model = saved["mha"]
    out = generate(
        folder, PROMPT, NEW, "60%", page_size=4, eos=(),
        plan=Planning(host_budget="35%", spill=tmp_path),
        run=Running(mode=mode, direct_io=direct_io),
    )  # fmt: skip
    np.testing.assert_array_equal(out.ids, hf_greedy(model, PROMPT, NEW))
    if not direct_io:
        assert not any(out.reports[-1].disk_direct)


def test_a_bfloat16_checkpoint_is_read_in_its_own_dtype(tmp_path):
    """A bfloat16 checkpoint is planned in bfloat16 (its config's dtype) and read as
    stored: the tokens are those of the same generation with the weights in memory."""
    folder = tmp_path / "bf16"
    copy.deepcopy(hf_llama("gqa-tied")).to(torch.bfloat16).save_pretrained(folder)
    kept = generate(folder, PROMPT, NEW, "60%", page_size=4, eos=())
    tiered = generate(
        folder, PROMPT, NEW, "60%", page_size=4, eos=(),
        plan=Planning(host_budget="35%", spill=tmp_path),
    )  # fmt: skip
    assert tiered.spec.dtype == "bfloat16" and reads_in_place(tiered.plan)
    np.testing.assert_array_equal(tiered.ids, kept.ids)


@pytest.mark.parametrize("kind", ["qwen2", "mistral"])
def test_the_other_llama_families_are_read_in_place(tmp_path, kind):
    """Qwen2 (query, key and value biases; a tied head) and Mistral (its LLaMA layout;
    the 10 positions here within its sliding window of 12, as einpage plans it)."""
    model = variant_model(kind)
    model.save_pretrained(tmp_path / kind)
    ids = np.array([[1, 7, 30, 4, 9, 17]])
    out = generate(
        tmp_path / kind, ids, 5, "60%", page_size=4, eos=(),
        plan=Planning(host_budget="40%", spill=tmp_path),
    )  # fmt: skip
    assert reads_in_place(out.plan)
    if kind == "qwen2":
        assert "layers.0.attn.bq" in disk_inputs(out.plan.plan)
    np.testing.assert_array_equal(out.ids, hf_greedy(model, ids, 5))


def test_weights_given_in_memory_are_not_read_from_the_checkpoint(saved, tmp_path):
    """weights= a mapping: the host tier holds only what the plan offloads; the weights
    are the caller's arrays."""
    folder, model = saved["mha"]
    cfg = llama.LlamaConfig.from_checkpoint(folder)
    weights = llama.weights_from_state_dict(cfg, model.state_dict())
    out = generate(
        folder, PROMPT, NEW, "60%", page_size=4, eos=(), weights=weights,
        plan=Planning(host_budget="100%", spill=tmp_path),
    )  # fmt: skip
    assert not reads_in_place(out.plan) and out.plan.plan.tier is not None
    np.testing.assert_array_equal(out.ids, hf_greedy(model, PROMPT, NEW))


def test_a_config_planned_with_a_checkpoint_to_read_needs_no_weights(saved, tmp_path):
    """generate(cfg, ..., plan=Planning(checkpoint=folder)): the run reads the folder's
    weights in place, so none are given."""
    folder, model = saved["mha"]
    cfg = llama.LlamaConfig.from_checkpoint(folder)
    out = generate(
        cfg, PROMPT, NEW, "60%", page_size=4, eos=(),
        plan=Planning(host_budget="35%", spill=tmp_path, checkpoint=folder),
    )  # fmt: skip
    assert reads_in_place(out.plan)
    np.testing.assert_array_equal(out.ids, hf_greedy(model, PROMPT, NEW))


# -- what is refused -------------------------------------------------------------


def test_weights_given_besides_a_checkpoint_to_read_are_refused(saved):
    folder, model = saved["mha"]
    cfg = llama.LlamaConfig.from_checkpoint(folder)
    weights = llama.weights_from_state_dict(cfg, model.state_dict())
    with pytest.raises(GenerationError, match="weights= are given, and Planning.checkpoint"):
        generate(
            folder, PROMPT, 3, "60%", weights=weights,
            plan=Planning(host_budget="50%", checkpoint=folder),
        )  # fmt: skip


def test_gpt2_fused_attention_weights_are_refused_by_name(tmp_path):
    hf_gpt2("base").save_pretrained(tmp_path / "gpt2")
    with pytest.raises(CheckpointError, match=r"c_attn\.weight.*side by side.*save_weights"):
        generate(tmp_path / "gpt2", PROMPT, 3, "60%", plan=Planning(host_budget="50%"), run=None)


def test_a_checkpoint_in_another_dtype_than_the_plan_is_refused(saved):
    folder, _ = saved["mha"]
    with pytest.raises(CheckpointError, match=r"is float32.*program's input is bfloat16.*float32"):
        generate(
            folder, PROMPT, 3, "60%", dtype="bfloat16", plan=Planning(host_budget="50%"),
            run=None,
        )  # fmt: skip


def test_a_quantized_generation_cannot_read_its_weights_in_place(saved):
    folder, _ = saved["mha"]
    with pytest.raises(GenerationError, match="quantized on the host"):
        generate(folder, PROMPT, 3, "60%", quant="int8", plan=Planning(host_budget="50%"), run=None)


def test_a_gguf_file_is_not_read_in_place(tmp_path):
    path = write_gguf(tmp_path / "m.gguf", hf_model("llama", hidden=64, ffn=96), "llama")
    with pytest.raises(GenerationError, match="GGUF.*not built"):
        generate(path, np.array([[1, 2, 3]]), 2, "60%", plan=Planning(host_budget="50%"), run=None)


def test_direct_io_without_a_host_tier_is_refused(saved):
    folder, _ = saved["mha"]
    with pytest.raises(GenerationError, match=r"direct_io=True.*Planning\(host_budget"):
        generate(folder, PROMPT, 3, "60%", run=Running(direct_io=True))
    with pytest.raises(GenerationError, match="direct_io must be True or False"):
        Running(direct_io="yes")


@pytest.mark.parametrize(
    ("fields", "said"),
    [
        ({"way": "steps", "host_budget": "1GiB"}, "host_budget=.*unrolled"),
        ({"devices": 2, "spill": "/tmp"}, "spill=.*one device"),
        ({"host_budget": 1.5}, "host_budget must be bytes or a size"),
        ({"checkpoint": 7}, "checkpoint must be a path"),
    ],
)
def test_planning_refuses_a_host_tier_where_it_is_not_built(fields, said):
    with pytest.raises(GenerationError, match=said):
        Planning(**fields)


def test_compile_takes_places_only_of_its_inputs():
    spec = GenerationSpec(llama.FAMILY, llama.PRESETS["tiny"], 1, 4, 2, "float32", 4)
    tg = spec.generation_program().build()
    place = CheckpointPlace("/nowhere.safetensors", 1 << 20, 8)
    with pytest.raises(PlanError, match="'no.such', which is not an input"):
        compile_program(tg, "100%", checkpoint={"no.such": place})
    with pytest.raises(PlanError, match="maps 'embed' to tuple"):
        compile_program(tg, "100%", checkpoint={"embed": ("/x", 8)})


# -- the command line -----------------------------------------------------------


def test_cli_generates_with_a_host_tier_and_writes_a_plan_run_can_check(
    saved, tmp_path, capsys
):
    folder, model = saved["gqa-tied"]
    spill = tmp_path / "spill"
    spill.mkdir()
    plan = tmp_path / "plan.json"
    code, out, err = cli(
        capsys, "generate", "--checkpoint", folder, "--budget", "60%", "--host-budget", "35%",
        "--spill", spill, "--prompt-len", 5, "--new-tokens", NEW, "--page-size", 4, "--run",
        "--backend", "numpy", "-o", plan, "--ignore-eos", "--direct-io",
    )  # fmt: skip
    assert code == EXIT_OK, err
    assert "checkpoint, read in place by the host tier" in out
    assert re.search(r"disk transfers +(O_DIRECT for \d of \d files|through the page cache)", out)
    prompt = np.random.default_rng(0).integers(0, 96, (1, 5))  # the CLI's random prompt
    want = hf_greedy(model, prompt, NEW)[0]
    line = " ".join(map(str, want[:5])) + " | " + " ".join(map(str, want[5:]))
    assert line in out
    assert list(spill.iterdir()) == []  # the spill file leaves nothing
    code, out, err = cli(capsys, "run", plan, "--spill", spill, "--check", "--backend", "numpy")
    assert code == EXIT_OK, err


@pytest.mark.parametrize(
    ("extra", "said"),
    [
        (("--devices", "2"), "one device"),
        (("--way", "steps"), "--way unrolled"),
        (("--direct-io",), "--direct-io says how --run"),
    ],
)
def test_cli_refuses_a_host_tier_where_it_is_not_built(saved, capsys, extra, said):
    folder, _ = saved["mha"]
    code, _, err = cli(
        capsys, "generate", "--checkpoint", folder, "--budget", "60%", "--host-budget", "1GiB",
        *extra,
    )  # fmt: skip
    assert code == EXIT_BAD_INPUT
    assert said in err


def test_the_cupy_backend_reads_a_checkpoint_in_place_too(saved, tmp_path):
    """On the CuPy backend (its CPU stand-in: no GPU here) the reads, transposed ones
    included, are host functions in their stream's order into a pinned host arena."""
    if CXX is None:
        pytest.skip("no host C++ compiler (g++) for the stand-in's kernels")
    folder, model = saved["mha"]
    backend = StandInCupyBackend(delay=5e-4)
    out = generate(
        folder, PROMPT, NEW, "60%", page_size=4, eos=(),
        plan=Planning(host_budget="35%", spill=tmp_path),
        run=Running(backend=backend, mode="streams"),
    )  # fmt: skip
    np.testing.assert_array_equal(out.ids, hf_greedy(model, PROMPT, NEW))
    assert out.reports[-1].backend == "cupy-standin"


def test_a_sharded_checkpoint_is_read_in_place_from_each_shard(saved, tmp_path):
    """A checkpoint saved in shards (`model.safetensors.index.json`, as large models are):
    each weight read from the shard the index names."""
    _, model = saved["gqa-tied"]
    folder = tmp_path / "sharded"
    model.save_pretrained(folder, max_shard_size="20KB")
    assert (folder / "model.safetensors.index.json").is_file()
    out = generate(
        folder, PROMPT, NEW, "60%", page_size=4, eos=(),
        plan=Planning(host_budget="35%", spill=tmp_path),
    )  # fmt: skip
    files = [f for f in out.plan.plan.tier.files if f.kind == "checkpoint"]
    assert len(files) > 1  # several shards read
    np.testing.assert_array_equal(out.ids, hf_greedy(model, PROMPT, NEW))
