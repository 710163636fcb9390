"""The requests :class:`~clients.ps_client.PSClient` sends a shard, built from its share of a
layout, and the arrays of the replies, through the client's codecs and counted per stream.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from clients._ps_shard import ShardConnection
from services.common import messages as msg
from services.common.codecs import RowEncoder, WireArray, WireStats, decode_array, raw_array
from services.common.errors import InvalidArgument
from services.common.sharding import ShardedIds

__all__ = ["ShardMessages", "check_grads"]


def check_grads(layout: ShardedIds, grads: np.ndarray) -> None:
    """InvalidArgument unless ``grads`` has a row per id of ``layout``."""
    if grads.ndim != 2 or grads.shape[0] != layout.ids.size:
        raise InvalidArgument(f"grads must be ({layout.ids.size}, dim), got {grads.shape}")


def _tag(layout: ShardedIds) -> list[int] | None:
    """The layout's step tag as it travels (services.ps.staleness counts it)."""
    return None if layout.tag is None else list(layout.tag)


class ShardMessages:
    """Lookup and Push requests of shard ``k``'s slice of a layout, and the rows of replies.

    ``rows_codec`` encodes the rows a lookup asks for, ``grads_codec`` the gradients (each
    shard connection holds its encoders and their residuals); ``client_id`` names the pushes;
    ``codec_stats`` counts every array's raw and wire bytes per stream.
    """

    def __init__(self, rows_codec: str, grads_codec: str, client_id: int,
                 codec_stats: WireStats) -> None:
        self.rows_codec, self.grads_codec = rows_codec, grads_codec
        self.client_id = client_id
        self.codec_stats = codec_stats

    def lookup(self, k: int, layout: ShardedIds, read_only: bool = False, *,
               with_state: bool = False) -> msg.LookupRequest:
        lo, hi = layout.bounds[k], layout.bounds[k + 1]
        return msg.LookupRequest(tables=list(layout.tables), counts=layout.counts[k].tolist(),
                                 ids=raw_array(layout.ids[lo:hi]),
                                 codec="none" if with_state else self.rows_codec,
                                 tag=_tag(layout), read_only=True if read_only else None,
                                 with_state=True if with_state else None)

    def push(self, shard: ShardConnection, k: int, layout: ShardedIds, grads: np.ndarray
             ) -> msg.PushRequest:
        lo, hi = int(layout.bounds[k]), int(layout.bounds[k + 1])
        return msg.PushRequest(client=self.client_id, seq=shard.next_seq(),
                               tables=list(layout.tables), counts=layout.counts[k].tolist(),
                               ids=raw_array(layout.ids[lo:hi]),
                               grads=self._grads(shard, k, layout, lo, grads),
                               tag=_tag(layout), epoch=shard.epoch or None)

    def _grads(self, shard: ShardConnection, k: int, layout: ShardedIds, lo: int,
               grads: np.ndarray) -> list[WireArray]:
        """Shard ``k``'s gradients on the wire: one array, or one per table when the codec
        keeps a residual per id (and so per table)."""
        hi = int(layout.bounds[k + 1])
        if not shard.grads_per_table:
            body = shard.grads_encoder.to_wire(layout.ids[lo:hi], grads[lo:hi])
            self.sent("grads_up", body, grads[lo:hi])
            return [body]
        bodies = []
        for table, count in zip(layout.tables, layout.counts[k].tolist(), strict=True):
            encoder = shard.grads_encoders.get(table)
            if encoder is None:
                encoder = shard.grads_encoders[table] = RowEncoder(self.grads_codec)
            ids, g = layout.ids[lo:lo + count], grads[lo:lo + count]
            body = encoder.to_wire(ids, g, key=table)
            self.sent("grads_up", body, g)
            bodies.append(body)
            lo += count
        return bodies

    def rows(self, replies: Sequence[msg.LookupReply]) -> np.ndarray:
        """The rows of the replies (in shard order, at least one) as one writable float32
        array."""
        parts = [self.received("rows_down", reply.rows) for reply in replies]
        rows = np.concatenate(parts) if len(parts) > 1 else np.array(parts[0])  # writable
        return rows if rows.dtype == np.float32 else rows.astype(np.float32)

    def received(self, stream: str, arr: WireArray) -> np.ndarray:
        """``arr`` decoded, counted as received on ``stream``."""
        out = decode_array(arr, stream)
        self.codec_stats.add(stream, arr.codec, "received", 4 * out.size, arr.nbytes)
        return out

    def sent(self, stream: str, arr: WireArray, x: np.ndarray) -> None:
        """Count ``arr`` (``x`` encoded) as sent on ``stream``."""
        self.codec_stats.add(stream, arr.codec, "sent", 4 * x.size, arr.nbytes)
