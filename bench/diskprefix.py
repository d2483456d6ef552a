"""Prefix cache on disk: a restarted worker's first job with a long shared system prompt.

A previous worker ran a job with a ~``--system-tokens`` system prompt (its prefix kept
and written to ``--prefix-cache-dir``). Then, side by side, a restarted worker's first
job with that system prompt and a new question, three ways:

- ``cold``: a restarted worker without a disk cache (prefix cache in memory only, as
  by default): it prefills the whole prompt;
- ``disk``: a restarted worker with ``--prefix-cache-dir`` on the same directory: it
  reads the system prompt's prefix from disk and prefills only the question;
- ``mlx_lm.server`` restarted (its prompt cache lives in memory, so a restart starts
  cold): the same request.

Each arm has its model loaded and warmed by an unrelated short request first. Timed:
wall seconds of the request with ``max_tokens`` 1 (prefill, reading the file included,
and the first token), medians of ``--rounds``. The file is in the OS page cache (it was
just written); on a real restart after a reboot add its read from disk.

    .venv/bin/python -m bench.diskprefix [--system-tokens 3900] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

from bench.fixtures import model
from bench.peer import mlx_lm_server, post
from bench.prefix import system_prompt
from schemas import ChatRequest
from worker.engine.generator import ChatGenerator
from worker.engine.models import ModelCache
from worker.engine.prefixdisk import PrefixDisk

OUT = Path(__file__).parent / "out"


def body(target: str, system: str, question: str, max_tokens: int = 1) -> dict:
    return {
        "model": target,
        "temperature": 0,
        "max_tokens": max_tokens,
        "messages": [
            {"role": "system", "content": system},
            {"role": "user", "content": question},
        ],
    }


def first_job(cache: ModelCache, target: str, system: str) -> tuple[float, str, int]:
    """A restarted worker's first job with ``system``: (seconds, text, cached tokens)."""
    gen = ChatGenerator.get_or_create(target, cache=cache)
    gen.generate(ChatRequest.model_validate(body(target, "Be brief.", "warm up", 2)))
    req = ChatRequest.model_validate(body(target, system, "Which worker ran it?"))
    start = time.perf_counter()
    out = gen.generate(req)
    return time.perf_counter() - start, out.text, out.cached_tokens


def through_server(target: str, system: str) -> tuple[float, str]:
    with mlx_lm_server(target) as port:  # (answered a first, unrelated request)
        payload = body(target, system, "Which worker ran it?")
        del payload["model"]  # (the server has one)
        start = time.perf_counter()
        reply = post(port, payload)
        return time.perf_counter() - start, reply["choices"][0]["message"]["content"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default=None, help="a model path or hub id [the 12x1024 wide]")
    ap.add_argument("--system-tokens", type=int, default=3900)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--no-server", action="store_true")
    args = ap.parse_args()
    target = args.target or model("wide")
    tokenizer = ModelCache().get(target)[0].tokenizer
    system = system_prompt(tokenizer, args.system_tokens)
    times: dict[str, list[float]] = {"cold": [], "disk": [], "mlx_lm.server": []}
    texts: dict[str, str] = {}
    cached = 0
    with tempfile.TemporaryDirectory() as tmp:
        writer = ModelCache(prefix_disk=PrefixDisk(Path(tmp)))  # the worker before
        gen = ChatGenerator.get_or_create(target, cache=writer)
        gen.generate(ChatRequest.model_validate(body(target, system, "How many batches?")))
        assert writer.prefixes.disk is not None
        writer.prefixes.disk.flush()
        size = sum(p.stat().st_size for p in Path(tmp).iterdir())
        print(f"prefix file: {size / 1e6:.1f} MB; system prompt ~{args.system_tokens} tokens")
        for r in range(args.rounds):
            t, texts["cold"], _ = first_job(ModelCache(), target, system)
            times["cold"].append(t)
            t, texts["disk"], cached = first_job(
                ModelCache(prefix_disk=PrefixDisk(Path(tmp))), target, system
            )
            times["disk"].append(t)
            if not args.no_server:
                t, texts["mlx_lm.server"] = through_server(target, system)
                times["mlx_lm.server"].append(t)
            line = "  ".join(f"{k} {v[-1]:.2f} s" for k, v in times.items() if v)
            print(f"round {r + 1}: {line}")
    med = {k: statistics.median(v) for k, v in times.items() if v}
    result = {
        "target": target,
        "system_tokens": args.system_tokens,
        "file_mb": round(size / 1e6, 1),
        "cached_tokens": cached,
        "seconds": {k: [round(x, 3) for x in v] for k, v in times.items() if v},
        "median_s": {k: round(v, 3) for k, v in med.items()},
        "cold_over_disk": round(med["cold"] / med["disk"], 2),
        "same_text": texts["cold"] == texts["disk"],
    }
    if "mlx_lm.server" in med:
        result["server_over_disk"] = round(med["mlx_lm.server"] / med["disk"], 2)
    print(json.dumps(result, indent=1))
    OUT.mkdir(exist_ok=True)
    (OUT / "diskprefix.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
