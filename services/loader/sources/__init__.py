"""Record sources of the loader; :func:`make_source` builds the one a spec names,
:func:`check_source` checks what a launcher can check of a spec before any process starts."""

from __future__ import annotations

from services.loader.config import LoaderConfig, SourceKind, SourceSpec
from services.loader.sources.base import Rewindable, Source, SourceBlock

__all__ = ["Rewindable", "Source", "SourceBlock", "check_source", "make_source"]


def check_source(text: str) -> SourceSpec:
    """The parsed spec ``text``, its files and schema file checked (a ConfigError when the
    spec is malformed, matches no files or names an unreadable schema); a stream's broker is
    not dialled."""
    spec = SourceSpec.parse(text)
    if spec.kind.is_file:
        from services.loader.schema import load_schema_file
        from services.loader.sources.files import source_files

        source_files(spec)
        if spec.params.get("schema"):
            load_schema_file(spec.params["schema"])
    return spec


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
