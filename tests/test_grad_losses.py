"""The cross-entropy loss and the optimizers' checks: `einpage.program.ops.cross_entropy` equals
`torch.nn.functional.cross_entropy` (values and gradients, every reduction, float16 with
labels float16 cannot hold), and `einpage.program.optim` refuses bad hyperparameters with the
value in the message."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import einpage as ep  # noqa: E402
import taskgraph  # noqa: E402
from einpage.program.optim import SGD, AdamW  # noqa: E402
from einpage_core.errors import ProgramError, ShapeError  # noqa: E402

torch.set_num_threads(1)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("classes", [1, 7, 10, 50])
def test_cross_entropy_and_its_gradient_equal_torch(reduction, classes):
    rng = np.random.default_rng(classes)
    logits = rng.standard_normal((2, 3, classes)) * 4
    labels = rng.integers(0, classes, (2, 3))
    prog = ep.Program()
    x = prog.input("x", logits.shape, "float64")
    loss = ep.cross_entropy(x, prog.input("y", labels.shape, "int64"), reduction)
    (g,) = prog.backward(ep.reduce_sum(loss), [x])
    prog.output(loss, "loss")
    prog.output(g, "g")
    out = taskgraph.evaluate(prog.build(), {"x": logits, "y": labels})
    t = torch.tensor(logits, requires_grad=True)
    want = torch.nn.functional.cross_entropy(
        t.reshape(-1, classes), torch.tensor(labels).reshape(-1), reduction=reduction
    )
    want.sum().backward()
    np.testing.assert_allclose(out["loss"], want.detach().numpy().reshape(out["loss"].shape))
    np.testing.assert_allclose(out["g"], t.grad.numpy(), atol=1e-15)


def test_cross_entropy_is_stable_for_large_logits():
    prog = ep.Program()
    x = prog.input("x", (1, 3), "float32")
    prog.output(ep.cross_entropy(x, prog.input("y", (1,), "int64")), "loss")
    out = taskgraph.evaluate(
        prog.build(), {"x": np.array([[1e4, 0, -1e4]], "float32"), "y": np.array([1])}
    )
    np.testing.assert_allclose(out["loss"], 1e4)


def test_float16_logits_pick_labels_float16_cannot_hold():
    rng = np.random.default_rng(0)
    logits = (rng.standard_normal((4, 3000)) * 3).astype("float16")
    labels = np.array([2999, 2049, 0, 2047])  # 2049 and 2999 are not float16 numbers
    prog = ep.Program()
    x = prog.input("x", logits.shape, "float16")
    prog.output(ep.cross_entropy(x, prog.input("y", (4,), "int64"), "none"), "loss")
    got = taskgraph.evaluate(prog.build(), {"x": logits, "y": labels})["loss"]
    t = torch.tensor(logits.astype("float32"))
    want = torch.nn.functional.cross_entropy(t, torch.tensor(labels), reduction="none").numpy()
    np.testing.assert_allclose(got.astype("float32"), want, rtol=2e-3)


def test_cross_entropy_checks_its_arguments():
    prog = ep.Program()
    x = prog.input("x", (2, 5))
    with pytest.raises(ShapeError, match=r"labels \(3,\) must be the logits' shape"):
        ep.cross_entropy(x, prog.input("y", (3,), "int64"))
    with pytest.raises(ProgramError, match="labels integer"):
        ep.cross_entropy(x, prog.input("z", (2,)))
    with pytest.raises(ProgramError, match="reduction must be one of"):
        ep.cross_entropy(x, prog.input("w", (2,), "int64"), "max")


@pytest.mark.parametrize(
    "make, match",
    [
        (lambda: SGD(lr=-1.0), "SGD: lr must be a number"),
        (lambda: SGD(nesterov=True), "nesterov needs a momentum"),
        (lambda: AdamW(betas=(0.9, 1.0)), "AdamW: betas must be a number in"),
        (lambda: AdamW(betas=(0.9,)), "two numbers"),
        (lambda: AdamW(eps="small"), "eps must be a number"),
    ],
)
def test_optimizers_refuse_bad_hyperparameters(make, match):
    with pytest.raises(ProgramError, match=match):
        make()
