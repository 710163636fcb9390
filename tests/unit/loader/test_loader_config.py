"""Source specs and loader settings: what is accepted and the errors for what is not."""

from __future__ import annotations

import pytest

from services.common.config import load_config
from services.common.errors import ConfigError
from services.loader.config import LoaderConfig, SourceKind, SourceSpec


def test_file_specs():
    spec = SourceSpec.parse("criteo:data/day_*.gz,more/x.txt?dense=4&sparse=8&multi_hot=,")
    assert spec.kind is SourceKind.CRITEO and spec.kind.is_file
    assert spec.globs() == ["data/day_*.gz", "more/x.txt"]
    assert spec.int_param("dense", 13) == 4 and spec.params["multi_hot"] == ","
    assert SourceSpec.parse("csv:a.csv?schema=s.yaml").params == {"schema": "s.yaml"}
    assert SourceSpec.parse("parquet:p/*.parquet?label=click").params["label"] == "click"


def test_stream_specs():
    kafka = SourceSpec.parse("kafka://h1:9092,h2:9092/clicks?group=g&format=json&schema=s.yaml")
    assert (kafka.kind, kafka.target, kafka.topic) == (SourceKind.KAFKA, "h1:9092,h2:9092",
                                                      "clicks")
    redis = SourceSpec.parse("redis://127.0.0.1:6379/events?group=g&consumer=c1")
    assert (redis.target, redis.topic, redis.params["consumer"]) == ("127.0.0.1:6379",
                                                                     "events", "c1")
    synth = SourceSpec.parse("synthetic:5000?split=test")
    assert synth.rows() == 5000 and not synth.kind.is_file


@pytest.mark.parametrize("spec,match", [
    ("nothing", "KIND:TARGET"),
    ("hdfs:/x", "unknown source kind"),
    ("criteo:", "names no files"),
    ("criteo:a.txt?colour=red", r"unknown parameters \['colour'\]"),
    ("csv:a.csv", "schema"),
    ("kafka://h:1/topic", "group"),
    ("kafka://h:1/?group=g", "HOST:PORT/NAME"),
    ("redis://h:1/a/b?group=g", "HOST:PORT/NAME"),
    ("synthetic:many", "row count"),
    ("synthetic:0", ">= 1"),
])
def test_bad_specs(spec, match):
    with pytest.raises(ConfigError, match=match):
        SourceSpec.parse(spec)


def test_bad_integer_parameter():
    spec = SourceSpec.parse("criteo:a.txt?dense=x")
    with pytest.raises(ConfigError, match="integer"):
        spec.int_param("dense", 13)


@pytest.mark.parametrize("override,match", [
    ({"batch_size": 0}, "batch_size"), ({"grpc_port": 70000}, "grpc_port"),
    ({"replica": 2, "replicas": 2}, "replica"), ({"shuffle_buffer": -1}, "shuffle_buffer"),
    ({"dense_clip_min": 5.0, "dense_clip_max": 1.0}, "clip"), ({"colour": "red"}, "unknown keys"),
    ({"source": "hdfs:/x"}, "unknown source kind"), ({"epochs": 0}, "epochs"),
    ({"max_streams_per_client_id": 0}, "max_streams_per_client_id"),
    ({"max_streams_per_client": 0}, "max_streams_per_client"),
])
def test_bad_loader_settings(override, match):
    with pytest.raises(ConfigError, match=match):
        load_config(LoaderConfig, flags=override)


def test_yaml_env_and_flags_merge(tmp_path):
    path = tmp_path / "loader.yaml"
    path.write_text("batch_size: 64\nsource: synthetic:100\nseed: 3\n")
    cfg = load_config(LoaderConfig, yaml_path=path, env_prefix="PERSIMMON_LOADER_",
                      environ={"PERSIMMON_LOADER_SEED": "5", "PERSIMMON_LOADER_DENSE_LOG1P": "no"},
                      flags={"batch_size": "128"})
    assert (cfg.batch_size, cfg.seed, cfg.dense_log1p, cfg.source) == (128, 5, False,
                                                                       "synthetic:100")
    assert cfg.dense_transform().log1p is False
    with pytest.raises(ConfigError, match="PERSIMMON_LOADER_BATCH_SIZE"):
        load_config(LoaderConfig, env_prefix="PERSIMMON_LOADER_",
                    environ={"PERSIMMON_LOADER_BATCHSIZE": "1"})
