"""Element types a TaskGraph may hold, by canonical name (`"float32"`, ...)."""

from __future__ import annotations

from typing import Any

import numpy as np

from einpage_core.errors import DTypeError

__all__ = ["DTYPES", "FLOAT_DTYPES", "INT_DTYPES", "canonical", "itemsize", "short", "is_float"]

FLOAT_DTYPES = ("float16", "float32", "float64")
INT_DTYPES = ("int32", "int64")
DTYPES = FLOAT_DTYPES + INT_DTYPES
"""Every supported dtype name."""

_SHORT = {"float16": "f16", "float32": "f32", "float64": "f64", "int32": "i32", "int64": "i64"}


def canonical(dtype: Any) -> str:
    """The canonical name of a dtype given as a name, a NumPy type or a `numpy.dtype`.

    >>> canonical("f32"), canonical(np.float16)
    ('float32', 'float16')
    """
    if isinstance(dtype, str) and dtype in DTYPES:
        return dtype
    if isinstance(dtype, str) and dtype in _SHORT.values():
        return next(name for name, s in _SHORT.items() if s == dtype)
    try:
        name = np.dtype(dtype).name
    except (TypeError, ValueError):
        name = None
    if name not in DTYPES:
        raise DTypeError(f"unsupported dtype {dtype!r}; supported: {', '.join(DTYPES)}")
    return name


def itemsize(dtype: str) -> int:
    """Bytes per element."""
    return np.dtype(dtype).itemsize


def short(dtype: str) -> str:
    """A short name for printing: `f16`, `f32`, `f64`, `i32`, `i64`."""
    return _SHORT[dtype]


def is_float(dtype: str) -> bool:
    """Whether `dtype` is a floating-point type."""
    return dtype in FLOAT_DTYPES
