"""The prediction server over REST (port 0): hot swap under load, rollback, refused versions,
bad input, readiness and metrics."""

from __future__ import annotations

import asyncio
import json
import math
import os
import shutil
from pathlib import Path
from typing import Any

import grpc
import httpx
import numpy as np
import pytest
from serve_training import eventually, ps_initial_rows, random_version, records, server
from threadpoolctl import threadpool_info, threadpool_limits

from services.common.codecs.registry import decode_array
from services.common.errors import ConfigError
from services.common.messages import decode, encode
from services.common.rpc import open_channel
from services.common.wire import encode_message
from services.serve.config import ServeConfig
from services.serve.predictor import Predictor
from services.serve.server import SERVICE_NAME, PredictReply, PredictRequest

PROBE = records(np.random.default_rng(5), 3)


def expected(models: Path, version_id: str) -> list[float]:
    predictor = Predictor.load(models / version_id, initial_rows=ps_initial_rows)
    return predictor.predict(predictor.featurize({"records": PROBE})).tolist()


async def predict(http: httpx.AsyncClient, body: Any = None) -> dict[str, Any]:
    response = await http.post("/v1/predict", json={"records": PROBE} if body is None else body)
    assert response.status_code == 200, response.text
    return response.json()


async def test_hot_swap_under_concurrent_requests(tmp_path: Path) -> None:
    v1 = random_version(tmp_path, step=1, bias=3.0)["version_id"]
    answers = {v1: expected(tmp_path, v1)}
    seen: list[dict[str, Any]] = []
    failures: list[str] = []
    stop = asyncio.Event()
    async with server(tmp_path) as service, httpx.AsyncClient(base_url=service.url,
                                                              timeout=30) as http:
        async def client() -> None:
            while not stop.is_set():
                response = await http.post("/v1/predict", json={"records": PROBE})
                if response.status_code != 200:
                    failures.append(response.text)
                else:
                    seen.append(response.json())

        clients = [asyncio.create_task(client()) for _ in range(8)]
        await eventually(lambda: len(seen) > 20, timeout=20)
        v2 = random_version(tmp_path, step=2, bias=-3.0)["version_id"]
        answers[v2] = expected(tmp_path, v2)
        await eventually(lambda: any(a["version"] == v2 for a in seen))
        count = len(seen)
        await eventually(lambda: len(seen) > count + 20)
        stop.set()
        await asyncio.gather(*clients)
        metrics = (await http.get("/metrics")).text
    assert not failures
    assert answers[v1][0] > 0.9 > 0.1 > answers[v2][0]  # the bias tells the versions apart
    for answer in seen:  # every answer is wholly one version's
        assert answer["probabilities"] == pytest.approx(answers[answer["version"]], abs=1e-6)
    assert {a["version"] for a in seen} == {v1, v2}
    assert f'persimmon_serve_version_info{{version="{v2}"}} 1.0' in metrics
    assert f'version="{v1}"' not in metrics
    assert 'persimmon_serve_request_seconds_count{code="200"}' in metrics


async def test_rollback_pins_a_version_until_latest(tmp_path: Path) -> None:
    v1 = random_version(tmp_path, step=1, bias=2.0)["version_id"]
    v2 = random_version(tmp_path, step=2, bias=-2.0)["version_id"]
    async with server(tmp_path) as service, httpx.AsyncClient(base_url=service.url) as http:
        assert (await predict(http))["version"] == v2  # the newest at start
        rolled = await http.post(f"/v1/versions/{v1}/activate")
        assert rolled.status_code == 200 and rolled.json()["active"]["version_id"] == v1
        answer = await predict(http)
        assert answer["version"] == v1
        assert answer["probabilities"] == pytest.approx(expected(tmp_path, v1), abs=1e-6)
        v3 = random_version(tmp_path, step=3, bias=0.0)["version_id"]
        assert not await service.versions.refresh()  # pinned: the watcher stays on v1
        assert (await predict(http))["version"] == v1
        listing = (await http.get("/v1/versions")).json()
        assert [v["version_id"] for v in listing["versions"]] == [v1, v2, v3]
        assert listing["pinned"] == v1 and listing["active"]["version_id"] == v1
        latest = await http.post("/v1/versions/latest/activate")
        assert latest.status_code == 200 and latest.json()["active"]["version_id"] == v3
        assert (await predict(http))["version"] == v3
        missing = await http.post("/v1/versions/v-nope/activate")
        assert missing.status_code == 404 and missing.json()["error"] == "NotFound"
        bad = await http.post("/v1/versions/..%2Fetc/activate")
        assert bad.status_code in (404, 422)


def _corrupt_copy(src: Path, dest: Path) -> None:
    """Copy version ``src`` to ``dest`` with one byte of a row file flipped, then rename
    into place (the watcher never sees it half-copied)."""
    staging = dest.parent / f".staging-{dest.name}"
    shutil.copytree(src, staging)
    path = staging / "t0-rows.npy"
    data = bytearray(path.read_bytes())
    data[-3] ^= 0x55
    path.write_bytes(bytes(data))
    manifest = (staging / "manifest.json").read_text().replace(src.name, dest.name)
    (staging / "manifest.json").write_text(manifest)
    os.rename(staging, dest)


async def test_corrupt_and_half_written_versions_are_refused(tmp_path: Path) -> None:
    models, other = tmp_path / "models", tmp_path / "other"
    v1 = random_version(models, step=1, bias=1.0)["version_id"]
    donor = random_version(other, step=5, bias=-1.0)["version_id"]
    async with server(models) as service, httpx.AsyncClient(base_url=service.url) as http:
        before = await predict(http)
        _corrupt_copy(other / donor, models / "v5-corrupt")
        half = models / "v6-half"  # files but no manifest: an export that stopped midway
        shutil.copytree(other / donor, half)
        (half / "manifest.json").unlink()

        async def refused() -> bool:
            listing = (await http.get("/v1/versions")).json()["versions"]
            return any(v["version_id"] == "v5-corrupt" and v["refused"] for v in listing)

        await eventually(refused)
        after = await predict(http)
        assert after == before and after["version"] == v1  # still v1, same answers
        activate = await http.post("/v1/versions/v5-corrupt/activate")
        assert activate.status_code == 412 and "corrupt" in activate.json()["message"]
        assert (await http.post("/v1/versions/v6-half/activate")).status_code == 404
        ids = [v["version_id"] for v in (await http.get("/v1/versions")).json()["versions"]]
        assert ids == [v1, "v5-corrupt"]
        assert (await predict(http))["version"] == v1


async def test_not_ready_until_a_version_appears(tmp_path: Path) -> None:
    async with server(tmp_path) as service, httpx.AsyncClient(base_url=service.url) as http:
        assert (await http.get("/healthz")).status_code == 200
        assert (await http.get("/readyz")).status_code == 503
        early = await http.post("/v1/predict", json={"records": PROBE})
        assert early.status_code == 503
        version = random_version(tmp_path, step=1, bias=0.5)["version_id"]

        async def ready() -> bool:
            return (await http.get("/readyz")).status_code == 200

        await eventually(ready)
        assert (await predict(http))["version"] == version


def blas_threads() -> dict[str, int]:
    """Threads of each BLAS library loaded now (numpy's among them)."""
    return {i["filepath"]: i["num_threads"] for i in threadpool_info() if i["user_api"] == "blas"}


async def test_the_forward_runs_on_forward_threads_blas_threads(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="forward_threads must be >= 0"):
        ServeConfig(model_dir=str(tmp_path), forward_threads=-1)
    random_version(tmp_path, step=1, bias=0.5)
    with threadpool_limits(2, user_api="blas"):
        before = blas_threads()  # a library loaded later (numba may load scipy's) is not ours
        assert before and set(before.values()) == {2}
        async with server(tmp_path, forward_threads=1) as service, \
                httpx.AsyncClient(base_url=service.url) as http:
            await eventually(lambda: service.versions.active is not None)
            await predict(http)
            assert {blas_threads()[path] for path in before} == {1}
        # the process's setting again once the server closed
        assert {blas_threads()[path] for path in before} == {2}


BAD_BODIES: list[tuple[Any, int, str]] = [
    ({"records": [{**PROBE[0], "C9": "x"}]}, 400, "unknown fields"),
    ({"records": [{k: v for k, v in PROBE[0].items() if k != "C2"}]}, 400, "lacks fields"),
    ({"records": [{**PROBE[0], "I1": "12"}]}, 400, "must be a number"),
    ({"records": [{**PROBE[0], "C1": [1, [2]]}]}, 400, "must be a string"),
    ({"records": ["not an object"]}, 400, "JSON object"),
    ({"records": []}, 400, "no records"),
    ({"records": PROBE, "ids": {}}, 400, "exactly one"),
    ({}, 400, "exactly one"),
    ({"lines": ["a\tb"]}, 400, "JSON records"),
    ({"ids": {"C1": [[1]]}, "dense": [[0.0, 0.0]]}, 400, "exactly the features"),
    ({"ids": {"C1": [[1]], "C2": [[-1]], "C3": [[]]}, "dense": [[0.0, 0.0]]}, 400, "[0, 2**64)"),
    ({"ids": {"C1": [[1]], "C2": [[2]], "C3": [[]]}, "dense": [[0.0]]}, 400, "'dense'"),
    ({"ids": {"C1": [[1]], "C2": [[2]], "C3": [[]]}, "dense": [[0.0, "x"]]}, 400, "'dense'"),
    ({"records": PROBE, "extra": 1}, 422, "invalid"),
    ({"records": "abc"}, 422, "invalid"),
    ([PROBE[0]], 422, "invalid"),
    ({"records": PROBE * 4}, 413, "limit"),
]


async def test_bad_input_gets_a_clear_error_and_changes_nothing(tmp_path: Path) -> None:
    random_version(tmp_path, step=1, bias=0.3)
    async with server(tmp_path, max_request_records=8) as service, \
            httpx.AsyncClient(base_url=service.url) as http:
        before = await predict(http)
        for body, status, message in BAD_BODIES:
            response = await http.post("/v1/predict", json=body)
            assert response.status_code == status, (body, response.text)
            assert message in response.json()["message"], (body, response.text)
        malformed = await http.post("/v1/predict", content=b"{not json",
                                    headers={"content-type": "application/json"})
        assert malformed.status_code == 422
        # JSON has no infinity or NaN, but Python's parser reads Infinity, NaN and 1e400;
        # an integer past float's range is bad input too, not a failure of the server
        for body, message in (
                ({"records": [{**PROBE[0], "I1": math.inf}]}, "'I1' must be a finite number"),
                ({"ids": {"C1": [[1]], "C2": [[2]], "C3": [[]]}, "dense": [[0.0, math.nan]]},
                 "'dense' must be finite numbers, got nan at record 0, value 1"),
                ({"records": [{**PROBE[0], "I1": 10 ** 400}]}, "an integer of 401 digits"),
                ({"ids": {"C1": [[1]], "C2": [[2]], "C3": [[]]}, "dense": [[0.0, 10 ** 400]]},
                 "'dense' must be a list of 2 numbers per record")):
            response = await http.post("/v1/predict", content=json.dumps(body).encode(),
                                       headers={"content-type": "application/json"})
            assert response.status_code == 400 and message in response.json()["message"], \
                response.text
        # a bad request batched with good ones fails alone
        good_and_bad = await asyncio.gather(*(
            http.post("/v1/predict", json=body) for body in
            [{"records": PROBE}, {"records": [{**PROBE[0], "C9": 1}]}, {"records": PROBE}]))
        assert [r.status_code for r in good_and_bad] == [200, 400, 200]
        assert await predict(http) == before
        assert (await http.get("/readyz")).status_code == 200


async def test_grpc_predict_answers_as_rest_does(tmp_path: Path) -> None:
    version = random_version(tmp_path, step=1, bias=0.7)["version_id"]
    async with server(tmp_path, max_request_records=8) as service, \
            httpx.AsyncClient(base_url=service.url) as http:
        rest = await predict(http)
        channel = open_channel(service.address)
        call = channel.unary_unary(f"/{SERVICE_NAME}/Predict")
        try:
            reply = decode(PredictReply, await call(encode(PredictRequest(records=PROBE))))
            assert reply.version == version and reply.step == 1
            np.testing.assert_array_equal(decode_array(reply.probabilities),
                                          np.array(rest["probabilities"], dtype=np.float32))
            for raw, code in [
                    (encode(PredictRequest(records=[{**PROBE[0], "C9": 1}])),
                     grpc.StatusCode.INVALID_ARGUMENT),
                    (encode(PredictRequest(records=PROBE * 4)),
                     grpc.StatusCode.RESOURCE_EXHAUSTED),
                    (encode(PredictRequest()), grpc.StatusCode.INVALID_ARGUMENT),
                    (encode_message({"records": PROBE, "extra": 1}),
                     grpc.StatusCode.INVALID_ARGUMENT),
                    (b"\xc1 not msgpack", grpc.StatusCode.INVALID_ARGUMENT)]:
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await call(raw)
                assert err.value.code() == code, err.value.details()
        finally:
            await channel.close()
        assert await predict(http) == rest
