"""A checkpoint is planned in its own dtype unless told otherwise (issue 27, item 2): a
bfloat16 checkpoint saved by `save_pretrained` plans in bfloat16 (not float32, twice its
memory), the explicit dtype still wins, the command line says which dtype ran and why,
its help lists every float dtype, and a dtype einpage does not plan in is refused."""

from __future__ import annotations

import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from einpage.cli.commands import EXIT_BAD_INPUT, EXIT_OK, main  # noqa: E402
from einpage.models.checkpoint import checkpoint_dtype  # noqa: E402
from einpage.models.errors import CheckpointError  # noqa: E402
from einpage.workloads.generate import generate  # noqa: E402
from taskgraph import dtypes  # noqa: E402

IDS = np.array([[3, 17, 5, 40]], np.int64)


def save(folder, dtype):
    """A 1-layer random LLaMA saved by save_pretrained in `dtype` (a torch dtype)."""
    config = transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).to(dtype).save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def bf16_checkpoint(tmp_path_factory):
    return save(tmp_path_factory.mktemp("bf16"), torch.bfloat16)


def weight_dtypes(out):
    tg = out.plan.plans["unrolled"].program
    return {tg[i].dtype for i in tg.inputs.values() if tg[i].op.role == "weight"}


def test_a_bfloat16_checkpoint_plans_in_bfloat16_by_default(bf16_checkpoint):
    out = generate(bf16_checkpoint, IDS, 3, "100%", page_size=4, run=None)
    assert out.spec.dtype == "bfloat16"
    assert weight_dtypes(out) == {"bfloat16"}


def test_the_given_dtype_wins(bf16_checkpoint):
    out = generate(bf16_checkpoint, IDS, 3, "100%", dtype="float32", page_size=4, run=None)
    assert out.spec.dtype == "float32" and weight_dtypes(out) == {"float32"}


def test_a_float32_checkpoint_and_a_config_stay_float32(tmp_path, bf16_checkpoint):
    folder = save(tmp_path / "f32", torch.float32)
    assert generate(folder, IDS, 2, "100%", page_size=4, run=None).spec.dtype == "float32"


def test_the_run_reads_the_bfloat16_weights_as_they_are(bf16_checkpoint):
    """Run in the checkpoint's dtype: the same ids as the run given bfloat16 explicitly,
    and the host memory it checks is that of bfloat16 weights."""
    auto = generate(bf16_checkpoint, IDS, 3, "100%", page_size=4)
    given = generate(bf16_checkpoint, IDS, 3, "100%", dtype="bfloat16", page_size=4)
    np.testing.assert_array_equal(auto.ids, given.ids)


def test_the_command_line_says_which_dtype_ran_and_why(bf16_checkpoint, capsys):
    code = main(["generate", "--checkpoint", str(bf16_checkpoint), "--budget", "100%",
                 "--prompt-len", "4", "--new-tokens", "2", "--page-size", "4"])  # fmt: skip
    out = capsys.readouterr().out
    assert code == EXIT_OK
    assert "bfloat16 (the checkpoint's)" in out
    code = main(["generate", "--checkpoint", str(bf16_checkpoint), "--budget", "100%",
                 "--prompt-len", "4", "--new-tokens", "2", "--page-size", "4",
                 "--dtype", "float32"])  # fmt: skip
    assert code == EXIT_OK and "float32 (given)" in capsys.readouterr().out
    code = main(["generate", "llama:tiny", "--budget", "100%", "--prompt-len", "4",
                 "--new-tokens", "2", "--page-size", "4"])  # fmt: skip
    assert code == EXIT_OK and "float32 (the default)" in capsys.readouterr().out


def test_the_help_lists_every_float_dtype(capsys):
    assert main(["generate", "--help"]) == EXIT_OK
    help_text = " ".join(capsys.readouterr().out.split())
    assert ", ".join(dtypes.FLOAT_DTYPES) in help_text
    assert "bfloat16" in dtypes.FLOAT_DTYPES


def test_a_dtype_that_is_not_a_float_type_is_refused_on_the_command_line(capsys):
    code = main(["generate", "llama:tiny", "--budget", "1MiB", "--dtype", "int8"])
    assert code != EXIT_OK
    assert "expected one of float16, bfloat16, float32, float64, got 'int8'" in (
        capsys.readouterr().err
    )


@pytest.mark.parametrize("value", ["int8", "float8_e4m3fn", 16])
def test_a_checkpoint_dtype_einpage_does_not_plan_in_is_refused(tmp_path, value):
    folder = save(tmp_path / "odd", torch.float32)
    config = json.loads((folder / "config.json").read_text())
    config["dtype"] = value
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=f"dtype is {value!r}, which einpage does not"):
        generate(folder, IDS, 2, "100%", page_size=4, run=None)
    code = main(["generate", "--checkpoint", str(folder), "--budget", "100%"])
    assert code == EXIT_BAD_INPUT
    # given explicitly, the checkpoint's is not consulted
    assert generate(folder, IDS, 2, "100%", dtype="float32", run=None).spec.dtype == "float32"


def test_the_older_torch_dtype_key_and_its_torch_spelling():
    assert checkpoint_dtype({"torch_dtype": "torch.bfloat16"}, "c") == "bfloat16"
    assert checkpoint_dtype({"dtype": "auto", "torch_dtype": "float16"}, "c") == "float16"
    assert checkpoint_dtype({}, "c") is None
