"""The lossy codecs' bytes on the wire, pinned: a small fixed input, encoded call after call
(error feedback and cached thresholds included), gives these exact arrays.

A refactor of the codecs must leave every digest here as it is; a deliberate change of a wire
format changes its digest in the same commit. Each case is a codec spec and the inputs it
encodes in turn under one key; the digest is SHA-256 over each call's whole array map
(``dtype``, ``shape``, ``codec``, ``meta``, ``data``) as msgpack.
"""

from __future__ import annotations

import hashlib

import msgspec
import numpy as np
import pytest

from services.common.codecs import WireArray, decode_array, get_codec
from services.common.codecs.masked import encode_at

X = np.array([[0.75, -1.5, 0.03125, 2.25],
              [-0.375, 0.0, 1.125, -0.0625],
              [3.5, -2.75, 0.5, -0.875]], dtype=np.float32)
NAN = X.copy()
NAN[1, 2] = np.nan
STEP = np.array([[0.25, 0.5, -0.125, 0.0],
                 [1.0, -0.75, 0.0625, 0.375],
                 [-0.5, 0.125, -1.25, 0.625]], dtype=np.float32)

# (codec spec, inputs encoded in turn) -> digest of the arrays the calls put on the wire
CASES: dict[str, tuple[str, tuple[np.ndarray, ...], str]] = {
    "topk sparse, feedback": ("topk:keep=0.25", (X, X + STEP, X - STEP), "5ee60d76224122bb9e1d9f61949fe6cb"),
    "topk dense": ("topk:keep=0.75", (X, STEP), "5b8c1ff66779daa6f7ee62f1f566dd73"),
    "topk fp32 values": ("topk:keep=0.25,values=fp32", (X, STEP), "26342cfe132e0eb08c03d94cdafd0f05"),
    "topk beyond fp16": ("topk:keep=0.25", (40_000 * X,), "6951b33b9ff926244def03d2b1583f1c"),
    "topk nonfinite": ("topk:keep=0.25", (NAN, X), "5a64ebcafeab0f2084d14dced5fd0c9e"),
    "dct refresh and drift": ("dct:keep=0.25,refresh=2", (X, X + STEP, STEP, 10 * STEP),
                              "0936e29893074eba55aabccce2b07de8"),
    "dct fixed threshold": ("dct:threshold=1.0", (X, STEP), "a040f1813f95919599a55080e295d699"),
    "dct nonfinite": ("dct:keep=0.25", (NAN, X), "215288d30a7f309e7bee869918ef721d"),
    "dct_mp masked": ("dct_mp:keep=0.25,refresh=2", (X, X + STEP, STEP),
                      "a023b011ab81c3b10c183822407a7308"),
    "dct_mp beyond fp16": ("dct_mp:keep=0.25", (40_000 * X,), "06f7bff0a4749e0180401b92a17f3cfe"),
    "dct_mp dense": ("dct_mp:keep=1.0", (X,), "b5eef93ac1e04c3195e0d5ae57c058b3"),
    "dct_mp nonfinite": ("dct_mp:keep=0.25", (NAN, X), "53dcd79bd67a4ad4765e084690b84b1e"),
    "qsgd": ("qsgd:levels=3,bucket=5,seed=0", (X, STEP), "ee3f404e69ebcce6d083ad75c5567f8b"),
    "qsgd one bucket": ("qsgd:levels=15,bucket=0,seed=1", (X,), "8ff3659773df3f14e5d7eabe39139f9e"),
    "qsgd nonfinite": ("qsgd:seed=0", (NAN, X), "6a699d9bc94ad2607962d958026de709"),
    "adaquant": ("adaquant:s0=4,seed=0", (X, STEP), "ad8111b082ab2154865b092eeace8778"),
    "onebit feedback": ("onebit:chunk=5", (X, STEP, X), "46a2d549fda9511d5b2054c971c631e9"),
    "onebit nonfinite": ("onebit:chunk=5", (NAN, X), "9155a9b5896909c6bf3296e8d5105126"),
    "int8": ("int8", (X, NAN), "09f4b3209ab2d8c50da208a74a1167fc"),
    "uniform": ("uniform:bits=3", (X, NAN), "d045ea4b161c077421c8f742f66e7e90"),
    "uniform feedback": ("uniform:bits=4,error_feedback=true", (X, STEP, NAN, X),
                         "deafafa6908d6b0c10902992c4b5b8d6"),
}


def _digest(arrays: list[WireArray]) -> str:
    h = hashlib.sha256()
    for arr in arrays:
        h.update(msgspec.msgpack.encode(arr))
    return h.hexdigest()[:32]


def _encoded(spec: str, inputs: tuple[np.ndarray, ...]) -> list[WireArray]:
    codec = get_codec(spec)
    return [codec.to_wire(x, key="k") for x in inputs]


@pytest.mark.parametrize("case", list(CASES))
def test_encoded_bytes_are_pinned(case: str) -> None:
    spec, inputs, digest = CASES[case]
    arrays = _encoded(spec, inputs)
    shown = [(a.codec, a.meta, bytes(a.data).hex()) for a in arrays]
    assert _digest(arrays) == digest, shown
    for arr, x in zip(arrays, inputs, strict=True):   # and each decodes to its shape
        assert decode_array(arr, case).shape == x.shape


def test_gradient_at_kept_positions_is_pinned() -> None:
    """``encode_at``: DCT-MP's gradient back at the activations' positions."""
    forward = get_codec("dct_mp:keep=0.25").to_wire(X, key="k")
    mask = np.unpackbits(np.frombuffer(bytes(forward.data)[:2], dtype=np.uint8),
                         count=X.size).view(bool).reshape(X.shape)
    arrays = [encode_at(STEP, mask), encode_at(STEP, np.ones(X.shape, dtype=bool)),
              encode_at(NAN, mask)]
    assert _digest(arrays) == "32243a61109b88642c97ad87574eb058", [
        (a.meta, bytes(a.data).hex()) for a in arrays]
