"""DES-style partial pooling on the wire: each shard pools the rows of a jagged feature that
it owns, per sample, and spreads a sample's gradient over them
(:meth:`~clients.ps_client.PSClient.pooled_lookup`, ``pooled_push``).
"""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np

from clients._ps_shards import ShardSet, received, sent
from services.common import messages as msg
from services.common.codecs import raw_array
from services.common.codecs.masked import DCTMPCodec, PooledMasks, encode_at, kept_mask
from services.common.errors import InvalidArgument
from services.common.sharding import split_by_shard

__all__ = ["PooledCalls"]

# per shard with ids: (shard, its ids in sample order, the samples holding any, their counts)
Parts = list[tuple[int, np.ndarray, np.ndarray, np.ndarray]]


def _check_mode(mode: str) -> None:
    if mode not in ("sum", "mean"):
        raise InvalidArgument(f"pooling mode must be 'sum' or 'mean', got {mode!r}")


def _parts(ids: np.ndarray, lengths: Any, num_shards: int) -> tuple[np.ndarray, Parts]:
    """Checked lengths and, per shard with ids: (shard, its ids in sample order, the samples
    holding any, their counts in the smallest unsigned type that holds them)."""
    lengths = np.asarray(lengths)
    if lengths.ndim != 1 or lengths.dtype.kind not in "iu" \
            or (lengths.size and int(lengths.min()) < 0):
        raise InvalidArgument("lengths must be a 1-d array of non-negative ints")
    ids = ids.reshape(-1)
    if int(lengths.sum()) != ids.size:
        raise InvalidArgument(f"lengths add up to {int(lengths.sum())} but there are "
                              f"{ids.size} ids")
    sample = np.repeat(np.arange(lengths.size), lengths)
    parts = []
    for k, pos in enumerate(split_by_shard(ids, num_shards)):
        if pos.size:
            counts = np.bincount(sample[pos], minlength=lengths.size)
            held = np.flatnonzero(counts)
            small = np.min_scalar_type(int(counts.max()))  # uint8 for bags under 256 ids
            parts.append((k, ids[pos], held, counts[held].astype(small)))
    return lengths, parts


class PooledCalls:
    """Pooled lookups and pushes over ``shards`` (their arrays counted in the shards'
    ``codec_stats``)."""

    def __init__(self, shards: ShardSet) -> None:
        self.shards = shards
        self.stats = shards.settings.codec_stats

    async def lookup(self, table: str, ids: np.ndarray, lengths: Any, mode: str,
                     codec: str) -> tuple[np.ndarray, PooledMasks]:
        """Per-sample pooled rows of uint64 ``ids`` (each shard's partial sums through
        ``codec``) and each shard's kept positions (None unless ``dct_mp``)."""
        _check_mode(mode)
        lengths, parts = _parts(ids, lengths, len(self.shards.connections))
        shards = self.shards.connections
        replies = await self.shards.within(asyncio.gather(*(
            shards[k].request(shards[k].pooled_lookup, msg.PooledLookupRequest(
                table=table, ids=raw_array(ids_k), lengths=raw_array(counts),
                codec=codec), msg.PooledLookupReply)
            for k, ids_k, _, counts in parts)))
        dim = self.shards.dims.get(table)
        if dim is None:
            dim = await self.shards.dim(table)
        out = np.zeros((lengths.size, dim), dtype=np.float32)
        masks = []
        for (_, _, held, _), reply in zip(parts, replies, strict=True):
            out[held] += received(self.stats, "pooled_down", reply.pooled)
            masks.append(kept_mask(reply.pooled) if reply.pooled.codec == DCTMPCodec.name
                         else None)
        if mode == "mean":
            out /= np.maximum(lengths, 1)[:, None]
        return out, tuple(masks)

    async def push(self, table: str, ids: np.ndarray, lengths: Any, grads: Any,
                   mode: str, masks: PooledMasks | None) -> list[msg.PooledPushReply]:
        """Send per-sample gradients of uint64 ``ids``' bags; the shards' replies."""
        _check_mode(mode)
        lengths, parts = _parts(ids, lengths, len(self.shards.connections))
        if masks is not None and len(masks) != len(parts):
            raise InvalidArgument(f"masks are needed for {len(parts)} shards' partial sums, "
                                  f"got {len(masks)}")
        grads = np.asarray(grads, dtype=np.float32)
        if grads.ndim != 2 or grads.shape[0] != lengths.size:
            raise InvalidArgument(f"pooled grads must be (len(lengths), dim) = "
                                  f"({lengths.size}, dim), got {grads.shape}")
        if mode == "mean":  # float32 on the wire, as the other gradients
            grads = grads / np.maximum(lengths, 1).astype(np.float32)[:, None]
        requests = []
        for j, (k, ids_k, held, counts) in enumerate(parts):
            shard = self.shards.connections[k]
            mask = None if masks is None else masks[j]
            body = (shard.pooled_grads_codec.to_wire(grads[held], key=table)  # τ per table
                    if mask is None else encode_at(grads[held], mask))
            sent(self.stats, "pooled_grads_up", body, grads[held])
            requests.append(shard.request(shard.pooled_push, msg.PooledPushRequest(
                client=shard.settings.push_numbers.client_id, seq=shard.next_seq(), table=table,
                ids=raw_array(ids_k), lengths=raw_array(counts), grads=body,
                epoch=shard.epoch or None), msg.PooledPushReply))
        return list(await self.shards.within(asyncio.gather(*requests)))
