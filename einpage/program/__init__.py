"""The program room: how a user writes a tensor program, and the libraries written with it.

* `einpage.program.program`: `Program` (inputs, generalized einsums, structural ops,
  scopes, `build()` into a TaskGraph) and `Tensor`;
* `einpage.program.ops`: the op library (matmul, softmax, norms, ...) as einsums;
* `einpage.program.optim`: optimizer updates (SGD, AdamW) as einsums;
* `einpage.program.quantize`: int8/int4 weights and the tasks that rebuild them.

This room imports nothing of the rest of the frontend but its leaf modules
(`einpage.errors`); every other room may import it (`tests/test_imports.py`).
"""

from einpage.program.program import PATH_OPTIMIZERS, Program, Tensor

__all__ = ["Program", "Tensor", "PATH_OPTIMIZERS"]
