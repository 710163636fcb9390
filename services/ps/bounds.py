"""Every size a PS request names, bounded by the shard before any array is decoded.

The message checks (:mod:`services.common.messages`) tie a request's arrays together: ids and
pooled lengths travel raw, so their count is bounded by the bytes that came, and every other
array is sized by them (gradient rows = ids, pooled gradient rows = samples). What only the
shard knows is checked here, on the decoded headers: the ids' count against
``max_ids_per_request``, each gradient array's dim against its table's dim (an unknown table is
NotFound) and a step tag's ``workers`` against ``max_workers``. Then decoding allocates at most
what an honest request of the same ids needs (ids × the table's dim), and a refused request
allocates nothing proportional to what it declares. Each check is O(tables named).
"""

from __future__ import annotations

from services.common.codecs import WireArray
from services.common.errors import InvalidArgument
from services.common.messages import (
    LookupRequest,
    PooledLookupRequest,
    PooledPushRequest,
    PushRequest,
)
from services.ps.shard import Shard
from services.ps.staleness import StepTag

__all__ = ["check_lookup", "check_pooled", "check_push", "step_tag"]


def step_tag(shard: Shard, tag: list[int] | None, where: str) -> StepTag | None:
    """``tag`` as a :data:`StepTag`, its ``workers`` within the shard's ``max_workers``."""
    if tag is None:
        return None
    limit = shard.config.max_workers
    if tag[2] > limit:
        raise InvalidArgument(f"{where}.tag names {tag[2]} workers, more than this shard's "
                              f"max_workers ({limit})")
    return tag[0], tag[1], tag[2]


def _ids(shard: Shard, ids: WireArray, where: str) -> None:
    limit = shard.config.max_ids_per_request
    if ids.shape[0] > limit:
        raise InvalidArgument(f"{where}.ids: {ids.shape[0]} ids exceed the limit of {limit} "
                              "per request (max_ids_per_request)")


def _dim(shard: Shard, grads: WireArray, table: str, where: str) -> None:
    dim = shard.table(table).dim
    if grads.shape[1] != dim:
        raise InvalidArgument(f"{where} has dim {grads.shape[1]} but table {table!r} has dim "
                              f"{dim}")


def check_lookup(shard: Shard, req: LookupRequest, where: str = "LookupRequest") -> StepTag | None:
    """Bound a lookup; its step tag."""
    _ids(shard, req.ids, where)
    for name in req.tables:
        shard.table(name)
    return step_tag(shard, req.tag, where)


def check_push(shard: Shard, req: PushRequest, where: str = "PushRequest") -> StepTag | None:
    """Bound a push: ids, and each gradient array's dim against its table's; its step tag."""
    _ids(shard, req.ids, where)
    if len(req.grads) == 1:
        for name in req.tables:
            _dim(shard, req.grads[0], name, f"{where}.grads[0]")
    else:
        for i, (grads, name) in enumerate(zip(req.grads, req.tables, strict=True)):
            _dim(shard, grads, name, f"{where}.grads[{i}]")
    return step_tag(shard, req.tag, where)


def check_pooled(shard: Shard, req: PooledLookupRequest | PooledPushRequest,
                 where: str) -> None:
    """Bound a pooled lookup or push: ids, samples, and a push's gradient dim."""
    _ids(shard, req.ids, where)
    if req.lengths.shape[0] > shard.config.max_ids_per_request:
        raise InvalidArgument(f"{where}.lengths holds {req.lengths.shape[0]} samples, more "
                              "than max_ids_per_request")
    if isinstance(req, PooledPushRequest):
        _dim(shard, req.grads, req.table, f"{where}.grads")
    else:
        shard.table(req.table)
