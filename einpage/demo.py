"""The demo program (a two-layer MLP with softmax) and the `einpage demo` job."""

from __future__ import annotations

import numpy as np

import einpage.ops as ops
from einpage.program import Program

__all__ = ["mlp_program", "random_inputs", "run_demo"]


def mlp_program(
    batch: int = 64,
    d_in: int = 512,
    hidden: int = 2048,
    d_out: int = 512,
    layers: int = 2,
    dtype: str = "float32",
) -> Program:
    """An MLP: `layers` x (matmul + bias, GELU between layers), then a softmax over classes."""
    prog = Program("mlp")
    h = prog.input("x", (batch, d_in), dtype)
    widths = [d_in] + [hidden] * (layers - 1) + [d_out]
    for i in range(layers):
        with prog.scope(f"layer{i}"):
            w = prog.input(f"w{i}", (widths[i], widths[i + 1]), dtype, role="weight")
            b = prog.input(f"b{i}", (widths[i + 1],), dtype, role="weight")
            h = ops.matmul(h, w) + b
            if i < layers - 1:
                h = ops.gelu(h)
    prog.output(ops.softmax(h, axis=-1), "probs")
    return prog


def random_inputs(tg, seed: int = 0) -> dict[str, np.ndarray]:
    """Random arrays for every input of a TaskGraph (normal, scaled by 1/sqrt(fan-in))."""
    rng = np.random.default_rng(seed)
    arrays = {}
    for name, task_id in tg.inputs.items():
        task = tg[task_id]
        if task.dtype.startswith("int"):
            arrays[name] = rng.integers(0, 2, task.shape).astype(task.dtype)
            continue
        scale = 1.0 / np.sqrt(task.shape[0]) if len(task.shape) > 1 else 0.1
        arrays[name] = (rng.standard_normal(task.shape) * scale).astype(task.dtype)
    return arrays


def _numpy_mlp(arrays: dict[str, np.ndarray], layers: int) -> np.ndarray:
    """The same MLP written directly in NumPy (float64), independent of einpage."""
    h = arrays["x"].astype(np.float64)
    for i in range(layers):
        h = h @ arrays[f"w{i}"].astype(np.float64) + arrays[f"b{i}"].astype(np.float64)
        if i < layers - 1:
            h = 0.5 * h * (1 + np.tanh(np.sqrt(2 / np.pi) * (h + 0.044715 * h**3)))
    h = np.exp(h - h.max(axis=-1, keepdims=True))
    return h / h.sum(axis=-1, keepdims=True)


def run_demo(print_fn=print) -> int:
    """Build the demo MLP, print its TaskGraph, evaluate it and check it against NumPy.

    Returns a process exit code (0 when the check passes).
    """
    import taskgraph

    layers = 2
    prog = mlp_program(layers=layers)
    tg = prog.build()
    print_fn(repr(tg))
    print_fn(str(tg))
    arrays = random_inputs(tg)
    probs = taskgraph.evaluate(tg, arrays)["probs"]
    expected = _numpy_mlp(arrays, layers)
    error = float(np.max(np.abs(probs - expected)))
    ok = error < 1e-5
    print_fn(
        f"evaluated: probs {probs.shape} {probs.dtype}; rows sum to "
        f"{float(probs.sum(axis=-1).mean()):.6f}"
    )
    print_fn(f"max |einpage - numpy| = {error:.2e}  ({'OK' if ok else 'MISMATCH'})")
    return 0 if ok else 1
