"""What logprobs cost: decode tokens/s with ``logprobs`` (and top 5 alternatives) vs without.

The same greedy jobs, one at a time, pair by pair (noise hits both alike); the ratio
is decode seconds per token (after the first) with logprobs over without, median
over pairs. Every pair must produce the same tokens.

    .venv/bin/python -m bench.logprobs [--target PATH_OR_HUB_ID] [--jobs 6] [--max-tokens 32]
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from bench.fixtures import model
from schemas import ChatRequest
from worker.engine.generator import ChatGenerator
from worker.engine.models import ModelCache

OUT = Path(__file__).parent / "out"
TOPICS = ["queues", "caches", "drafts", "fleets", "tokens", "batches", "metrics", "restarts"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default=None, help="model path or hub id [default: wide32k]")
    ap.add_argument("--jobs", type=int, default=6)
    ap.add_argument("--max-tokens", type=int, default=32)
    args = ap.parse_args()
    target = args.target or model("wide32k")
    gen = ChatGenerator.get_or_create(target, cache=ModelCache(prefix_bytes=0))

    def req(topic: str, **fields: object) -> ChatRequest:
        body = {
            "model": target,
            "temperature": 0,
            "max_tokens": args.max_tokens,
            "messages": [{"role": "user", "content": f"Tell me about {topic}."}],
        }
        return ChatRequest.model_validate(body | fields)

    gen.generate(req("warm-up", logprobs=True, top_logprobs=5))
    ratios = []
    for topic in (TOPICS * 2)[: args.jobs]:
        free = gen.generate(req(topic))
        with_lp = gen.generate(req(topic, logprobs=True, top_logprobs=5))
        assert with_lp.token_ids == free.token_ids, topic
        per_token = [o.decode_s / max(o.completion_tokens - 1, 1) for o in (with_lp, free)]
        ratios.append(per_token[0] / per_token[1])
    report = {
        "target": target,
        "jobs": args.jobs,
        "max_tokens": args.max_tokens,
        "logprobs_over_free_per_token": round(statistics.median(ratios), 3),
        "per_pair": [round(r, 3) for r in ratios],
    }
    OUT.mkdir(exist_ok=True)
    (OUT / "logprobs.json").write_text(json.dumps(report, indent=1))
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
