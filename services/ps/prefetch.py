"""Software prefetch in numba kernels: an LLVM ``prefetch`` intrinsic.

Where a loop does real work per random row (hash probes, optimizer updates on rows scattered
over an arena), fetching the rows ``PREFETCH_DISTANCE`` iterations ahead hides the DRAM round
trip each would cost: on this kind of machine that halves the time of hash probes and
optimizer updates.
"""

from __future__ import annotations

import llvmlite.binding
from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic

__all__ = ["PREFETCH_DISTANCE", "prefetch", "prefetch_row"]

PREFETCH_DISTANCE = 8  # rows ahead: random rows cost a DRAM round trip each otherwise
_I32 = ir.IntType(32)
_PREFETCH_NAME = ("llvm.prefetch.p0" if llvmlite.binding.llvm_version_info >= (15,)
                  else "llvm.prefetch.p0i8")


@intrinsic
def _prefetch(typingctx, array, row, col):  # pragma: no cover - compiled into numba kernels
    """Hint the CPU to fetch ``array[row, col]`` (``array[row]`` if 1-D) into cache."""
    sig = types.void(array, row, col)

    def codegen(context, builder, signature, args):
        aryty = signature.args[0]
        ary = context.make_array(aryty)(context, builder, args[0])
        index = [args[1]] + [args[2]] * min(1, aryty.ndim - 1)
        index += [context.get_constant(types.intp, 0)] * (aryty.ndim - len(index))
        ptr = cgutils.get_item_pointer(context, builder, aryty, ary, index,
                                       wraparound=False, boundscheck=False)
        i8p = ir.IntType(8).as_pointer()
        fnty = ir.FunctionType(ir.VoidType(), [i8p, _I32, _I32, _I32])
        fn = cgutils.get_or_insert_function(builder.module, fnty, _PREFETCH_NAME)
        # rw=1 (will write), locality=3 (keep in all cache levels), cache type 1 (data)
        builder.call(fn, [builder.bitcast(ptr, i8p), ir.Constant(_I32, 1), ir.Constant(_I32, 3),
                          ir.Constant(_I32, 1)])
        return context.get_dummy_value()

    return sig, codegen


@njit(cache=True, inline="always")
def prefetch(array, index):  # pragma: no cover - numba
    """Prefetch ``array[index]`` of a 1-D array."""
    _prefetch(array, index, 0)


@njit(cache=True, inline="always")
def prefetch_row(array, row):  # pragma: no cover - numba
    """Prefetch every cache line of row ``row`` of a 2-D array."""
    step = max(1, 64 // array.itemsize)
    for col in range(0, array.shape[1], step):
        _prefetch(array, row, col)
