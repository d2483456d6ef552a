"""A forced tool call's cost: constrained vs free decoding, alone and in a batch of 8.

The target is ``wide32k`` (12 x 1024, a 32,000-entry byte-level BPE) given a
Hermes / Qwen-style chat template that renders tools (a copy of the model
directory; mlx-lm then parses ``<tool_call>`` JSON). Jobs offer two tools, one of
them the 10-field extraction schema of ``bench/grammar.py`` as its ``parameters``.

- alone: decode seconds per token (total minus time to first token, over the tokens
  after the first) with ``tool_choice`` naming the extraction function (the call
  decoded under the envelope + schema grammar) / with ``tool_choice`` ``auto`` (free
  text, the constraint waiting for the call marker: what a job pays for tools it
  does not call), same prompts, pair by pair, alternating; median over prompts;
- a batch of 8 (``BatchEngine``): seconds per decoding step while all 8 decode,
  forced / auto, median over rounds;
- compile: the first forced job on a tokenizer (llguidance's tokenizer set-up plus the
  tool set's grammar) and a new tool set on a tokenizer already set up.

    bench/run bench.toolcalls [--rounds 2] [--tokens 48]
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.fixtures import model
from bench.grammar import SCHEMA
from bench.structured import PROMPTS, per_step_batched, per_token_alone
from schemas import ChatRequest
from worker.dev.tinymodels import HERMES_TEMPLATE
from worker.engine.generator import ChatGenerator
from worker.engine.models import ModelCache

OUT = Path(__file__).parent / "out"
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "save_customer",
            "description": "Store the customer record found in the message.",
            "parameters": SCHEMA,
        },
    },
    {
        "type": "function",
        "function": {
            "name": "ignore",
            "parameters": {"type": "object", "properties": {"why": {"type": "string"}}},
        },
    },
]
NAMED = {"type": "function", "function": {"name": "save_customer"}}


def with_tool_template(src: str, root: Path) -> str:
    """A copy of model ``src`` whose chat template renders tools."""
    dst = root / "tools-model"
    shutil.copytree(src, dst)
    config = json.loads((dst / "tokenizer_config.json").read_text())
    config["chat_template"] = HERMES_TEMPLATE
    (dst / "tokenizer_config.json").write_text(json.dumps(config, indent=1))
    return str(dst)


def request(
    target: str, prompt: str, forced: bool, tokens: int, tools: list[dict[str, Any]] = TOOLS
) -> ChatRequest:
    return ChatRequest.model_validate(
        {
            "model": target,
            "messages": [{"role": "user", "content": prompt}],
            "max_tokens": tokens,
            "temperature": 0,
            "tools": tools,
            "tool_choice": NAMED if forced else "auto",
        }
    )


def compile_times(gen: ChatGenerator, target: str) -> dict[str, float]:
    from mlx_lm.utils import load_tokenizer

    from worker.engine.constrain import constraint_for
    from worker.engine.toolcalls import family_of, grammar

    tok = load_tokenizer(Path(target))  # a tokenizer llguidance has not seen
    req = request(target, PROMPTS[0], True, 8)
    t = time.perf_counter()
    calls, trigger = grammar(req, tok, family_of(tok))
    constraint_for(req, tok, gen.target.vocab_size, calls, trigger)
    first = time.perf_counter() - t
    tools = json.loads(json.dumps(TOOLS))
    tools[0]["function"]["description"] = f"variant {time.time()}"  # a tool set not seen
    req2 = request(target, PROMPTS[0], True, 8, tools=tools)
    t = time.perf_counter()
    calls, trigger = grammar(req2, tok, family_of(tok))
    constraint_for(req2, tok, gen.target.vocab_size, calls, trigger)
    return {"first_job_s": first, "new_tool_set_s": time.perf_counter() - t}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=48, help="max_tokens per job")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        target = with_tool_template(model("wide32k"), Path(tmp))
        gen = ChatGenerator.get_or_create(target, cache=ModelCache())
        result: dict[str, Any] = {"target": "wide32k + a tools template"}
        result["compile"] = compile_times(gen, target)
        gen.generate(request(target, PROMPTS[0], True, 4))  # warm both paths
        gen.generate(request(target, PROMPTS[0], False, 4))
        ratios, calls = [], 0
        for prompt in PROMPTS:
            for _ in range(args.rounds):
                free, _, _ = per_token_alone(gen, request(target, prompt, False, args.tokens))
                forced, _, finish = per_token_alone(gen, request(target, prompt, True, args.tokens))
                ratios.append(forced / free)
            calls += finish == "stop"
        result["alone"] = {
            "ratio_median": statistics.median(ratios),
            "ratio_mean": statistics.fmean(ratios),
            "forced_jobs_that_finished_their_call": f"{calls}/{len(PROMPTS)}",
        }
        print(
            f"alone: forced call / free seconds per token, median {statistics.median(ratios):.3f}"
        )
        batch, steps = [], []
        for _ in range(args.rounds):
            free, _ = per_step_batched(
                gen, [request(target, p, False, args.tokens) for p in PROMPTS]
            )
            forced, n = per_step_batched(
                gen, [request(target, p, True, args.tokens) for p in PROMPTS]
            )
            batch.append(forced / free)
            steps.append((free, forced, n))
        result["batch8"] = {"ratio_median": statistics.median(batch), "step_s_free_forced_n": steps}
        print(f"batch of 8: forced / free seconds per step, median {statistics.median(batch):.3f}")
    OUT.mkdir(exist_ok=True)
    (OUT / "toolcalls.json").write_text(json.dumps(result, indent=1))
    print(json.dumps(result))


if __name__ == "__main__":
    main()
