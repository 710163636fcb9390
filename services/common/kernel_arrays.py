"""Any number of arrays to one numba kernel, under one compiled signature.

numba types a tuple by its length, so a kernel that takes one array per table is compiled
again for each number of tables it meets (seconds each, in every process that meets it
cold). Here each array goes as two int64s, its address and its size: a row of
:func:`refs` per table (one pair per array, in an order the caller and kernel agree on), and
the kernel reads array ``field`` of row ``t`` back with :func:`array_1d` or :func:`array_2d`
(C-contiguous, no copy, never past the array's end: the row holds its size). The caller
keeps the arrays alive and unmoved for the call (the tables' locks do): a kernel writes
through the address it was given. :class:`RefsMemo` keeps a table's row until one of its
arrays is replaced (an arena that grew), so a request pays a few identity checks a table,
not an address lookup an array.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence

import numpy as np
from numba import carray, njit, types
from numba.extending import intrinsic

__all__ = ["RefsMemo", "array_1d", "array_2d", "pointer_rows", "refs"]


def refs(arrays: Sequence[np.ndarray], dtypes: Sequence[np.dtype | type]) -> np.ndarray:
    """One table's row: ``[address, size]`` of each array, in order (int64, ``2 * n``); a
    TypeError names the array that is not C-contiguous or not of its dtype (a kernel would
    read it wrongly)."""
    if len(arrays) != len(dtypes):
        raise TypeError(f"{len(arrays)} arrays for {len(dtypes)} dtypes")
    row = np.empty(2 * len(arrays), dtype=np.int64)
    for k, (array, dtype) in enumerate(zip(arrays, dtypes, strict=True)):
        if array.dtype != np.dtype(dtype) or not array.flags.c_contiguous:
            raise TypeError(f"array {k} is {array.dtype}, contiguous {array.flags.c_contiguous}"
                            f"; a kernel reads it as C-contiguous {np.dtype(dtype)}")
        row[2 * k] = array.ctypes.data
        row[2 * k + 1] = array.size
    return row


def pointer_rows(pointers: Sequence[tuple[int, int]]) -> np.ndarray:
    """Rows of one field each from ``(address, size)`` pairs, as :func:`refs` lays out a
    one-array table: for memory that is not a numpy array's (a torch tensor's ``data_ptr()``
    and ``numel()``), whose dtype and contiguity the caller has checked."""
    return np.array(pointers, dtype=np.int64).reshape(len(pointers), 2)


class RefsMemo:
    """A table's :func:`refs` row, made again only when one of its arrays is not the very
    array it was made from."""

    __slots__ = ("_arrays", "_dtypes", "_row")

    def __init__(self, dtypes: Sequence[np.dtype | type]) -> None:
        self._dtypes = tuple(dtypes)
        self._arrays: tuple[np.ndarray, ...] = ()
        self._row = np.empty(0, dtype=np.int64)

    def of(self, arrays: tuple[np.ndarray, ...]) -> np.ndarray:
        """The row of ``arrays`` (as :func:`refs` makes it)."""
        old = self._arrays
        if len(old) != len(arrays) or not all(map(operator.is_, arrays, old)):
            self._row = refs(arrays, self._dtypes)
            self._arrays = arrays
        return self._row


@intrinsic
def _pointer(typingctx, address, dtype):  # pragma: no cover - compiled into numba kernels
    """``address`` (an integer) as a pointer to ``dtype`` elements."""
    if not isinstance(address, types.Integer):
        return None
    if isinstance(dtype, types.DType):
        target = dtype.dtype
    elif isinstance(dtype, types.NumberClass):
        target = dtype.instance_type
    else:
        return None
    pointer = types.CPointer(target)

    def codegen(context, builder, signature, args):
        return builder.inttoptr(args[0], context.get_value_type(pointer))

    return pointer(address, dtype), codegen


@njit(cache=True, nogil=True, inline="always")
def array_1d(table_refs, t, field, dtype):  # pragma: no cover - numba
    """Array ``field`` of row ``t`` of ``table_refs`` (rows of :func:`refs`), 1-D of
    ``dtype``."""
    return carray(_pointer(table_refs[t, 2 * field], dtype), (table_refs[t, 2 * field + 1],))


@njit(cache=True, nogil=True, inline="always")
def array_2d(table_refs, t, field, dtype, width):  # pragma: no cover - numba
    """Array ``field`` of row ``t`` of ``table_refs``, 2-D of ``dtype``, ``width`` columns
    (as many whole rows as its size holds)."""
    return carray(_pointer(table_refs[t, 2 * field], dtype),
                  (table_refs[t, 2 * field + 1] // width, width))
