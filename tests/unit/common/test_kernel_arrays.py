"""Arrays passed to numba kernels by address (services.common.kernel_arrays): a kernel reads
and writes the very arrays, never past their end; rows refuse what a kernel would misread;
a memo's row follows an array that was replaced."""

from __future__ import annotations

import numpy as np
import pytest
from numba import njit

from services.common.kernel_arrays import RefsMemo, array_1d, array_2d, pointer_rows, refs


@njit
def _add_row_sums(tables, width):  # pragma: no cover - numba
    """Per table: field 1 (1-D int64) gets, at each row, the sum of field 0's row (2-D float32,
    ``width`` wide); returns the rows each table had."""
    seen = np.empty(tables.shape[0], dtype=np.int64)
    for t in range(tables.shape[0]):
        rows, out = array_2d(tables, t, 0, np.float32, width), array_1d(tables, t, 1, np.int64)
        seen[t] = rows.shape[0]
        for r in range(min(rows.shape[0], out.shape[0])):
            out[r] += int(rows[r].sum())
    return seen


def test_a_kernel_reads_and_writes_each_tables_own_arrays() -> None:
    """Three tables of 2, 5 and 0 rows: each table's sums land in its own output, and a
    2-D array whose size is not a whole number of rows is read as its whole rows only."""
    rows = [np.arange(2 * 3, dtype=np.float32).reshape(2, 3),
            np.ones((5, 3), dtype=np.float32), np.empty((0, 3), dtype=np.float32)]
    outs = [np.full(2, 10, dtype=np.int64), np.zeros(5, dtype=np.int64),
            np.zeros(0, dtype=np.int64)]
    dtypes = (np.float32, np.int64)
    tables = np.stack([refs((r, o), dtypes) for r, o in zip(rows, outs, strict=True)])
    np.testing.assert_array_equal(_add_row_sums(tables, 3), [2, 5, 0])
    np.testing.assert_array_equal(outs[0], [10 + 3, 10 + 12])
    np.testing.assert_array_equal(outs[1], [3] * 5)
    ragged = np.stack([refs((np.ones(7, dtype=np.float32), np.zeros(4, dtype=np.int64)),
                            dtypes)])
    assert _add_row_sums(ragged, 3).tolist() == [2]  # 7 values: two whole rows of 3


def test_rows_refuse_arrays_a_kernel_would_misread() -> None:
    """A strided view or a wrong dtype is a TypeError naming the array; so is a count that
    differs from the dtypes'."""
    good = np.zeros((4, 2), dtype=np.float32)
    with pytest.raises(TypeError, match="array 1 .*contiguous False"):
        refs((good, good[:, :1]), (np.float32, np.float32))
    with pytest.raises(TypeError, match="array 0 is float64"):
        refs((good.astype(np.float64),), (np.float32,))
    with pytest.raises(TypeError, match="2 arrays for 1 dtypes"):
        refs((good, good), (np.float32,))


def test_a_memo_keeps_its_row_until_an_array_is_replaced() -> None:
    """The same arrays give the same row; an array replaced by a grown copy gives a row a
    kernel reads the copy through (a memo keyed on anything but identity reads freed memory
    or the old values)."""
    memo = RefsMemo((np.float32, np.int64))
    rows, out = np.ones((2, 3), dtype=np.float32), np.zeros(2, dtype=np.int64)
    first = memo.of((rows, out))
    assert memo.of((rows, out)) is first
    grown = np.full((4, 3), 2, dtype=np.float32)
    out4 = np.zeros(4, dtype=np.int64)
    row = memo.of((grown, out4))
    assert row is not first
    assert _add_row_sums(np.stack([row]), 3).tolist() == [4]
    np.testing.assert_array_equal(out4, [6] * 4)
    np.testing.assert_array_equal(out, [0, 0])


def test_pointer_rows_lay_out_memory_as_refs_lays_out_one_array_tables() -> None:
    """Rows from (address, size) pairs are the rows :func:`refs` makes of one-array tables
    (a row with the pair swapped, or one row for all, differs)."""
    rows = [np.ones((2, 3), dtype=np.float32), np.full((3, 3), 2, dtype=np.float32)]
    made = pointer_rows([(r.ctypes.data, r.size) for r in rows])
    np.testing.assert_array_equal(made, np.stack([refs((r,), (np.float32,)) for r in rows]))
