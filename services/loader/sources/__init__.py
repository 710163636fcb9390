"""Record sources of the loader; :func:`make_source` builds the one a spec names."""

from __future__ import annotations

from services.loader.config import LoaderConfig, SourceKind
from services.loader.sources.base import Rewindable, Source, SourceBlock

__all__ = ["Rewindable", "Source", "SourceBlock", "make_source"]


def make_source(config: LoaderConfig) -> Source:
    """The source of ``config.source`` (not started; call ``await source.start()``)."""
    spec = config.spec
    if spec.kind.is_file:
        from services.loader.sources.files import FileSource

        return FileSource(spec, config)
    if spec.kind is SourceKind.KAFKA:
        from services.loader.sources.kafka import KafkaSource

        return KafkaSource(spec, config)
    if spec.kind is SourceKind.REDIS:
        from services.loader.sources.redis_streams import RedisStreamSource

        return RedisStreamSource(spec, config)
    from services.loader.sources.synthetic import SyntheticSource

    return SyntheticSource(spec, config)
