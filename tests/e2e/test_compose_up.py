"""``docker compose up``, actually run: compose.yaml with compose.local.yaml, under podman.

The images are built from Debian's packages (deploy/local/build-images.sh, reusing podman's
layer cache), the Compose v2 binary of the dev extras drives ``podman system service``'s
Docker API, and the check: every healthcheck passes, the job trains and reports its progress
through the admin REST API (with the token), a PS shard SIGKILLed mid-job comes back by its
restart policy from its checkpoint and write-ahead log with every acknowledged update, the job
finishes, a model version is exported and served, Prometheus has scraped the shards, and
``down -v`` leaves nothing. Each phase's seconds are printed as one JSON line (``build_s``,
``compose_up_s``, ``first_step_s``, ``recovery_s``, ``predict_ok``, ...).

Needs root, podman, runc and debootstrap (.ci/run installs them) and the loopback ports that
compose.yaml publishes. The killed shard is SIGKILLed by its process id, a crash: ``podman
kill`` (4.3) records a stop by the user, after which podman applies no restart policy.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest

ROOT = Path(__file__).resolve().parents[2]
PROJECT = "persimmon-e2e"
PORTS = (8071, 8075, 8090, 50071, 9090)  # what compose.yaml publishes on 127.0.0.1
ROWS = "synthetic:2097152"  # compose.local.yaml's loader source
PROBE_ROUNDS = 200

# Run inside the serve container (on the compose network, with the token in its environment):
# a counting table on both shards; `push` sends PROBE_ROUNDS +1 updates to every id, one round
# every 50 ms, retrying through a shard's outage, and prints "acked N" as each is acknowledged;
# `count` reads the rows back.
PROBE = """
import asyncio, sys
import numpy as np
from clients.admin_client import AdminClient
from clients.ps_client import PSClient
IDS = np.arange(64, dtype=np.uint64)
SHARDS = ["ps-0:50051", "ps-1:50051"]
TABLE = {"name": "probe", "dim": 1, "initializer": "zeros", "optimizer": {"kind": "sgd", "lr": 1.0}}
async def main(mode, rounds):
    if mode == "push":
        for admin in ("http://ps-0:8081", "http://ps-1:8081"):
            async with AdminClient(admin) as client:
                await client.create_table(TABLE)
        async with PSClient(SHARDS, retry_s=120) as ps:
            for i in range(1, rounds + 1):
                await ps.push("probe", IDS, np.full((IDS.size, 1), -1.0, np.float32))
                print("acked", i, flush=True)
                await asyncio.sleep(0.05)
    else:
        async with PSClient(SHARDS, retry_s=60) as ps:
            rows = await ps.lookup("probe", IDS)
        print(" ".join(str(c) for c in rows[:, 0].round().astype(int).tolist()))
asyncio.run(main(sys.argv[1], int(sys.argv[2])))
"""

RECORD = {"I1": 1.0, "I2": 0.5, "I3": None, "I4": 2.0, "C1": "a", "C2": "b", "C3": None,
          "C4": "x", "C5": "y", "C6": "z", "C7": "q", "C8": "w"}


class PhaseFailed(AssertionError):
    pass


def run(cmd: list[str], *, timeout: float, env: dict[str, str] | None = None,
        check: bool = True, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(cmd, cwd=ROOT, env=env, input=stdin, capture_output=True, text=True,
                          timeout=timeout)
    if check and proc.returncode != 0:
        raise PhaseFailed(f"{' '.join(cmd[:4])} ... exited {proc.returncode}:\n"
                          f"{(proc.stdout + proc.stderr)[-3000:]}")
    return proc


def poll(what: str, probe: Callable[[], Any], timeout: float, interval: float = 1.0) -> Any:
    """``probe()``'s first truthy value; a PhaseFailed naming ``what`` after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while True:
        value = probe()
        if value:
            return value
        if time.monotonic() > deadline:
            raise PhaseFailed(f"{what}: not within {timeout:.0f}s (last: {value!r})")
        time.sleep(interval)


class Stack:
    """The compose project under test, driven through the Compose v2 binary itself (its
    Python wrapper exits 0 whatever the binary returned)."""

    def __init__(self, socket_path: Path, env_file: Path) -> None:
        import compose

        self.binary = str(Path(compose.__file__).parent / "docker-compose")
        self.env = {**os.environ, "DOCKER_HOST": f"unix://{socket_path}"}
        self.env_file = env_file
        self.token = env_file.read_text().split("PERSIMMON_TOKEN=", 1)[1].strip()
        self.http = httpx.Client(timeout=5.0,
                                 headers={"Authorization": f"Bearer {self.token}"})

    def compose(self, *args: str, timeout: float = 300, check: bool = True) -> str:
        cmd = [self.binary, "--env-file", str(self.env_file), "-p", PROJECT,
               "-f", "compose.yaml", "-f", "compose.local.yaml", *args]
        return run(cmd, timeout=timeout, env=self.env, check=check).stdout

    def container(self, service: str) -> str:
        return f"{PROJECT}-{service}-1"

    def inspect(self, service: str) -> dict[str, Any]:
        out = run(["podman", "inspect", self.container(service)], timeout=30).stdout
        return json.loads(out)[0]

    def get(self, url: str) -> Any:
        """The JSON of a 200 answer, None for anything else (down, not ready, an error)."""
        try:
            reply = self.http.get(url)
        except httpx.HTTPError:
            return None
        return reply.json() if reply.status_code == 200 else None

    def probe(self, mode: str) -> subprocess.Popen[str]:
        proc = subprocess.Popen(["podman", "exec", "-i", self.container("serve"), "python", "-",
                                 mode, str(PROBE_ROUNDS)], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        assert proc.stdin is not None
        proc.stdin.write(PROBE)
        proc.stdin.close()
        return proc

    def probe_counts(self) -> list[int]:
        proc = self.probe("count")
        out = proc.stdout.read() if proc.stdout else ""
        if proc.wait(timeout=120) != 0:
            raise PhaseFailed(f"the probe's lookup exited {proc.returncode}:\n{out[-2000:]}")
        return [int(c) for c in out.strip().splitlines()[-1].split()]

    def last_logs(self, lines: int = 20) -> str:
        names = run(["podman", "ps", "-a", "--format", "{{.Names}}", "--filter",
                     f"label=com.docker.compose.project={PROJECT}"], timeout=30,
                    check=False).stdout.split()
        parts = []
        for name in sorted(names):
            state = run(["podman", "inspect", "--format", "{{.State.Status}}, exit "
                         "{{.State.ExitCode}}, restarts {{.RestartCount}}", name], timeout=30,
                        check=False).stdout.strip()
            log = run(["podman", "logs", "--tail", str(lines), name], timeout=30, check=False)
            parts.append(f"--- {name} ({state})\n{(log.stdout + log.stderr).rstrip()}")
        return "\n".join(parts)


@contextmanager
def phase(name: str, times: dict[str, Any], stack: Stack | None = None) -> Iterator[None]:
    started = time.monotonic()
    try:
        yield
    except Exception as exc:
        logs = stack.last_logs() if stack else ""
        raise PhaseFailed(f"phase {name} failed: {exc}\ncontainers' last log lines:\n{logs}") \
            from exc
    times[f"{name}_s"] = round(time.monotonic() - started, 1)


def _needs() -> str | None:
    missing = [tool for tool in ("podman", "runc", "debootstrap") if not shutil.which(tool)]
    if missing:
        return f"needs {', '.join(missing)} (apt-get install -y podman runc debootstrap)"
    if os.geteuid() != 0:
        return "needs root (debootstrap and podman's rootful storage)"
    taken = []
    for port in PORTS:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                taken.append(port)
    return f"loopback ports {taken} are taken (compose.yaml publishes them)" if taken else None


@pytest.fixture
def stack(tmp_path: Path) -> Iterator[Stack]:
    reason = _needs()
    if reason:  # a check that cannot run fails: it must run, never skip
        pytest.fail(f"the compose check cannot run here: {reason}")
    env_file = tmp_path / ".env"
    run([sys.executable, "-c", "from services.cli import main; main()", "token",
         "--env-file", str(env_file)], timeout=60)
    socket_path = tmp_path / "podman.sock"
    service = subprocess.Popen(["podman", "system", "service", "--time=0",
                                f"unix://{socket_path}"],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    checks = subprocess.Popen([str(ROOT / "deploy/local/healthchecks.sh")],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    stack = Stack(socket_path, env_file)
    try:
        poll("podman system service's socket", socket_path.exists, 30, 0.1)
        yield stack
    finally:
        if socket_path.exists():  # whatever happened, leave no container nor volume behind
            stack.compose("down", "-v", "--timeout", "5", timeout=120, check=False)
        stack.http.close()
        for proc in (checks, service):
            proc.terminate()
            proc.wait(timeout=30)


def _kill_shard(stack: Stack) -> None:
    """SIGKILL ps-1's process: a crash."""
    state = stack.inspect("ps-1")["State"]
    if not state["Running"] or state["Pid"] <= 1:
        raise PhaseFailed(f"ps-1 is not running before the kill: {state}")
    os.kill(state["Pid"], signal.SIGKILL)


def _back_and_healthy(stack: Stack) -> bool:
    info = stack.inspect("ps-1")
    return bool(info["RestartCount"] >= 1 and info["State"]["Running"]
                and info["State"]["Health"]["Status"] == "healthy")


def _recovered_from(stack: Stack) -> str:
    """The last "recovered from the write-ahead log (checkpoint C, then {...})" of ps-1."""
    log = run(["podman", "logs", stack.container("ps-1")], timeout=30)
    lines = [line for line in (log.stdout + log.stderr).splitlines()
             if "recovered from the write-ahead log" in line]
    if len(lines) < 2:
        raise PhaseFailed(f"ps-1 logged {len(lines)} recoveries, expected its start and restart")
    return lines[-1].split("INFO persimmon.ps: ", 1)[-1]


def _exited(stack: Stack, service: str) -> dict[str, Any] | None:
    state = stack.inspect(service)["State"]
    return state if state["Status"] == "exited" else None


def _config(*files: str) -> dict[str, Any]:
    """The Compose v2 binary's model of ``files`` (``config``: no engine needed)."""
    import compose

    cmd = [str(Path(compose.__file__).parent / "docker-compose")]
    for file in files:
        cmd += ["-f", file]
    env = {**os.environ, "PERSIMMON_TOKEN": "config-check"}
    return json.loads(run([*cmd, "config", "--format", "json"], timeout=60, env=env).stdout)


def test_the_local_override_keeps_compose_yaml_s_services() -> None:
    """compose.local.yaml changes images, runtime, ulimits, the loader's source and Kafka
    dependency and the healthchecks' spelling only: every other service setting, every
    volume, each healthcheck's URL, timing and retries and each restart policy are compose.yaml's."""
    shipped, local = _config("compose.yaml"), _config("compose.yaml", "compose.local.yaml")
    assert set(local["services"]) == set(shipped["services"]) - {"kafka", "grafana"}
    assert local["volumes"] == shipped["volumes"]
    changed = {"image", "build", "pull_policy", "runtime", "ulimits", "healthcheck"}
    for name, service in local["services"].items():
        mine, theirs = dict(service), dict(shipped["services"][name])
        assert mine["runtime"] == "runc", name
        assert mine["ulimits"] == {"nofile": {"soft": 1024, "hard": 1024},
                                   "nproc": {"soft": 1024, "hard": 1024}}, name
        if name == "loader":
            assert theirs.pop("depends_on").keys() - mine.pop("depends_on").keys() == {"kafka"}
            assert re.sub(r"synthetic:\d+", "", json.dumps(mine.pop("command"))) == \
                re.sub(r"synthetic:\d+", "", json.dumps(theirs.pop("command")))
        for key in changed:
            if key == "healthcheck" and key in theirs:
                check, shipped_check = mine[key], theirs[key]
                assert {k: v for k, v in check.items() if k != "test"} == \
                    {k: v for k, v in shipped_check.items() if k != "test"}, name
                url = re.compile(r"http://[^']+")
                assert url.findall(" ".join(check["test"])) == \
                    url.findall(" ".join(shipped_check["test"])), name
            mine.pop(key, None)
            theirs.pop(key, None)
        assert mine == theirs, name


PROGRESS = "http://127.0.0.1:8075/v1/progress"  # worker rank 0's admin API
JOBS = "http://127.0.0.1:8071/v1/job/checkpoints"  # the job API


def _step(stack: Stack) -> int:
    return (stack.get(PROGRESS) or {}).get("step") or 0


def _up(stack: Stack) -> None:
    stack.compose("up", "-d", "--wait", "--wait-timeout", "300", timeout=360)
    for service in ("redis", "ps-0", "ps-1", "loader", "serve"):
        status = stack.inspect(service)["State"]["Health"]["Status"]
        if status != "healthy":
            raise PhaseFailed(f"{service} is {status} after up --wait")


def _job_api(stack: Stack) -> None:
    anonymous = httpx.post(JOBS, timeout=5).status_code  # (its reads are open: the live page)
    if anonymous not in (401, 403):
        raise PhaseFailed(f"the job API took a checkpoint request without the token: {anonymous}")
    poll("rank 0's job checkpoint (every 200 steps)", lambda: stack.get(JOBS), 300)


def _kill_mid_job(stack: Stack, times: dict[str, Any]) -> tuple[subprocess.Popen[str], list[str]]:
    """Probe pushes streaming, ps-1 SIGKILLed, back from a job checkpoint and its log."""
    pusher, acked = stack.probe("push"), []
    reader = threading.Thread(target=lambda: acked.extend(pusher.stdout or []), daemon=True)
    reader.start()
    poll("the probe's first 20 acknowledged pushes", lambda: len(acked) >= 20, 120, 0.05)
    times["kill_step"] = kill_step = _step(stack)
    _kill_shard(stack)
    times["acked_before_kill"] = len(acked)
    listed = json.dumps(stack.get(JOBS))
    poll("ps-1 restarted and healthy", lambda: _back_and_healthy(stack), 180, 0.5)
    poll("a training step after the restart",
         lambda: _step(stack) > kill_step or _exited(stack, "worker-0"), 300, 0.5)
    times["ps1_recovery"] = recovery = _recovered_from(stack)
    found = re.search(r"checkpoint (\S+), then \{'pushes': (\d+)", recovery)
    if not found or found.group(1) not in listed or int(found.group(2)) == 0:
        raise PhaseFailed(f"ps-1 did not come back from a job checkpoint and its log: "
                          f"{recovery!r}; job checkpoints {listed}")
    return pusher, acked


def _finish_job(stack: Stack, times: dict[str, Any], pusher: subprocess.Popen[str],
                acked: list[str]) -> None:
    """The probe's pushes all acknowledged, the workers done, every push applied once."""
    if pusher.wait(timeout=300) != 0:
        raise PhaseFailed(f"the probe's pushes exited {pusher.returncode}: {acked[-5:]}")
    rounds = sum(1 for line in acked if line.startswith("acked "))
    for worker in ("worker-0", "worker-1"):
        state = poll(f"{worker} finishing", lambda w=worker: _exited(stack, w), 600)
        if state["ExitCode"] != 0:
            raise PhaseFailed(f"{worker} exited {state['ExitCode']}")
    counts = stack.probe_counts()
    times["acked_updates_lost"] = sum(max(rounds - c, 0) for c in counts)
    times["applied_twice"] = sum(max(c - rounds, 0) for c in counts)
    if rounds != PROBE_ROUNDS or times["acked_updates_lost"] or times["applied_twice"]:
        raise PhaseFailed(f"{rounds} pushes acknowledged, probe rows {counts}")


def _export(stack: Stack) -> str:
    out = stack.compose("run", "--rm", "--no-deps", "worker-1", "export",
                        "--job-checkpoint", "latest", "--checkpoint-dir", "/checkpoints",
                        "--out", "/checkpoints/models", "--features", ROWS,
                        "--base", "latest", "--keep", "5")
    found = re.search(r'"version_id": "([^"]+)"', out)
    if not found:
        raise PhaseFailed(f"export printed no version_id:\n{out[-2000:]}")
    return found.group(1)


def _predict(stack: Stack, times: dict[str, Any], version: str) -> None:
    active = "http://127.0.0.1:8090/v1/versions/active"
    poll(f"serve on version {version}",
         lambda: version in json.dumps(stack.get(active) or {}), 60, 0.5)
    asked = time.monotonic()  # the first call compiles the feature hashing (numba)
    reply = stack.http.post("http://127.0.0.1:8090/v1/predict", json={"records": [RECORD]},
                            timeout=180)
    times["first_predict_s"] = round(time.monotonic() - asked, 1)
    body = reply.json()
    p = body.get("probabilities", [math.nan])[0]
    times["predict_ok"] = bool(reply.status_code == 200 and body["version"] == version
                               and 0.0 < p < 1.0)
    if not times["predict_ok"]:
        raise PhaseFailed(f"predict answered {reply.status_code}: {body}")


def _prometheus_pushes(stack: Stack) -> float:
    query = "http://127.0.0.1:9090/api/v1/query?query=sum(persimmon_ps_table_pushes_total)"
    result = (stack.get(query) or {}).get("data", {}).get("result", [])
    return float(result[0]["value"][1]) if result else 0.0


def _down(stack: Stack) -> None:
    stack.compose("down", "-v", "--timeout", "10")
    label = f"label=com.docker.compose.project={PROJECT}"
    left = run(["podman", "ps", "-aq", "--filter", label], timeout=30).stdout.split()
    volumes = run(["podman", "volume", "ls", "-q", "--filter", label], timeout=30).stdout.split()
    if left or volumes:
        raise PhaseFailed(f"down -v left containers {left} and volumes {volumes}")


@pytest.mark.timeout(1500)
def test_compose_up_trains_recovers_and_serves(stack: Stack) -> None:
    times: dict[str, Any] = {}
    started = time.monotonic()
    with phase("build", times):
        run([str(ROOT / "deploy/local/build-images.sh")], timeout=1200)
    with phase("compose_up", times, stack):
        _up(stack)
    with phase("first_step", times, stack):
        poll("worker-0's first step", lambda: _step(stack), 180, 0.2)
    with phase("job_api", times, stack):
        _job_api(stack)
    with phase("recovery", times, stack):
        pusher, acked = _kill_mid_job(stack, times)
    with phase("job", times, stack):
        _finish_job(stack, times, pusher, acked)
    with phase("export", times, stack):
        version = _export(stack)
    with phase("predict", times, stack):
        _predict(stack, times, version)
    with phase("prometheus", times, stack):
        times["prometheus_ps_pushes"] = poll("Prometheus' scrape of the shards' pushes",
                                             lambda: _prometheus_pushes(stack), 60)
    with phase("down", times, stack):
        _down(stack)
    times["total_s"] = round(time.monotonic() - started, 1)
    print("compose_up_phases " + json.dumps(times))
