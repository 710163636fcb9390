"""The data loader: records from files, Kafka, Redis Streams or the planted synthetic set,
hashed into id batches and streamed to workers with credit-based flow control.

Layout (the service file set of STYLE.md):

- ``__main__``: the ``persimmon loader``, ``loader produce`` and ``synth`` commands
- ``config``: :class:`LoaderConfig` and the source spec grammar
- ``server`` (gRPC ``persimmon.Loader``), ``admin`` (REST), ``service`` (the process)
- ``sources/``: files (Criteo, Avazu, schema CSV, Parquet), Kafka, Redis Streams, synthetic
- ``parsers`` (one-pass text parser), ``arrow`` (Parquet/JSON), ``schema``, ``hashing``
- ``batching`` (rows, shuffle, ack accounting), ``dispatch`` (credits), ``pipeline``
- ``planted``: the planted data set and its oracle metrics
- ``featurize``: a model version's :class:`FeatureSpec`, how raw records become model inputs
  exactly as the loader made them in training (serving featurizes with it)

The batch type workers receive is :class:`services.common.batch.Batch`.
"""

from services.loader.featurize import Features, FeatureSpec, spec_from_source

__all__ = ["FeatureSpec", "Features", "spec_from_source"]
