"""PROGRAM arguments (`einpage.cli.presets`): presets, TaskGraph files, Python files, inputs."""

from __future__ import annotations

import sys
import textwrap

import numpy as np
import pytest
from cli_runner import cli

import taskgraph
from einpage.cli.commands import EXIT_BAD_INPUT, EXIT_OK
from einpage.cli.presets import (
    PRESETS,
    ProgramSourceError,
    load_program,
    mlp_program,
    random_inputs,
)
from einpage.errors import SerializationError


def write(tmp_path, name: str, source: str):
    path = tmp_path / name
    path.write_text(textwrap.dedent(source))
    return path


GOOD = """
    import einpage as ep
    from helper import WIDTH  # a module beside the file, as `python FILE` would find it

    def build(batch=8, dtype="float32"):
        prog = ep.Program("mine")
        x = prog.input("x", (batch, WIDTH), dtype)
        w = prog.input("w", (WIDTH, WIDTH), dtype, role="weight")
        prog.output(ep.relu(x @ w), "y")
        return prog

    if __name__ == "__main__":
        raise SystemExit("the main block must not run when einpage loads the file")
"""


@pytest.fixture
def good_file(tmp_path):
    write(tmp_path, "helper.py", "WIDTH = 64\n")
    return write(tmp_path, "good.py", GOOD)


# -- presets --------------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_every_preset_builds_with_its_defaults_and_options(name):
    preset = PRESETS[name]
    if name.startswith(("llama:", "gpt2:")) and "tiny" not in name:
        tg = preset.build(seq=4)  # large models: check the shapes, quickly
        assert tg.name.endswith("-b1-s4")
    else:
        tg = preset.build()
    assert tg.outputs and tg.inputs


def test_preset_options_shape_the_program():
    tg = load_program("llama:tiny", batch=2, seq=8, dtype="float16")
    logits = tg[tg.outputs["logits"]]
    assert (logits.shape, logits.dtype) == ((2, 8, 256), "float16")
    mlp = load_program("mlp", batch=32)
    assert mlp[mlp.outputs["probs"]].shape == (32, 256)


@pytest.mark.parametrize(
    "source, options, needle",
    [
        ("nosuch", {}, "presets: mlp, llama:7b"),
        ("llama", {}, "unknown program 'llama'"),
        ("mlp", {"seq": 4}, "has no sequence length"),
        ("mlp", {"dtype": "int32"}, "needs a float dtype"),
        ("mlp", {"batch": 0}, "batch must be a positive int"),
    ],
)
def test_preset_errors(source, options, needle):
    with pytest.raises(ProgramSourceError, match=needle):
        load_program(source, **options)


def test_unknown_preset_on_the_command_line(capsys):
    code, _, err = cli(capsys, "plan", "llama:1t", "--budget", "1GiB")
    assert code == EXIT_BAD_INPUT
    assert err.startswith("einpage: error: unknown program 'llama:1t'")
    assert "llama:tiny" in err and "Traceback" not in err


def test_bad_dtype_on_the_command_line(capsys):
    code, _, err = cli(capsys, "show", "mlp", "--dtype", "float8")
    assert code == EXIT_BAD_INPUT
    assert "unsupported dtype 'float8'" in err


# -- TaskGraph files ------------------------------------------------------------------------


def test_taskgraph_files_load_with_validation(tmp_path):
    tg = load_program("llama:tiny", seq=4)
    path = tmp_path / "graph.json"
    path.write_text(tg.to_json())
    assert load_program(path).to_json() == tg.to_json()
    with pytest.raises(ProgramSourceError, match="fixed shapes; drop --batch"):
        load_program(path, batch=2)
    path.write_text(tg.to_json()[:-10])
    with pytest.raises(SerializationError, match="not a TaskGraph"):
        load_program(path)


def test_a_plan_is_not_a_program(capsys, tmp_path):
    plan = tmp_path / "plan.json"
    assert cli(capsys, "plan", "llama:tiny", "--seq", "4", "--budget", "1MiB", "-o", plan)[0] == 0
    code, _, err = cli(capsys, "show", plan)
    assert code == EXIT_BAD_INPUT
    assert "this is a plan: give it to `einpage run`, `stats` or `render`" in err


def test_files_of_other_kinds_are_refused(tmp_path):
    path = tmp_path / "program.txt"
    path.write_text("x")
    with pytest.raises(ProgramSourceError, match="a program file ends in .py"):
        load_program(path)


# -- Python files ---------------------------------------------------------------------------


def test_python_file_with_build(capsys, good_file):
    path_before = list(sys.path)
    tg = load_program(good_file, batch=4)
    assert tg.name == "mine" and tg[tg.inputs["x"]].shape == (4, 64)
    assert sys.path == path_before  # the file's folder is taken off sys.path again
    code, out, _ = cli(capsys, "plan", good_file, "--batch", "16", "--budget", "100%streaming")
    assert code == EXIT_OK
    assert "'mine': 4 tasks" in out


def test_python_file_with_a_program_variable(tmp_path):
    path = write(
        tmp_path,
        "fixed.py",
        """
        import einpage as ep
        program = ep.Program("fixed")
        x = program.input("x", (4, 4))
        program.output(ep.exp(x), "y")
        """,
    )
    assert load_program(path).name == "fixed"
    with pytest.raises(ProgramSourceError, match=r"fixed `program`; to use --batch, define"):
        load_program(path, batch=2)


def test_python_file_with_a_taskgraph(tmp_path):
    path = write(
        tmp_path,
        "graph.py",
        """
        from einpage.cli.presets import mlp_program
        program = mlp_program(batch=4, width=4, hidden=8, layers=1, classes=2).build()
        """,
    )
    assert len(load_program(path)) == len(mlp_program(4, 4, 8, 1, 2).build())


@pytest.mark.parametrize(
    "source, needle",
    [
        ("x = 1\n", "defines neither `program`"),
        ("program = 42\n", "`program` is a int, expected an einpage.Program"),
        ("def build():\n    return 'nope'\n", "build() is a str"),
        ("build = 3\n", "`build` is a int, not a function"),
        ("def f(:\n", "bad.py:1: SyntaxError"),
        ("import sys\nsys.exit(3)\n", "called exit(3)"),
        ("def build():\n    return 1 / 0\n", "bad.py:2: ZeroDivisionError: division by zero"),
        (
            "import einpage as ep\n"
            "prog = ep.Program()\n"
            "x = prog.input('x', (4, 5))\n"
            "program = prog.einsum('ab,bc->ac', x, x)\n",
            "bad.py:4: ShapeError: einsum spec 'ab,bc->ac'",
        ),
        ("import no_such_module_here\n", "bad.py:1: ModuleNotFoundError"),
    ],
)
def test_bad_python_files_say_where(capsys, tmp_path, source, needle):
    path = write(tmp_path, "bad.py", source)
    with pytest.raises(ProgramSourceError) as info:
        load_program(path)
    assert needle in str(info.value)
    code, _, err = cli(capsys, "show", path)
    assert code == EXIT_BAD_INPUT
    assert err.startswith("einpage: error: ") and "Traceback" not in err
    assert needle in err


def test_build_options_must_be_accepted(tmp_path, good_file):
    with pytest.raises(ProgramSourceError, match=r"build\(\) does not accept seq="):
        load_program(good_file, seq=3)


def test_missing_python_file(capsys, tmp_path):
    code, _, err = cli(capsys, "show", tmp_path / "absent.py")
    assert code == EXIT_BAD_INPUT
    assert err.startswith("einpage: error: no such file:")


# -- the demo MLP and inputs ----------------------------------------------------------------


def _numpy_mlp(arrays: dict[str, np.ndarray], layers: int) -> np.ndarray:
    """The demo MLP written directly in NumPy (float64), independent of einpage."""

    def gelu(v):
        return 0.5 * v * (1 + np.tanh(np.sqrt(2 / np.pi) * (v + 0.044715 * v**3)))

    f = {name: value.astype(np.float64) for name, value in arrays.items()}
    h = f["x"]
    for i in range(layers):
        up = gelu(h @ f[f"layers.{i}.w_up"] + f[f"layers.{i}.b_up"])
        h = h + up @ f[f"layers.{i}.w_down"]
    logits = h @ f["head.w_out"]
    e = np.exp(logits - logits.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def test_mlp_program_matches_numpy():
    tg = mlp_program(batch=32, width=16, hidden=64, layers=3, classes=10).build()
    arrays = random_inputs(tg, 3)
    probs = taskgraph.evaluate(tg, arrays)["probs"]
    np.testing.assert_allclose(probs, _numpy_mlp(arrays, 3), rtol=1e-5, atol=1e-6)


def test_random_inputs_are_reproducible_and_valid_ids():
    tg = load_program("gpt2:tiny", seq=8)
    a, b, c = random_inputs(tg, 1), random_inputs(tg, 1), random_inputs(tg, 2)
    assert all(np.array_equal(a[k], b[k]) for k in a)
    assert not all(np.array_equal(a[k], c[k]) for k in a)
    tg.check_inputs(a)
    tokens = a["tokens"]
    assert tokens.min() >= 0 and tokens.max() < 256 and len(np.unique(tokens)) > 2
    taskgraph.evaluate(tg, a)  # a gather with these ids works
