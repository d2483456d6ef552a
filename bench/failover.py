"""Failover under load: a Sentinel group's primary SIGKILLed while a fleet works.

One primary, two replicas, three Sentinels on 127.0.0.1; ``--workers`` worker
processes and a gateway (``producer serve``), all given the Sentinel URL. A first
batch keeps the fleet busy while jobs/s is measured; then ``producer submit`` sends
``--jobs`` more, and the primary is killed as soon as the submit's first chunks are in.
The submit is then run again with the same ``--batch-id`` (the documented way to make
sure of a batch after a failover: it adds only what is missing). Meanwhile a client
asks the gateway for a chat completion every half second.

Measured: seconds from the kill to the first job ended on the new primary, jobs/s
before and after, the gateway's answers around the kill; checked: every job ends
with exactly one record, none is left running, no process needed a restart.

    .venv/bin/python -m bench.failover [--jobs 5000] [--workers 4] [--warm 2000]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from redis import Redis

from bench.sentinel import SentinelGroup
from producer import Client
from producer.localredis import free_port
from schemas import keys
from schemas.connect import redis_from_url
from worker.dev.tinymodels import TinySpec, ensure_model

OUT = Path(__file__).parent / "out"
KEY = "sk-mlxq-failover"
SPEC = TinySpec(layers=2, hidden=128, intermediate=256, context=4096, seed=21)


def _bin(name: str) -> str:
    return str(Path(sys.executable).with_name(name))


def _env(url: str, model_dirs: Path) -> dict[str, str]:
    return os.environ | {
        "MLXQ_REDIS_URL": url,
        "MLXQ_MODEL_DIRS": str(model_dirs),
        "MLXQ_API_KEYS": KEY,
    }


def _body(model: str, i: int, max_tokens: int) -> dict[str, object]:
    return {
        "model": model,
        "temperature": 0,
        "max_tokens": max_tokens,
        "messages": [{"role": "user", "content": f"job {i}"}],
    }


@dataclass
class Asker:
    """Asks the gateway for a chat completion every ``every`` seconds, in a thread."""

    url: str
    model: str
    every: float = 0.5
    answers: list[tuple[float, float, int]] = field(default_factory=list)  # asked, answered, status
    _stop: threading.Event = field(default_factory=threading.Event)

    def ask(self) -> int:
        body = {
            "model": self.model,
            "max_tokens": 3,
            "temperature": 0,
            "messages": [{"role": "user", "content": "are you there"}],
        }
        req = urllib.request.Request(
            f"{self.url}/v1/chat/completions",
            data=json.dumps(body).encode(),
            headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"},
        )
        try:
            with urllib.request.urlopen(req, timeout=60) as r:
                return r.status
        except urllib.error.HTTPError as e:
            return e.code
        except OSError:
            return 0

    def run(self) -> None:
        while not self._stop.is_set():
            asked = time.monotonic()
            status = self.ask()
            self.answers.append((asked, time.monotonic(), status))
            self._stop.wait(self.every)

    def start(self) -> threading.Thread:
        t = threading.Thread(target=self.run, daemon=True)
        t.start()
        return t

    def stop(self, t: threading.Thread) -> None:
        self._stop.set()
        t.join(90)


def _wait(pred: Callable[[], bool], timeout: float, every: float = 0.05) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise TimeoutError(f"not within {timeout} s")
        time.sleep(every)


def _rate(samples: list[tuple[float, int]], start: float, end: float) -> float:
    """Jobs/s between ``start`` and ``end`` from (time, jobs done) samples."""
    inside = [(t, d) for t, d in samples if start <= t <= end]
    if len(inside) < 2 or inside[-1][0] == inside[0][0]:
        return 0.0
    return (inside[-1][1] - inside[0][1]) / (inside[-1][0] - inside[0][0])


def run(
    root: Path,
    model: str,
    model_dirs: Path,
    *,
    jobs: int = 5000,
    warm: int = 2000,
    workers: int = 4,
    lease: int = 3,
    max_tokens: int = 4,
    window_s: float = 10.0,
    timeout_s: float = 900.0,
) -> dict[str, object]:
    """Run the scenario; the report (see the module's docstring)."""
    group = SentinelGroup(root / "sentinel")
    procs: list[subprocess.Popen[bytes]] = []
    logs = root / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    env = _env(group.url, model_dirs)
    try:
        conn = redis_from_url(group.url)
        client = Client(connection=conn)
        first = client.submit({f"warm-{i}": _body(model, i, max_tokens) for i in range(warm)})
        for i in range(workers):
            with open(logs / f"worker{i}.log", "w") as log:
                args = ["--name", f"fo{i}", "--lease-seconds", str(lease), "--max-crashes", "5"]
                procs.append(subprocess.Popen([_bin("worker"), *args], env=env, stderr=log))
        port = free_port()
        with open(logs / "gateway.log", "w") as log:
            gateway = subprocess.Popen(
                [_bin("producer"), "serve", "--port", str(port)], env=env, stderr=log
            )
        procs.append(gateway)
        asker = Asker(f"http://127.0.0.1:{port}", model)
        _wait(lambda: asker.ask() == 200, timeout=120, every=0.2)

        lines = root / "jobs.jsonl"
        with lines.open("w") as f:
            for i in range(jobs):
                line = {"custom_id": f"job-{i}", "method": "POST", "url": "/v1/chat/completions"}
                f.write(json.dumps(line | {"body": _body(model, i, max_tokens)}) + "\n")
        batch_id = "failover_" + os.urandom(6).hex()
        both = (first.batch_id, batch_id)
        submit = [_bin("producer"), "submit", str(lines), "--batch-id", batch_id, "--json"]

        samples: list[tuple[float, int]] = []

        def done() -> int:
            meta = [conn.hmget(keys.batch_key(b), "succeeded", "failed") for b in both]
            return sum(int(v or 0) for m in meta for v in m)

        thread = asker.start()
        start = time.monotonic()
        _wait(lambda: done() > 0, timeout=120)
        t0 = time.monotonic()
        while time.monotonic() - t0 < window_s and (not samples or samples[-1][1] < warm * 0.8):
            samples.append((time.monotonic(), done()))
            time.sleep(0.25)

        # The second batch goes in; the primary dies once its first chunks are in.
        sub = subprocess.Popen(submit, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        batch_key = keys.batch_key(batch_id)
        old = group.primary.port
        direct = Redis(port=old)
        _wait(lambda: int(direct.hget(batch_key, "total") or 0) > 0, timeout=60, every=0.0005)
        at_kill = int(direct.hget(batch_key, "total") or 0)
        samples.append((time.monotonic(), done()))
        group.kill_primary()
        killed, killed_wall = time.monotonic(), time.time()
        _, err = sub.communicate(timeout=300)
        first_submit = {"exit": sub.returncode, "stderr_tail": err.decode()[-400:]}

        def last_done_at() -> float:
            got = [conn.hget(keys.batch_key(b), "last_done_at") for b in both]
            return max(float(g) for g in got if g) if any(got) else 0.0

        # A job ended on the new primary: a record written after the kill.
        _wait(lambda: last_done_at() > killed_wall, timeout=120, every=0.05)
        first_job_after = time.monotonic() - killed
        resumed = subprocess.run(submit, env=env, capture_output=True, timeout=300)
        resume = json.loads(resumed.stdout) if resumed.returncode == 0 else {}
        back = time.monotonic()
        while time.monotonic() - back < window_s:
            samples.append((time.monotonic(), done()))
            time.sleep(0.25)
        _wait(
            lambda: all(client.status(b).finished for b in both),
            timeout=timeout_s,
            every=0.5,
        )
        finished = time.monotonic()
        asker.stop(thread)

        ids = [j.decode() for b in both for j in conn.lrange(keys.batch_jobs_key(b), 0, -1)]
        records = [json.loads(r) for r in conn.mget([keys.result_key(j) for j in ids]) if r]
        announced = [j.decode() for b in both for j in conn.lrange(keys.batch_done_key(b), 0, -1)]
        before = [s for _, t, s in asker.answers if t < killed]
        after = [(t - killed, s) for _, t, s in asker.answers if t >= killed]
        ok_after = [t for t, s in after if s == 200]  # answered after the kill
        return {
            "jobs": warm + jobs,
            "workers": workers,
            "lease_s": lease,
            "new_primary": group.primary_port() != old,
            "submit_total_at_kill": at_kill,
            "submit_first_run": first_submit,
            "submit_resumed": {
                "exit": resumed.returncode,
                "submitted": resume.get("submitted"),
                "already_present": resume.get("already_present"),
            },
            "first_job_after_kill_s": round(first_job_after, 2),
            "jobs_per_s_before": round(_rate(samples, t0, killed), 1),
            "jobs_per_s_after": round(_rate(samples, back, back + window_s), 1),
            "gateway_before": {"asked": len(before), "ok": before.count(200)},
            "gateway_after": {
                "asked": len(after),
                "ok": len(ok_after),
                "first_ok_answered_s": round(ok_after[0], 2) if ok_after else None,
                "errors": sorted({s for _, s in after if s != 200}),
            },
            "jobs_in_batches": len(ids),
            "jobs_with_record": len(records),
            "succeeded": sum(r["status"] == "succeeded" for r in records),
            "records_announced_twice": len(announced) - len(set(announced)),
            "jobs_lost": warm + jobs - len(records),
            "left_running": int(conn.hlen(keys.RUNNING)),
            "processes_exited": [p.args[0] for p in procs if p.poll() is not None],
            "seconds": round(finished - start, 1),
        }
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()
        group.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--jobs", type=int, default=5000, help="the batch submitted at the kill")
    ap.add_argument("--warm", type=int, default=2000, help="the batch that runs before it")
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--lease", type=int, default=3)
    ap.add_argument("--window", type=float, default=10.0, help="seconds jobs/s is measured")
    args = ap.parse_args()
    OUT.mkdir(exist_ok=True)
    model = ensure_model(OUT / "soak-model", SPEC)
    with tempfile.TemporaryDirectory() as tmp:
        report = run(
            Path(tmp),
            str(model),
            OUT,
            jobs=args.jobs,
            warm=args.warm,
            workers=args.workers,
            lease=args.lease,
            window_s=args.window,
        )
    (OUT / "failover.json").write_text(json.dumps(report, indent=1))
    print(json.dumps(report, indent=1))
    bad = report["jobs_lost"] or report["records_announced_twice"] or report["left_running"]
    sys.exit(1 if bad or report["processes_exited"] else 0)


if __name__ == "__main__":
    main()
