"""Reverse-mode differentiation (`taskgraph.grad`, `Program.backward`): every rule against
`torch.autograd` in float64, the documented tie and zero rules, the API and its errors."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from grad_cases import finite_differences, torch_gradients  # noqa: E402

import einpage as ep  # noqa: E402
import taskgraph  # noqa: E402
from einpage_core.errors import GraphError, ProgramError, UnsupportedError  # noqa: E402
from taskgraph import TaskGraph  # noqa: E402
from taskgraph.autodiff import diff  # noqa: E402
from taskgraph.expr import FUNCTIONS, parse  # noqa: E402
from taskgraph.nodes import ScatterAdd  # noqa: E402

torch.set_num_threads(1)
RNG = np.random.default_rng(7)


def check_against_torch(tg: TaskGraph, arrays, wrt, rtol=1e-9):
    """The gradient program's outputs equal torch.autograd's gradients."""
    got = taskgraph.evaluate(taskgraph.grad(tg, "loss", wrt), arrays)
    want = torch_gradients(tg, arrays, "loss", wrt)
    for name in wrt:
        scale = 1.0 + np.abs(want[name]).max()
        np.testing.assert_allclose(got["grad." + name], want[name], rtol=rtol, atol=rtol * scale)
    return got


def program(spec: str, shapes, join=None, agg="sum", weights=True):
    """`loss = sum(einsum(spec, x0, x1, ...) * r)` with random float64 inputs and weights r."""
    prog = ep.Program("case")
    xs = [prog.input(f"x{i}", s, "float64") for i, s in enumerate(shapes)]
    y = prog.einsum(spec, *xs, join=join, agg=agg)
    r = prog.input("r", y.shape, "float64")
    letters = "abcdefgh"[: y.ndim]
    prog.output(prog.einsum(f"{letters},{letters}->", y, r), "loss")
    arrays = {f"x{i}": RNG.standard_normal(s) for i, s in enumerate(shapes)}
    arrays["r"] = RNG.standard_normal(y.shape) if weights else np.ones(y.shape)
    return prog.build(), arrays


# -- plain einsums and joins -------------------------------------------------------------

PLAIN = [
    ("ij,jk->ik", [(3, 4), (4, 5)]),
    ("bij,bjk->bik", [(2, 3, 4), (2, 4, 2)]),
    ("ij,j->i", [(3, 4), (4,)]),
    ("i,j->ij", [(3,), (4,)]),
    ("ij->", [(3, 4)]),
    ("ij->ji", [(3, 4)]),
    ("ij,ij->ij", [(3, 4), (3, 4)]),
    ("ij,kl->ik", [(2, 3), (4, 5)]),  # reduced indices only one operand reads
]


@pytest.mark.parametrize("spec, shapes", PLAIN)
def test_plain_einsum_gradients_equal_torch(spec, shapes):
    tg, arrays = program(spec, shapes)
    check_against_torch(tg, arrays, [n for n in arrays if n.startswith("x")])


DIAGONALS = [
    ("ii->i", [(3, 3)]),
    ("ii->", [(4, 4)]),
    ("iii->i", [(3, 3, 3)]),
    ("iji->j", [(3, 2, 3)]),
    ("ii,i->i", [(3, 3), (3,)]),
    ("ij,jj->i", [(2, 3), (3, 3)]),
    ("iijj->ij", [(2, 2, 3, 3)]),
]


@pytest.mark.parametrize("spec, shapes", DIAGONALS)
def test_gradients_through_a_diagonal_read_equal_torch(spec, shapes):
    """An operand read with a repeated index gets its gradient on the diagonal, zero off it."""
    tg, arrays = program(spec, shapes)
    check_against_torch(tg, arrays, [n for n in arrays if n.startswith("x")])


def test_a_diagonal_gradient_is_zero_off_the_diagonal():
    tg, arrays = program("ii->i", [(4, 4)])
    g = taskgraph.evaluate(taskgraph.grad(tg, "loss", ["x0"]), arrays)["grad.x0"]
    np.testing.assert_array_equal(g - np.diag(np.diag(g)), np.zeros((4, 4)))
    np.testing.assert_allclose(np.diag(g), arrays["r"])


def test_the_gradient_of_a_matmul_is_two_plain_matmuls():
    tg, arrays = program("ij,jk->ik", [(3, 4), (4, 5)])
    g = taskgraph.grad(tg, "loss", ["x0", "x1"])
    grads = [g[g.outputs["grad.x0"]], g[g.outputs["grad.x1"]]]
    assert all(t.op.is_plain and len(t.inputs) == 2 for t in grads)


def test_an_operand_read_twice_gets_both_contributions():
    prog = ep.Program()
    x = prog.input("x", (3, 3), "float64")
    xt = prog.einsum("ij->ji", x)
    y = prog.einsum("ij,ij,ij,ji->ij", x, x, xt, x, join="a * b * c + d")  # same and transposed
    prog.output(ep.reduce_sum(y), "loss")
    check_against_torch(prog.build(), {"x": RNG.standard_normal((3, 3))}, ["x"])


@pytest.mark.parametrize("name", sorted(FUNCTIONS))
def test_every_join_function_has_a_derivative_equal_to_torch(name):
    arity = FUNCTIONS[name].arity
    args = ["a", "b", "c"][:arity]
    if name in ("log", "sqrt", "rsqrt"):
        args[0] = "(1.5 + a * a)"
    if name == "where":
        args[0] = "a > 0"
    join = f"{name}({', '.join(args)})"
    shapes = [(3, 4)] * 3
    tg, arrays = program("ij,ij,ij->ij", shapes, join=join)
    check_against_torch(tg, arrays, ["x0", "x1", "x2"])


@pytest.mark.parametrize(
    "join",
    ["a - b", "a / (2.0 + b * b)", "a ** 3.0", "(1.5 + a * a) ** b", "-a * b", "(a > b) * a",
     "(a > b) * a - (a < b) * b", "a ** 1.0 + 2.0 ** a"],
)  # fmt: skip
def test_operators_have_derivatives_equal_to_torch(join):
    tg, arrays = program("ij,ij->ij", [(3, 4), (3, 4)], join=join)
    check_against_torch(tg, arrays, ["x0", "x1"])


def test_a_broadcast_operand_gets_its_gradient_summed():
    tg, arrays = program("bij,j->bij", [(2, 3, 4), (4,)], join="exp(a) * b + a")
    check_against_torch(tg, arrays, ["x0", "x1"])


def test_a_reduced_index_no_operand_of_the_derivative_reads_counts_its_size():
    # out[i] = sum_j (a[i] + b[j]): d/da = J * g, read without b.
    tg, arrays = program("i,j->i", [(3,), (5,)], join="a + b")
    got = check_against_torch(tg, arrays, ["x0", "x1"])
    np.testing.assert_allclose(got["grad.x0"], 5 * arrays["r"])


# -- max, min and prod aggregations: ties and zeros ---------------------------------------


@pytest.mark.parametrize("agg", ["max", "min"])
def test_extremum_gradients_equal_torch(agg):
    tg, arrays = program("ij->i", [(4, 6)], agg=agg, join="a * a - a")
    check_against_torch(tg, arrays, ["x0"])


@pytest.mark.parametrize("agg", ["max", "min"])
def test_extremum_ties_share_the_gradient_evenly(agg):
    prog = ep.Program()
    x = prog.input("x", (2, 4), "float64")
    prog.output(ep.reduce_sum(prog.einsum("ij->i", x, agg=agg)), "loss")
    values = np.array([[1.0, 3.0, 3.0, 0.0], [2.0, 2.0, 2.0, 2.0]])
    if agg == "min":
        values = -values
    got = check_against_torch(prog.build(), {"x": values}, ["x"])["grad.x"]
    np.testing.assert_array_equal(got, [[0, 0.5, 0.5, 0], [0.25] * 4])


def test_a_max_over_an_index_the_join_ignores_is_a_tie_too():
    tg, arrays = program("ij,k->i", [(3, 4), (5,)], join="a * a", agg="max")
    check_against_torch(tg, arrays, ["x0", "x1"])


@pytest.mark.parametrize(
    "join, values, want",
    [
        ("max(a, b)", (2.0, 2.0), (0.5, 0.5)),
        ("min(a, b)", (1.0, 1.0), (0.5, 0.5)),
        ("relu(a) + 0.0 * b", (0.0, 1.0), (0.0, 0.0)),
        ("abs(a) + 0.0 * b", (0.0, 1.0), (0.0, 0.0)),
    ],
)
def test_join_ties_follow_torch(join, values, want):
    prog = ep.Program()
    a, b = (prog.input(n, (1,), "float64") for n in "ab")
    prog.output(ep.reduce_sum(prog.einsum("i,i->i", a, b, join=join)), "loss")
    arrays = {"a": np.array([values[0]]), "b": np.array([values[1]])}
    got = check_against_torch(prog.build(), arrays, ["a", "b"])
    assert (got["grad.a"][0], got["grad.b"][0]) == want


@pytest.mark.parametrize("zeros", [0, 1, 2])
def test_prod_handles_zeros_exactly(zeros):
    prog = ep.Program()
    x = prog.input("x", (2, 5), "float64")
    prog.output(ep.reduce_sum(prog.einsum("ij->i", x, agg="prod")), "loss")
    values = RNG.uniform(0.5, 1.5, (2, 5))
    values[0, :zeros] = 0.0
    got = check_against_torch(prog.build(), {"x": values}, ["x"])["grad.x"]
    assert np.all(np.isfinite(got))
    if zeros == 1:  # only the zero factor gets a gradient: the product of the others
        np.testing.assert_allclose(got[0], [np.prod(values[0, 1:]), 0, 0, 0, 0])


def test_prod_with_a_join_and_a_repeated_factor_equals_torch():
    tg, arrays = program("ij,k->i", [(2, 3), (2,)], join="a + b * b", agg="prod")
    check_against_torch(tg, arrays, ["x0", "x1"])


# -- structural ops -------------------------------------------------------------------------


def test_structural_gradients_equal_torch():
    prog = ep.Program()
    x = prog.input("x", (4, 6), "float64")
    table = prog.input("table", (5, 3), "float64")
    ids = prog.input("ids", (2, 3), "int64")
    v = prog.view(x, (2, 12))
    s = prog.slice(v, (1, 2), (1, 7))
    c = prog.concat([x, prog.einsum("ij->ij", x, join="a * a")], axis=1)
    g = prog.gather(table, ids)
    parts = [ep.reduce_sum(ep.exp(s)), ep.reduce_sum(c * c), ep.reduce_sum(g * g * g)]
    prog.output(parts[0] + parts[1] + parts[2], "loss")
    arrays = {
        "x": RNG.standard_normal((4, 6)),
        "table": RNG.standard_normal((5, 3)),
        "ids": np.array([[0, 4, 4], [2, 0, 4]]),
    }
    check_against_torch(prog.build(), arrays, ["x", "table"])


def test_scatter_add_sums_rows_and_its_gradient_is_a_gather():
    prog = ep.Program()
    src = prog.input("src", (3, 2), "float64")
    ids = prog.input("ids", (3,), "int64")
    table = prog.scatter_add(src, ids, 4)
    prog.output(table, "table")
    prog.output(ep.reduce_sum(table * table), "loss")
    tg = prog.build()
    arrays = {"src": np.arange(6.0).reshape(3, 2), "ids": np.array([2, 0, 2])}
    out = taskgraph.evaluate(tg, arrays)["table"]
    np.testing.assert_array_equal(out, [[2, 3], [0, 0], [4, 6], [0, 0]])
    g = taskgraph.evaluate(taskgraph.grad(tg, "loss", ["src"]), arrays)["grad.src"]
    np.testing.assert_array_equal(g, 2 * out[[2, 0, 2]])


def test_a_scatter_add_block_with_a_start_is_refused():
    prog = ep.Program()
    src = prog.input("src", (3, 2), "float64")
    ids = prog.input("ids", (3,), "int64")
    prog.output(ep.reduce_sum(prog._add(ScatterAdd(2), (src, ids), (4, 2))), "loss")
    with pytest.raises(UnsupportedError, match="start 2"):
        taskgraph.grad(prog.build(), "loss", ["src"])


def test_a_cast_einsum_sends_the_gradient_back_in_the_operand_dtype():
    prog = ep.Program()
    x = prog.input("x", (3,), "float32")
    y = ep.cast(x, "float64")
    prog.output(ep.reduce_sum(prog.einsum("i->i", y, join="a * a")), "loss")
    g = taskgraph.grad(prog.build(), "loss", ["x"])
    assert g[g.outputs["grad.x"]].dtype == "float32"
    got = taskgraph.evaluate(g, {"x": np.array([1, 2, 3], "float32")})["grad.x"]
    np.testing.assert_array_equal(got, [2, 4, 6])


# -- the pass itself ---------------------------------------------------------------------------


def test_finite_differences_agree_on_a_small_program():
    prog = ep.Program()
    x = prog.input("x", (2, 3), "float64")
    w = prog.input("w", (3, 3), "float64")
    h = ep.softmax(ep.tanh(x @ w), axis=-1)
    prog.output(ep.reduce_sum(ep.layernorm(h) * h), "loss")
    tg = prog.build()
    arrays = {"x": RNG.standard_normal((2, 3)), "w": RNG.standard_normal((3, 3))}
    got = taskgraph.evaluate(taskgraph.grad(tg, "loss", ["x", "w"]), arrays)
    for name in ("x", "w"):
        want = finite_differences(tg, arrays, "loss", name)
        np.testing.assert_allclose(got["grad." + name], want, rtol=1e-5, atol=1e-7)


def test_inputs_the_loss_does_not_read_get_zeros():
    prog = ep.Program()
    x = prog.input("x", (3,))
    prog.input("y", (2,))
    prog.output(ep.reduce_sum(x * x), "loss")
    g = taskgraph.grad(prog.build(), "loss", ["y"])
    out = taskgraph.evaluate(g, {"x": np.ones(3, "float32"), "y": np.ones(2, "float32")})
    np.testing.assert_array_equal(out["grad.y"], [0, 0])


def test_the_gradient_program_keeps_the_outputs_and_round_trips_through_json():
    tg, arrays = program("ij,jk->ik", [(3, 4), (4, 5)], join="tanh(a) * b", agg="max")
    g = taskgraph.grad(tg, "loss", ["x0", "x1"], prefix="d_")
    assert list(g.outputs) == ["loss", "d_x0", "d_x1"]
    again = TaskGraph.from_json(g.to_json())
    want = taskgraph.evaluate(g, arrays)
    got = taskgraph.evaluate(again, arrays)
    for name in want:
        np.testing.assert_array_equal(got[name], want[name])


def test_gradient_tasks_keep_their_scope_and_say_what_they_differentiate():
    prog = ep.Program()
    x = prog.input("x", (3,))
    with prog.scope("layer"):
        y = prog.einsum("i->i", x, join="exp(a)", label="act")
    prog.output(ep.reduce_sum(y), "loss")
    g = taskgraph.grad(prog.build(), "loss", ["x"])
    made = g[g.outputs["grad.x"]]
    assert (made.scope, made.label) == ("layer", "grad.act")


@pytest.mark.parametrize(
    "loss, wrt, error, match",
    [
        ("y", ["x"], GraphError, "one element"),
        ("loss", ["ids"], GraphError, "cannot differentiate"),
        ("nope", ["x"], GraphError, "'nope' is not an output"),
        ("loss", ["nope"], GraphError, "'nope' is not an input"),
        ("loss", [99], GraphError, "task id"),
    ],
)
def test_grad_errors_name_the_problem(loss, wrt, error, match):
    prog = ep.Program()
    x = prog.input("x", (3,))
    ids = prog.input("ids", (2,), "int64")
    y = prog.gather(x, ids)
    prog.output(y, "y")
    prog.output(ep.reduce_sum(y), "loss")
    with pytest.raises(error, match=match):
        taskgraph.grad(prog.build(), loss, wrt)


def test_diff_is_zero_for_an_operand_the_join_does_not_read():
    assert str(diff(parse("exp(a) * 2.0", 2), 1)) == "0.0"
    assert str(diff(parse("a < b", 2), 0)) == "0.0"


# -- Program.backward -------------------------------------------------------------------------


def test_program_backward_calls_back_as_each_gradient_is_final():
    prog = ep.Program()
    x = prog.input("x", (4,), "float64")
    w1 = prog.input("w1", (4, 4), "float64", role="weight")
    w2 = prog.input("w2", (4, 4), "float64", role="weight")
    loss = ep.reduce_sum(ep.tanh(ep.tanh(x @ w1) @ w2))
    seen = []

    def update(weight, grad):
        seen.append((weight.id, len(prog._builder.tasks)))
        prog.output(weight - grad * 0.1, "new." + weight.task.op.name)

    grads = prog.backward(loss, [w1, w2], on_gradient=update)
    assert [w for w, _ in seen] == [w2.id, w1.id]  # the last layer's gradient is final first
    # w2's update is made before w1's gradient (it does not wait for the whole pass)
    assert seen[0][1] < grads[0].id
    prog.output(loss, "loss")
    tg = prog.build()
    arrays = {n: RNG.standard_normal(tg[i].shape) for n, i in tg.inputs.items()}
    check_against_torch(tg, arrays, ["w1", "w2"])


def test_program_backward_needs_tensors_of_the_program():
    prog, other = ep.Program(), ep.Program()
    x = prog.input("x", (3,))
    with pytest.raises(ProgramError, match="belongs to program"):
        prog.backward(ep.reduce_sum(x), [other.input("y", (3,))])


def test_pop_output_and_input_tensor():
    prog = ep.Program()
    x = prog.input("x", (3,))
    prog.output(ep.exp(x), "y")
    y = prog.pop_output("y")
    assert prog.input_tensor("x").id == x.id and y.shape == (3,)
    with pytest.raises(ProgramError, match="no output named 'y'; outputs: none"):
        prog.pop_output("y")
    with pytest.raises(ProgramError, match="no input named 'z'"):
        prog.input_tensor("z")


def test_state_inputs_start_on_the_host():
    prog = ep.Program()
    m = prog.input("m", (3,), role="state")
    assert m.task.op.location == "host"


# -- softmax and log-sum-exp groups --------------------------------------------------------


def _softmax_case(extra_max_reader: bool):
    prog = ep.Program()
    x = prog.input("x", (3, 5), "float64")
    masked = prog.einsum("ij->ij", x, join="a * 2.0 + 1.0", label="masked")
    p = ep.softmax(masked, axis=-1)
    loss = ep.reduce_sum(p * prog.input("r", (3, 5), "float64"))
    if extra_max_reader:  # the softmax's maximum is read outside the group
        peak = next(t for t in prog._builder.tasks if t.label == "softmax.max")
        loss = loss + ep.reduce_sum(ep.Tensor(prog, peak.id, peak.shape, peak.dtype))
    prog.output(loss, "loss")
    return prog.build(), {"x": RNG.standard_normal((3, 5)), "r": RNG.standard_normal((3, 5))}


def test_a_softmax_is_differentiated_from_its_output_not_its_input():
    tg, arrays = _softmax_case(extra_max_reader=False)
    check_against_torch(tg, arrays, ["x"])
    g = taskgraph.grad(tg, "loss", ["x"])
    masked = next(t.id for t in g if t.label == "masked")
    assert all(g[c].label.startswith("softmax") for c in g.consumers[masked])
    assert not any("==" in t.line() for t in g)  # no arg-max routing of the maximum


def test_a_softmax_whose_maximum_is_read_elsewhere_takes_the_task_rules():
    tg, arrays = _softmax_case(extra_max_reader=True)
    check_against_torch(tg, arrays, ["x"])
    g = taskgraph.grad(tg, "loss", ["x"])
    assert any("==" in t.line() for t in g)  # the maximum's gradient is routed


def test_cross_entropy_backward_is_one_pass_per_contribution_over_the_logits():
    prog = ep.Program()
    x = prog.input("x", (4, 50), "float64")
    loss = ep.cross_entropy(x, prog.input("y", (4,), "int64"))
    prog.output(loss, "loss")
    g = taskgraph.grad(prog.build(), "loss", ["x"])
    full = [t for t in g if t.label.startswith("grad") and t.shape == (4, 50)]
    assert len(full) == 2  # softmax(x) * g, fused with the picked logit's -g


def _by_hand(extra: str = "", joins=("exp(a - b)", "exp(a - b) / c"), mark: bool = False):
    """`_softmax_case`'s program with the softmax's three einsums written with
    `prog.einsum` (the sum's and the output's joins as given), stating `Softmax` or not."""
    prog = ep.Program()
    x = prog.input("x", (3, 5), "float64")
    masked = prog.einsum("ij->ij", x, join="a * 2.0 + 1.0", label="masked")
    peak = prog.einsum("ij->i", masked, agg="max")
    total = prog.einsum("ij,i->i", masked, peak, join=joins[0])
    p = prog.einsum("ij,i,i->ij", masked, peak, total, join=joins[1])
    if mark:
        from taskgraph.facts import Softmax

        prog.fact(p, Softmax())
    prog.output(ep.reduce_sum(p * prog.input("r", (3, 5), "float64")), "loss")
    return prog.build(), {"x": RNG.standard_normal((3, 5)), "r": RNG.standard_normal((3, 5))}


def _takes_the_group_rule(tg: TaskGraph) -> bool:
    """Whether the backward pass differentiated the softmax from its output: nothing reads
    the softmax's input but the forward softmax, and no maximum is routed (no `==`)."""
    g = taskgraph.grad(tg, "loss", ["x"])
    masked = next(t.id for t in g if t.label == "masked")
    readers_in_backward = [c for c in g.consumers[masked] if c >= len(tg)]
    return not readers_in_backward and not any("==" in t.line() for t in g)


def test_an_unmarked_softmax_takes_the_task_rules_and_a_marked_one_the_group_rule():
    unmarked, arrays = _by_hand()
    check_against_torch(unmarked, arrays, ["x"])
    assert not _takes_the_group_rule(unmarked)
    marked, arrays = _by_hand(mark=True)
    check_against_torch(marked, arrays, ["x"])
    assert _takes_the_group_rule(marked)


@pytest.mark.parametrize(
    "joins",
    [("exp(-(b - a))", "exp(-(b - a)) / c"), ("exp(a + -b)", "exp(a - b) * (1.0 / c)")],
)
def test_a_marked_softmax_is_found_however_its_joins_are_spelled(joins):
    tg, arrays = _by_hand(joins=joins, mark=True)
    check_against_torch(tg, arrays, ["x"])
    assert _takes_the_group_rule(tg)


def test_rewording_the_softmax_of_the_op_library_keeps_its_group_rule():
    """The join text `ops.softmax` writes, reworded in the program's JSON: the group is
    still found (it used to be recognised by that exact text)."""
    tg, arrays = _softmax_case(extra_max_reader=False)
    text = tg.to_json()
    reworded = text.replace('"exp(a - b) / c"', '"exp(-(b - a)) / c"')
    reworded = reworded.replace('"exp(a - b)"', '"exp(a + -b)"')
    assert reworded.count("exp(-(b - a)) / c") == 1 and reworded.count("exp(a + -b)") == 1
    tg = TaskGraph.from_json(reworded)
    check_against_torch(tg, arrays, ["x"])
    assert _takes_the_group_rule(tg)


def test_a_reworded_log_sum_exp_keeps_its_group_rule():
    prog = ep.Program()
    x = prog.input("x", (4, 50), "float64")
    prog.output(ep.cross_entropy(x, prog.input("y", (4,), "int64")), "loss")
    text = prog.build().to_json()
    reworded = TaskGraph.from_json(text.replace('"log(a) + b"', '"b + log(a)"'))
    assert '"b + log(a)"' in reworded.to_json()
    g = taskgraph.grad(reworded, "loss", ["x"])
    full = [t for t in g if t.label.startswith("grad") and t.shape == (4, 50)]
    assert len(full) == 2  # softmax(x) * g, fused with the picked logit's -g
    arrays = {"x": RNG.standard_normal((4, 50)), "y": RNG.integers(0, 50, 4)}
    check_against_torch(reworded, arrays, ["x"])


def test_differentiating_through_a_top_k_threshold_is_refused():
    prog = ep.Program("topk")
    x = prog.input("x", (2, 8))
    t = ep.kth_largest(x, 3)
    prog.output(ep.reduce_sum(t * t), "loss")
    with pytest.raises(ep.UnsupportedError, match="top-k threshold"):
        taskgraph.grad(prog.build(), "loss", ["x"])
