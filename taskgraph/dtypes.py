"""Element types a TaskGraph may hold: one table of `DType` records by canonical name.

Every stage asks this table about a dtype – its bytes (the planner), its short name
(listings), whether it is a float, the dtype its arithmetic runs in (the evaluator and
the kernels), and the raw unsigned integer of the same width (a backend without the
type, such as CuPy for bfloat16, can hold and move the bits under that name). A new
storage type (int8, a packed int4) is one more row of `TABLE`; `bits` below 8 is what
a packed type would say, and `nbytes` rounds a packed tensor up to whole bytes.

NumPy has no bfloat16: importing this module imports `ml_dtypes`, which registers it,
so `numpy.dtype("bfloat16")` works everywhere after `import taskgraph`.

>>> info("bf16").itemsize, info("bfloat16").compute, info("bfloat16").raw
(2, 'float32', 'uint16')
>>> canonical(ml_dtypes.bfloat16), short("bfloat16"), nbytes("bfloat16", 3)
('bfloat16', 'bf16', 6)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import ml_dtypes
import numpy as np

from einpage_core.errors import DTypeError

__all__ = [
    "DType",
    "TABLE",
    "DTYPES",
    "FLOAT_DTYPES",
    "INT_DTYPES",
    "info",
    "canonical",
    "itemsize",
    "nbytes",
    "short",
    "is_float",
    "is_float_array",
    "compute_dtype",
    "numpy_dtype",
    "finfo",
]

KINDS = ("float", "int")


@dataclass(frozen=True, slots=True)
class DType:
    """One element type.

    `name`: the canonical name (NumPy's, and what TaskGraph and plan JSON store);
    `short`: the name in listings (`f32[64,512]`); `bits`: bits per element as stored;
    `kind`: "float" or "int"; `compute`: the dtype its arithmetic runs in (float16 and
    bfloat16 are computed in float32 and rounded when stored, as GPU kernels and
    PyTorch do); `raw`: an unsigned integer dtype of the same width, holding the
    element's bits where a backend lacks the type.
    """

    name: str
    short: str
    bits: int
    kind: str
    compute: str
    raw: str

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise DTypeError(f"dtype {self.name!r}: kind must be one of {KINDS}, got {self.kind!r}")

    @property
    def itemsize(self) -> int:
        """Bytes per element; `DTypeError` for a packed (sub-byte) type: use `nbytes`."""
        if self.bits % 8:
            raise DTypeError(
                f"{self.name} packs {self.bits}-bit elements: it has no item size "
                "(use dtypes.nbytes(dtype, count))"
            )
        return self.bits // 8

    @property
    def numpy(self) -> np.dtype:
        """The NumPy dtype of arrays of this type (ml_dtypes' for bfloat16)."""
        return np.dtype(self.name)


TABLE: dict[str, DType] = {
    d.name: d
    for d in (
        DType("float16", "f16", 16, "float", "float32", "uint16"),
        DType("bfloat16", "bf16", 16, "float", "float32", "uint16"),
        DType("float32", "f32", 32, "float", "float32", "uint32"),
        DType("float64", "f64", 64, "float", "float64", "uint64"),
        DType("int8", "i8", 8, "int", "int32", "uint8"),
        DType("uint8", "u8", 8, "int", "int32", "uint8"),
        DType("int32", "i32", 32, "int", "int32", "uint32"),
        DType("int64", "i64", 64, "int", "int64", "uint64"),
    )
}
"""Every supported dtype by canonical name."""

DTYPES = tuple(TABLE)
"""Every supported dtype name."""
FLOAT_DTYPES = tuple(name for name, d in TABLE.items() if d.kind == "float")
INT_DTYPES = tuple(name for name, d in TABLE.items() if d.kind == "int")

_BY_SHORT = {d.short: d.name for d in TABLE.values()}
assert np.dtype(ml_dtypes.bfloat16).name == "bfloat16"  # ml_dtypes registered the name


def canonical(dtype: Any) -> str:
    """The canonical name of a dtype given as a name, a short name, a NumPy type or a
    `numpy.dtype` (ml_dtypes' `bfloat16` too).

    >>> canonical("f32"), canonical(np.float16), canonical("bf16")
    ('float32', 'float16', 'bfloat16')
    """
    if isinstance(dtype, str) and dtype in TABLE:
        return dtype
    if isinstance(dtype, str) and dtype in _BY_SHORT:
        return _BY_SHORT[dtype]
    try:
        name = np.dtype(dtype).name
    except (TypeError, ValueError):
        name = None
    if name not in TABLE:
        raise DTypeError(f"unsupported dtype {dtype!r}; supported: {', '.join(DTYPES)}")
    return name


def info(dtype: Any) -> DType:
    """The table's record of `dtype` (any spelling `canonical` accepts)."""
    return TABLE[canonical(dtype)]


def itemsize(dtype: str) -> int:
    """Bytes per element."""
    return info(dtype).itemsize


def nbytes(dtype: str, count: int) -> int:
    """Bytes of `count` elements (rounded up to whole bytes for a packed type)."""
    return -(-count * info(dtype).bits // 8)


def short(dtype: str) -> str:
    """A short name for printing: `f16`, `bf16`, `f32`, `f64`, `i32`, `i64`."""
    return TABLE[dtype].short


def is_float(dtype: str) -> bool:
    """Whether `dtype` (a canonical name) is a floating-point type of the table."""
    return dtype in FLOAT_DTYPES


def is_float_array(dtype: Any) -> bool:
    """Whether arrays of NumPy dtype `dtype` hold floats: any NumPy floating type, or a
    float type of the table that NumPy does not count as one (bfloat16)."""
    np_dtype = np.dtype(dtype)
    return bool(np.issubdtype(np_dtype, np.floating)) or is_float(np_dtype.name)


def compute_dtype(dtype: str) -> str:
    """The dtype a task of `dtype` is computed in (float16 and bfloat16: float32)."""
    return TABLE[dtype].compute


def numpy_dtype(dtype: str) -> np.dtype:
    """The NumPy dtype of arrays of `dtype`."""
    return TABLE[dtype].numpy


def finfo(dtype: Any) -> Any:
    """The limits of a float dtype (`min`, `max`, `maxexp`, `eps`, ...), any spelling
    `canonical` accepts: `ml_dtypes.finfo`, which knows bfloat16 as well as NumPy's
    floats (`numpy.finfo` raises "not inexact" for bfloat16). Read a dtype's limits
    here, never with `numpy.finfo`. `DTypeError` for a dtype that is not a float.

    >>> float(finfo("bfloat16").min), finfo("float16").maxexp
    (-3.3895313892515355e+38, 16)
    """
    name = canonical(dtype)
    if not is_float(name):
        raise DTypeError(f"{name} is not a float type: it has no float limits")
    return ml_dtypes.finfo(numpy_dtype(name))
