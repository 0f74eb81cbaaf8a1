"""The Program builder: inputs, einsums, structural ops, scopes, pruning, and its errors."""

from __future__ import annotations

import numpy as np
import pytest

import einpage as ep
import taskgraph
from einpage.errors import (
    DTypeError,
    EinpageError,
    JoinError,
    ProgramError,
    ShapeError,
    SpecError,
)


def test_input_defaults_and_repr():
    prog = ep.Program("p")
    x = prog.input("x", (64, 512))
    w = prog.input("w", [512, 2048], dtype=np.float16, role="weight")
    assert (x.shape, x.dtype, x.ndim, x.size, x.nbytes) == ((64, 512), "float32", 2, 32768, 131072)
    assert w.dtype == "float16"
    assert repr(x) == '<Tensor %0 : f32[64,512] = input["x", activation, device]>'
    assert repr(w) == '<Tensor %1 : f16[512,2048] = input["w", weight, host]>'
    assert repr(prog) == "<Program 'p' tasks=2 inputs=2 outputs=0>"
    z = prog.input("z", (3,), role="weight", location="device")
    assert z.task.op.location == "device"


@pytest.mark.parametrize(
    "kwargs, error, message",
    [
        ({"shape": (2, 0)}, ShapeError, "non-positive dimension 0"),
        ({"shape": (2, -1)}, ShapeError, "non-positive dimension -1"),
        ({"shape": (2, 1.5)}, ShapeError, "non-integer dimension"),
        ({"shape": 3}, ShapeError, "sequence of ints"),
        ({"dtype": "complex64"}, DTypeError, "unsupported dtype 'complex64'"),
        ({"role": "bias"}, ProgramError, "role must be one of"),
        ({"location": "disk"}, ProgramError, "location must be one of"),
    ],
)
def test_input_errors(kwargs, error, message):
    args = {"shape": (2, 3), **kwargs}
    with pytest.raises(error, match=message):
        ep.Program().input("x", **args)


def test_duplicate_names_are_rejected():
    prog = ep.Program()
    x = prog.input("x", (2,))
    with pytest.raises(ProgramError, match="input named 'x' already exists"):
        prog.input("x", (3,))
    prog.output(x, "y")
    with pytest.raises(ProgramError, match="output named 'y' already exists"):
        prog.output(x, "y")


def test_einsum_errors_name_the_culprit():
    prog = ep.Program()
    a = prog.input("a", (2, 3))
    b = prog.input("b", (4, 5))
    h = prog.input("h", (3, 4), dtype="float16")
    with pytest.raises(ShapeError, match="index 'j' has size 3 in operand 0 but 4 in operand 1"):
        prog.einsum("ij,jk->ik", a, b)
    with pytest.raises(SpecError, match="2 operand term.* 1 operand"):
        prog.einsum("ij,jk->ik", a)
    with pytest.raises(SpecError, match="output index 'z' appears in no operand"):
        prog.einsum("ij->iz", a)
    with pytest.raises(SpecError, match="output index 'i' is repeated"):
        prog.einsum("ij->ii", a)
    with pytest.raises(SpecError, match="unknown agg 'mean'"):
        prog.einsum("ij->i", a, agg="mean")
    with pytest.raises(DTypeError, match="operand 1 is float16 but operand 0 is float32"):
        prog.einsum("ij,jk->ik", a, h)
    with pytest.raises(JoinError, match="unknown function 'sinh'") as info:
        prog.einsum("ij->ij", a, join="a + sinh(a)")
    assert info.value.column == 4
    with pytest.raises(JoinError, match="operand 'b'"):
        prog.einsum("ij->ij", a, join="a + b")
    with pytest.raises(SpecError, match="at least one operand"):
        prog.einsum("->")


def test_tensors_of_another_program_are_rejected():
    a = ep.Program("one").input("a", (2,))
    other = ep.Program("two")
    with pytest.raises(ProgramError, match="belongs to program 'one', not 'two'"):
        other.einsum("i->i", a)
    with pytest.raises(ProgramError, match="expected a Tensor"):
        other.einsum("i->i", np.ones(2))
    with pytest.raises(ProgramError, match="different programs"):
        ep.add(a, other.input("b", (2,)))
    with pytest.raises(ProgramError, match="no truth value"):
        bool(a)


def test_multi_operand_einsum_is_split_along_the_path():
    prog = ep.Program()
    ops = [prog.input(n, s) for n, s in zip("abcd", [(2, 3), (3, 4), (4, 5), (5, 6)], strict=True)]
    prog.output(prog.einsum("ij,jk,kl,lm->im", *ops, label="chain"), "out")
    tg = prog.build()
    einsums = [t for t in tg if t.kind == "einsum"]
    assert len(einsums) == 3 and all(len(t.inputs) == 2 for t in einsums)
    assert einsums[-1].label == "chain" and einsums[-1].shape == (2, 6)
    with pytest.raises(ProgramError, match="unknown optimize='fastest'; valid: auto"):
        prog.einsum("ij,jk,kl->il", *ops[:3], optimize="fastest")
    with pytest.raises(ProgramError, match="found no path"):
        prog.einsum(
            "i,i,i->", *[prog.input(f"v{i}", (2,)) for i in range(3)], optimize="dp", memory_limit=1
        )


def test_memory_limited_path_steps_become_pairwise():
    # A memory limit makes opt_einsum contract several operands in one step.
    prog = ep.Program()
    shapes = [(8, 8), (8, 8), (8, 8), (8, 8)]
    ops = [prog.input(f"x{i}", s) for i, s in enumerate(shapes)]
    prog.output(prog.einsum("ab,bc,cd,de->ae", *ops, memory_limit=1), "out")
    tg = prog.build()
    assert all(len(t.inputs) <= 2 for t in tg if t.kind == "einsum")
    rng = np.random.default_rng(1)
    arrays = {f"x{i}": rng.standard_normal(s).astype("float32") for i, s in enumerate(shapes)}
    expected = np.linalg.multi_dot([arrays[f"x{i}"] for i in range(4)])
    np.testing.assert_allclose(
        taskgraph.evaluate(tg, arrays)["out"], expected, rtol=1e-4, atol=1e-4
    )


def test_generalized_multi_operand_einsum_is_one_task():
    prog = ep.Program()
    a, b, c = (prog.input(n, (2, 3)) for n in "abc")
    y = prog.einsum("ij,ij,ij->ij", a, b, c, join="a * b + c")
    assert len(y.task.inputs) == 3


def test_plain_contractions_take_diagonals_first_and_generalized_ones_read_them():
    prog = ep.Program()
    a = prog.input("a", (3, 3, 4))
    b = prog.input("b", (4, 5))
    y = prog.einsum("aab,bc->ac", a, b, label="y")
    einsums = [prog._builder.tasks[i] for i in (y.task.inputs[0], y.id)]
    assert [str(t.op.spec) for t in einsums] == ["aab->ab", "ab,bc->ac"]
    assert einsums[0].label == "diagonal" and einsums[1].label == "y"
    trace = prog.einsum("aab,c->c", a, prog.input("c", (5,)))  # a's indices needed nowhere
    assert str(prog._builder.tasks[trace.task.inputs[0]].op.spec) == "aab->"
    alone = prog.einsum("aab->ab", a)  # one operand: the diagonal is the einsum
    assert str(alone.task.op.spec) == "aab->ab" and alone.task.inputs == (a.id,)
    fused = prog.einsum("aab,bc->ac", a, b, join="a - b")  # generalized: one task
    assert str(fused.task.op.spec) == "aab,bc->ac" and fused.task.inputs == (a.id, b.id)


def test_named_size_one_dims_broadcast_as_in_numpy():
    prog = ep.Program()
    a = prog.input("a", (2, 1), "float64")
    b = prog.input("b", (3, 4), "float64")
    prog.output(prog.einsum("ij,jk", a, b), "y")
    tg = prog.build()
    rng = np.random.default_rng(0)
    arrays = {"a": rng.standard_normal((2, 1)), "b": rng.standard_normal((3, 4))}
    got = taskgraph.evaluate(tg, arrays)["y"]
    np.testing.assert_allclose(got, np.einsum("ij,jk", arrays["a"], arrays["b"]))


def test_scopes_nest_and_label_tasks():
    prog = ep.Program()
    x = prog.input("x", (2, 2))
    with prog.scope("layers.0"), prog.scope("attn"):
        y = ep.exp(x)
    z = ep.exp(y)
    assert y.task.scope == "layers.0.attn" and z.task.scope == ""
    with pytest.raises(ProgramError, match="scope name"), prog.scope(""):
        pass


def test_build_prunes_dead_tasks_but_keeps_inputs():
    prog = ep.Program()
    x = prog.input("x", (2,))
    unused = prog.input("unused", (3,))
    ep.exp(unused)
    prog.output(ep.exp(x), "y")
    pruned = prog.build()
    assert [t.kind for t in pruned] == ["input", "input", "einsum"]
    assert [t.id for t in pruned] == [0, 1, 2]
    assert len(prog.build(prune=False)) == 4
    with pytest.raises(ProgramError, match="has no outputs"):
        ep.Program("empty").build()


def test_views_slices_concat_fill_gather():
    prog = ep.Program()
    x = prog.input("x", (2, 6))
    ids = prog.input("ids", (3,), dtype="int64")
    table = prog.input("table", (5, 4), role="weight")
    v = prog.view(x, (3, -1))
    s = prog.slice(x, (1, 2), (1, 3))
    c = prog.concat([x, x], axis=-1)
    f = prog.fill((2, 2), 7.0)
    g = prog.gather(table, ids)
    assert (v.shape, s.shape, c.shape, f.shape, g.shape) == (
        (3, 4),
        (1, 3),
        (2, 12),
        (2, 2),
        (3, 4),
    )
    with pytest.raises(ShapeError, match="at most one dimension may be -1"):
        prog.view(x, (-1, -1))
    with pytest.raises(ShapeError, match="cannot view shape"):
        prog.view(x, (5, -1))
    with pytest.raises(ShapeError, match=r"cannot view shape \(2, 6\) \(12 elements\) as \(5,\)"):
        prog.view(x, (5,))
    with pytest.raises(ShapeError, match=r"axis 1 range \[4, 7\) is outside"):
        prog.slice(x, (0, 4), (1, 3))
    with pytest.raises(ShapeError, match="incompatible"):
        prog.concat([x, prog.input("y", (3, 6))], axis=1)
    with pytest.raises(DTypeError, match="ids must be an integer dtype"):
        prog.gather(table, x)
    with pytest.raises(EinpageError, match="unknown fill pattern"):
        prog.fill((2, 2), 0.0, pattern="stripes")
    with pytest.raises(DTypeError, match="fill: dtype must be a float"):
        prog.fill((2,), 1.0, dtype="int32")
