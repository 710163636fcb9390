"""``dct_mp``: DCT-MP's activations thresholded at a τ reused over calls, their gradient sent
back at the same positions (services/common/codecs/masked.py).

Wrong implementations these catch: τ recomputed on every call (``refreshes`` counts the
quantiles taken), the gradient thresholded on its own magnitudes instead of at the
activations' kept positions, a bitmap/values mismatch accepted from a peer.
"""

from __future__ import annotations

import numpy as np
import pytest

from services.common.codecs import decode_array, get_codec
from services.common.codecs.masked import encode_at, kept_mask
from services.common.errors import InvalidArgument, MalformedMessage


def _acts(seed: int, scale: float = 1.0) -> np.ndarray:
    return (np.random.default_rng(seed).normal(size=(64, 16)) * scale).astype(np.float32)


def test_kept_entries_are_those_at_least_tau_rounded_to_fp16_and_bytes_are_bitmap_plus_values(
) -> None:
    codec = get_codec("dct_mp:keep=0.25,refresh=32")
    x = _acts(0)
    arr = codec.to_wire(x, key="t")
    tau = codec.tau("t")
    mask = kept_mask(arr)
    np.testing.assert_array_equal(mask, np.abs(x) >= tau)
    assert mask.sum() == 256  # the (1 - keep) quantile of one batch keeps exactly keep
    got = decode_array(arr, "test")
    np.testing.assert_array_equal(got[mask], x[mask].astype(np.float16).astype(np.float32))
    assert not got[~mask].any()
    assert arr.nbytes == 64 * 16 // 8 + 2 * 256  # 1 bit a position, fp16 a kept value


def test_tau_is_reused_for_refresh_calls_then_recomputed() -> None:
    codec = get_codec("dct_mp:keep=0.25,refresh=4")
    taus = []
    for step in range(9):  # a slowly drifting scale, within the drift guard's band
        codec.to_wire(_acts(step, 1.0 + 0.02 * step), key="t")
        taus.append(codec.tau("t"))
    assert codec.refreshes == 3  # calls 0, 4 and 8: not one per call
    assert taus[0] == taus[1] == taus[2] == taus[3] != taus[4]
    assert taus[4] == taus[7] != taus[8]


def test_each_key_has_its_own_tau() -> None:
    codec = get_codec("dct_mp:keep=0.25,refresh=32")
    codec.to_wire(_acts(0), key="small")
    codec.to_wire(_acts(1, 100.0), key="large")
    assert codec.tau("large") > 50 * codec.tau("small")


def test_gradient_goes_back_at_the_forward_positions_only() -> None:
    forward = get_codec("dct_mp:keep=0.25,refresh=32").to_wire(_acts(0), key="t")
    mask = kept_mask(forward)
    grad = _acts(7)  # magnitudes unrelated to the activations': its own top quarter differs
    back = encode_at(grad, mask)
    np.testing.assert_array_equal(kept_mask(back), mask)
    got = decode_array(back, "test")
    np.testing.assert_array_equal(got[mask], grad[mask].astype(np.float16).astype(np.float32))
    assert not got[~mask].any()
    assert back.nbytes == forward.nbytes


def test_keep_one_sends_float32_unchanged_and_every_position_back() -> None:
    x = _acts(3)
    arr = get_codec("dct_mp:keep=1.0").to_wire(x, key="t")
    np.testing.assert_array_equal(decode_array(arr, "test"), x)
    assert kept_mask(arr).all()
    np.testing.assert_array_equal(decode_array(encode_at(x, kept_mask(arr)), "test"), x)


def test_non_finite_gradient_travels_as_such() -> None:
    grad = _acts(2)
    grad[0, 0] = np.nan
    assert np.isnan(decode_array(encode_at(grad, np.abs(grad) > 1), "test")).all()


def test_bad_masks_and_payloads_are_refused() -> None:
    grad = _acts(1)
    with pytest.raises(InvalidArgument, match="mask must be a bool array of shape"):
        encode_at(grad, np.ones((64, 8), dtype=bool))
    with pytest.raises(InvalidArgument, match="mask must be a bool array"):
        encode_at(grad, np.ones((64, 16), dtype=np.uint8))
    arr = encode_at(grad, np.abs(grad) > 1)
    arr.meta = {**arr.meta, "k": arr.meta["k"] - 1}  # one value fewer than the bitmap marks
    arr.data = bytes(arr.data)[:-2]
    with pytest.raises(MalformedMessage, match="bitmap marks"):
        decode_array(arr, "test")
    with pytest.raises(InvalidArgument, match="reads dct_mp arrays"):
        kept_mask(get_codec("fp16").to_wire(grad))
