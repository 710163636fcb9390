"""``persimmon bench train`` at tiny size: every figure is there and sane."""

from __future__ import annotations

import math
import os
import socket
import statistics
import threading
import time

import pytest

from bench.netem import LatencyProxy
from bench.peers import torchrec_available
from bench.train import RUNS, hybrid_ceiling, median_run, paired_ratios, print_table, rtt_row, run
from services.common.errors import ConfigError


def test_bench_train_reports_every_ratio_from_its_own_runs() -> None:
    result = run(rows=4096, batch_size=512, repeats=1)
    runs = result["runs"]
    assert set(runs) == set(RUNS) - (set() if torchrec_available() else {"torchrec"})
    for r in runs.values():
        assert r["samples_per_s"] > 0 and 0.5 < r["auc"] <= 1.0
        assert r["samples_per_s_runs"] == [r["samples_per_s"]]
        assert math.isclose(r["ms_per_step"], 1e3 * 512 / r["samples_per_s"])
    speed = {key: r["samples_per_s"] for key, r in runs.items()}
    assert math.isclose(result["vs_local"], speed["hybrid"] / speed["local"])
    assert math.isclose(result["hybrid_vs_sync"], speed["hybrid"] / speed["sync"])
    assert math.isclose(result["embedded_vs_processes"], speed["sync_embedded"] / speed["sync"])
    for key in ("default", "sync_embedded", "hybrid_embedded", "hybrid", "hybrid_hot",
                "hybrid_replica", "sync"):
        assert 0 < runs[key]["step_cpu_ms"] <= 1.2 * runs[key]["step_wall_ms"]
        assert runs[key]["batch_wait_ms"] >= 0
        phases = runs[key]["step_phases"]  # the step, split: its phases add up to it
        assert list(phases) == ["read_hot", "pool", "forward", "backward", "dense_update",
                                "apply_hot"]
        walls = [t["wall_ms"] for t in phases.values()]
        assert min(walls) >= 0 and 0.8 * runs[key]["step_wall_ms"] <= sum(walls) \
            <= runs[key]["step_wall_ms"]
        cpu = runs[key]["cpu_ms_per_step"]
        assert cpu["worker"] >= runs[key]["step_cpu_ms"] * 0.9
        # the loop's thread planned every batch (its CPU is the worker's, measured in it)
        assert 0 < runs[key]["loop_cpu_ms"] <= cpu["worker"] - 0.9 * runs[key]["step_cpu_ms"]
    for key in ("hybrid", "hybrid_hot", "hybrid_replica", "sync"):  # the shards did work, held memory
        assert runs[key]["cpu_ms_per_step"]["ps"] > 0 and runs[key]["ps_peak_rss_mb"] > 10
    for key in ("default", "sync_embedded", "hybrid_embedded"):  # the shards in this process
        assert runs[key]["cpu_ms_per_step"]["ps"] == 0.0
        # a 16-float row and its Adagrad state, the index and the arena's slack
        assert runs[key]["bytes_per_row"] >= 2 * 16 * 4
    assert result["peak_rss_mb"] > 50  # torch alone holds more
    floor = max(sum(runs["hybrid"]["cpu_ms_per_step"].values()) / result["cores"],
                runs["hybrid"]["step_cpu_ms"])
    assert math.isclose(result["hybrid_vs_sync_ceiling"], runs["sync"]["ms_per_step"] / floor)
    with_torchrec = int(torchrec_available())
    assert {k: len(v) for k, v in result["ratios_per_repeat"].items()} == {
        "vs_local": 1, "vs_torch": 1, "vs_torchrec": with_torchrec,
        "default_vs_torchrec": with_torchrec, "sync_vs_torchrec": with_torchrec,
        "embedded_vs_processes": 1, "hybrid_vs_sync": 1, "hot_vs_sync": 1, "replica_vs_sync": 1,
        "hybrid_vs_sync_ceiling": 1}
    fastest = max(speed[k] for k in ("default", "sync_embedded", "hybrid_embedded", "hybrid",
                                     "hybrid_hot", "hybrid_replica", "sync"))
    assert math.isclose(result["vs_torch"], fastest / speed["torch"])
    assert math.isclose(result["hot_vs_sync"], speed["hybrid_hot"] / speed["sync"])
    assert math.isclose(result["replica_vs_sync"], speed["hybrid_replica"] / speed["sync"])
    for key in ("sync", "sync_embedded"):
        assert runs[key]["staleness_max"] == 0
    for key in ("default", "hybrid_hot", "hybrid_replica", "hybrid", "hybrid_embedded"):  # rest
        assert runs[key]["staleness_max"] <= 7  # window 8 at most: S - 1
    assert result["rtt"] == []  # no --rtt-ms


def test_only_rtt_runs_the_remote_path_behind_the_proxy_and_names_the_machine(capsys) -> None:
    """The ways asked for alone (hybrid S=8 left out here), each paired with sync."""
    result = run(rows=2048, batch_size=512, repeats=1, rtt_ms=[0.0], only_rtt=True,
                 hot_staleness=2, device="cpu", rtt_ways=["hybrid_hot", "hybrid_replica", "sync"])
    assert result["runs"] == {} and result["hot_staleness"] == 2
    [row] = result["rtt"]
    assert row["rtt_ms"] == 0.0 and row["hot_vs_sync"] > 0 and 0.3 < row["auc_hot"] <= 1
    assert row["runs"]["hybrid_replica"]["step_wall_ms"] > 0
    assert set(row["runs"]) == {"hybrid_hot", "hybrid_replica", "sync"}
    assert row["hybrid_vs_sync"] is None and row["auc_hybrid"] is None
    assert math.isclose(row["replica_vs_sync"], row["samples_per_s_hybrid_replica"]
                        / row["samples_per_s_sync"])
    capsys.readouterr()
    print_table(result)
    out = " ".join(capsys.readouterr().out.split())  # as read, whatever the console's width
    assert "waiting for rows" in out  # where the replica's step went
    assert "replica_vs_sync" in out and "hybrid_vs_sync" not in out
    assert result["machine"]["device"] == "cpu" and result["machine"]["cpu"]
    with pytest.raises(ConfigError, match="hot_staleness"):  # the bound reaches the trainer
        run(rows=2048, batch_size=512, repeats=1, rtt_ms=[0.0], only_rtt=True, hot_staleness=0)
    for ways in (["hybrid_replica"], ["sync", "hybrid_fast"]):  # no sync to pair; no such way
        with pytest.raises(ValueError, match="rtt_ways"):
            run(rows=2048, batch_size=512, repeats=1, rtt_ms=[0.0], only_rtt=True, rtt_ways=ways)


def testrtt_rows_pair_the_runs_behind_the_proxy() -> None:
    def runs(*pairs: tuple[float, float]) -> list[dict]:
        return [{"samples_per_s": v, "auc": a, "measured_rtt_ms": 2.2} for v, a in pairs]

    row = rtt_row(2.0, {"hybrid": runs((150, 0.80), (60, 0.82)),
                         "hybrid_hot": runs((110, 0.83), (50, 0.84)),
                         "hybrid_replica": runs((140, 0.84), (52, 0.85)),
                         "sync": runs((100, 0.85), (40, 0.85))})
    assert row["rtt_ms"] == 2.0 and row["measured_rtt_ms"] == 2.2
    assert row["hybrid_vs_sync"] == statistics.median([1.5, 1.5])  # paired within a repeat
    assert row["hot_vs_sync"] == statistics.median([1.1, 1.25])
    assert row["replica_vs_sync"] == statistics.median([1.4, 1.3]) and row["auc_replica"] == 0.845
    assert row["auc_hybrid"] == 0.81 and row["auc_hot"] == 0.835 and row["auc_sync"] == 0.85
    assert row["runs"]["hybrid"]["samples_per_s"] == 60  # the lower middle of two


def test_median_run_is_the_middle_by_samples_per_s() -> None:
    runs = [{"samples_per_s": v, "tag": t} for v, t in ((3.0, "a"), (1.0, "b"), (2.0, "c"))]
    assert median_run(runs) == {"samples_per_s": 2.0, "tag": "c",
                                 "samples_per_s_runs": [3.0, 1.0, 2.0]}
    assert median_run(runs[:2])["tag"] == "b"  # the lower middle of two


def test_ceiling_is_sync_step_over_the_larger_floor() -> None:
    hybrid = {"cpu_ms_per_step": {"worker": 10.0, "ps": 4.0}, "step_cpu_ms": 6.0}
    assert math.isclose(hybrid_ceiling(hybrid, 12.0, cores=2), 12.0 / 7.0)  # CPU-bound
    assert math.isclose(hybrid_ceiling(hybrid, 12.0, cores=4), 12.0 / 6.0)  # compute-bound
    assert hybrid_ceiling({**hybrid, "cpu_ms_per_step": {"worker": 10.0, "ps": None}},
                          12.0, cores=2) is None


def test_ratios_pair_the_runs_of_each_repeat() -> None:
    """Each ratio divides runs of the same repeat; the drift between repeats cancels out."""
    def runs(*speeds: float) -> list[dict]:
        return [{"samples_per_s": v, "step_cpu_ms": 1.0,
                 "cpu_ms_per_step": {"worker": 2.0, "ps": 2.0}} for v in speeds]

    every = {"local": runs(100, 50), "hybrid": runs(150, 75), "sync": runs(100, 50),
             "sync_embedded": runs(120, 40), "hybrid_embedded": runs(1, 1), "default": runs(1, 1),
             "hybrid_hot": runs(110, 60), "hybrid_replica": runs(140, 65), "torch": runs(300, 50)}
    ratios = paired_ratios(every, batch_size=1000, cores=2)
    assert ratios["vs_local"] == [1.5, 1.5] and ratios["hybrid_vs_sync"] == [1.5, 1.5]
    assert ratios["embedded_vs_processes"] == [1.2, 0.8]
    assert ratios["vs_torch"] == [0.5, 1.5] and ratios["vs_torchrec"] == []  # not run
    assert ratios["default_vs_torchrec"] == [] and ratios["sync_vs_torchrec"] == []
    assert ratios["hot_vs_sync"] == [1.1, 1.2] and ratios["replica_vs_sync"] == [1.4, 1.3]
    assert ratios["hybrid_vs_sync_ceiling"] == [10_000 / 2, 20_000 / 2]  # sync ms / CPU floor


def _echo_server() -> socket.socket:
    listener = socket.create_server(("127.0.0.1", 0))

    def serve() -> None:
        client, _ = listener.accept()
        with client:
            while data := client.recv(65536):
                client.sendall(data)

    threading.Thread(target=serve, daemon=True).start()
    return listener


def test_latency_proxy_delays_each_round_trip_and_keeps_every_byte() -> None:
    listener = _echo_server()
    target = f"127.0.0.1:{listener.getsockname()[1]}"
    payload = os.urandom(300_000)
    with LatencyProxy([target], rtt_ms=20.0) as proxy:
        host, port = proxy.addresses[0].rsplit(":", 1)
        with socket.create_connection((host, int(port)), timeout=10) as s:
            started = time.perf_counter()
            s.sendall(b"ping")
            assert s.recv(4) == b"ping"
            assert time.perf_counter() - started >= 0.019  # both directions were held
            s.sendall(payload)
            got = bytearray()
            while len(got) < len(payload):
                got += s.recv(65536)
        assert bytes(got) == payload  # in order, nothing lost or repeated
        assert 18 < proxy.measured_rtt_ms() < 200
    listener.close()
    for bad in ({"rtt_ms": -1.0}, {"rtt_ms": 1.0, "bandwidth_mbps": 0.0}):
        with pytest.raises(ValueError):
            LatencyProxy([target], **bad)
