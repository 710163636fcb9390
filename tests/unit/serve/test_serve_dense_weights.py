"""A version's dense weights: a safetensors file covered by the manifest's checksums; format 1
versions (a torch.save pickle) still load, with a deprecation warning."""

from __future__ import annotations

import hashlib
import io
import json
import logging
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors import safe_open
from serve_versions import DIMS, MODEL, SPEC, MakeVersion, ps_initial_rows, random_tables

from services.common.errors import FailedPrecondition, InvalidArgument
from services.serve.export import read_manifest, write_version
from services.serve.predictor import Predictor
from services.serve.weights import dense_bytes, read_dense

RECORDS = [{"I1": 1.5, "I2": 0.0, "C1": "a", "C2": "b", "C3": "x|y"},
           {"I1": 0.0, "I2": 7.0, "C1": "q", "C2": "r", "C3": ""}]


def as_format_1(directory: Path, state: dict[str, torch.Tensor]) -> None:
    """Rewrite a version in the old layout: the state_dict as a torch.save pickle, dense.pt,
    listed with its sha256 in a format 1 manifest."""
    buf = io.BytesIO()
    torch.save(state, buf)
    blob = buf.getvalue()
    (directory / "dense.pt").write_bytes(blob)
    (directory / "dense.safetensors").unlink()
    manifest = json.loads((directory / "manifest.json").read_text())
    del manifest["files"]["dense.safetensors"]
    manifest["files"]["dense.pt"] = {"sha256": hashlib.sha256(blob).hexdigest(),
                                     "bytes": len(blob)}
    manifest["format"] = 1
    (directory / "manifest.json").write_text(json.dumps(manifest))


def predict(predictor: Predictor) -> np.ndarray:
    return predictor.predict(predictor.featurize({"records": RECORDS}))


def test_dense_weights_are_a_safetensors_file_the_manifest_covers(
        tmp_path: Path, make_version: MakeVersion) -> None:
    m = make_version(step=9)
    directory = tmp_path / "models" / m["version_id"]
    manifest = read_manifest(directory)
    assert manifest["format"] == 2
    assert "dense.safetensors" in manifest["files"] and "dense.pt" not in manifest["files"]
    assert not (directory / "dense.pt").exists()
    state = m["_module"].state_dict()
    with safe_open(directory / "dense.safetensors", framework="pt") as f:  # no pickle, no torch
        assert set(f.keys()) == set(state)
        for name in state:
            torch.testing.assert_close(f.get_tensor(name), state[name], rtol=0, atol=0)
        assert f.metadata() == {"format": "persimmon-dense", "version_id": m["version_id"],
                                "step": "9"}
    read = read_dense(directory, manifest)  # NumPy arrays: serving reads them without torch
    assert set(read) == set(state)
    for name, value in read.items():
        np.testing.assert_array_equal(value, state[name].numpy())
    Predictor.load(directory, initial_rows=ps_initial_rows)
    path = directory / "dense.safetensors"
    data = bytearray(path.read_bytes())
    data[-1] ^= 0x01  # one bit of one weight
    path.write_bytes(bytes(data))
    with pytest.raises(FailedPrecondition, match="dense.safetensors is corrupt"):
        Predictor.load(directory, initial_rows=ps_initial_rows)


def test_a_format_1_version_still_loads_with_a_deprecation_warning(
        tmp_path: Path, make_version: MakeVersion, caplog: pytest.LogCaptureFixture) -> None:
    new = make_version(step=3, seed=1)
    old = make_version(step=3, seed=1)  # the same weights and rows, rewritten below
    old_dir = tmp_path / "models" / old["version_id"]
    as_format_1(old_dir, old["_module"].state_dict())
    caplog.set_level(logging.WARNING, logger="services.serve.weights")
    legacy = Predictor.load(old_dir, initial_rows=ps_initial_rows)
    warned = [r.getMessage() for r in caplog.records if r.name == "services.serve.weights"]
    assert len(warned) == 1 and old["version_id"] in warned[0]
    assert "dense.pt" in warned[0] and "deprecated" in warned[0]
    current = Predictor.load(tmp_path / "models" / new["version_id"],
                             initial_rows=ps_initial_rows)
    np.testing.assert_array_equal(predict(legacy), predict(current))
    caplog.clear()
    Predictor.load(tmp_path / "models" / new["version_id"], initial_rows=ps_initial_rows)
    assert not [r for r in caplog.records if r.name == "services.serve.weights"]
    # the old layout's checksum is still checked
    blob = bytearray((old_dir / "dense.pt").read_bytes())
    blob[-1] ^= 0x01
    (old_dir / "dense.pt").write_bytes(bytes(blob))
    with pytest.raises(FailedPrecondition, match="dense.pt is corrupt"):
        Predictor.load(old_dir, initial_rows=ps_initial_rows)


def test_unreadable_dense_weights_are_a_clear_error_even_unverified(
        tmp_path: Path, make_version: MakeVersion) -> None:
    m = make_version()
    directory = tmp_path / "models" / m["version_id"]
    (directory / "dense.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json")
    with pytest.raises(FailedPrecondition, match=f"{m['version_id']}: its dense weights "
                                                 "cannot be read"):
        Predictor.load(directory, initial_rows=ps_initial_rows, verify=False)
    manifest = json.loads((directory / "manifest.json").read_text())
    del manifest["files"]["dense.safetensors"]
    (directory / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(FailedPrecondition, match="lists no dense weights file"):
        Predictor.load(directory, initial_rows=ps_initial_rows, verify=False)


def test_a_state_with_a_non_tensor_entry_is_refused_and_nothing_written(tmp_path: Path) -> None:
    module = MODEL.build(sparse_dims=DIMS, num_dense=2)
    state = {**module.state_dict(), "trained_on": "criteo-day-0"}
    models = tmp_path / "models"
    with pytest.raises(InvalidArgument, match="'trained_on' is a str, not a tensor"):
        write_version(models, step=1, model=MODEL, state=state, features={f: f for f in DIMS},
                      num_dense=2, tables=random_tables(np.random.default_rng(0)), spec=SPEC)
    assert not models.exists() or not any(models.iterdir())


def test_tensors_sharing_storage_are_written_apart() -> None:
    weight = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    blob = dense_bytes({"a": weight, "b": weight, "c": weight.t()}, version_id="v", step=0)
    from safetensors.torch import load

    got = load(blob)
    torch.testing.assert_close(got["b"], weight, rtol=0, atol=0)
    torch.testing.assert_close(got["c"], weight.t(), rtol=0, atol=0)
