"""A worker group's cost: per-token decode time and bytes sent, one process vs 2 ranks.

Side by side in one run, on one model (``wide``: llama 12 x 1024, fp32), greedy decoding
of ``--tokens`` tokens after a short prompt:

- ``whole``: one process, the whole model;
- ``tensor``: 2 ranks on this machine (``mlx.launch --backend ring -n 2``), the model
  split by mlx-lm's ``shard``, as ``worker --shard tensor`` loads it;
- ``pipeline``: the same with ``pipeline`` (on ``wide-qwen35``, which has it; its whole
  process measured too).

Per arm: milliseconds per token, and bytes each rank sent per token over loopback (the
kernel's ``lo`` counters, both ranks' traffic, halved) next to the cost model: tensor
parallel all-reduces the hidden state twice per layer (a ring all-reduce of S bytes
sends 2 (N - 1) / N x S per rank); pipeline sends it once per stage boundary, and the
last stage's output back to every rank. Both ranks share this machine's 2 cores, so the
split cannot be faster here: the figure is the collectives' overhead, not a speedup.

And what rank 0's messages cost (``worker.engine.mirror``): a plain step tells one header;
a speculative round tells the step, the proposals before the target's pass and what the
rows kept after it (4 rows, k = 4 here): milliseconds per step and per round (medians),
timed on the group's own transport.

    LD_PRELOAD=.../libblas.so.3 .venv/bin/python -m bench.group [--tokens 64]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
OUT = Path(__file__).parent / "out"


def lo_bytes() -> int:
    for line in Path("/proc/net/dev").read_text().splitlines():
        name, _, rest = line.partition(":")
        if name.strip() == "lo":
            return int(rest.split()[8])  # transmit bytes
    return 0


def rank_run(target: str, mode: str, tokens: int) -> None:
    """One rank (or the whole process): load, prefill, time ``tokens`` greedy steps."""
    import mlx.core as mx

    from worker.engine.group import Group
    from worker.engine.kvquant import make_cache

    if mode == "whole":
        from mlx_lm import load

        model, _ = load(target)
        rank, size = 0, 1
    else:
        from worker.engine.group import load_sharded

        group = Group(mx.distributed.init(), mode)
        model, _, _ = load_sharded(Path(target), group, target)
        rank, size = group.rank, group.size
    cache = make_cache(model)
    y = model(mx.array([list(range(1, 33))]), cache=cache)[:, -1].argmax(-1)
    mx.eval(y)
    for _ in range(4):  # warm
        y = model(y[None], cache=cache)[:, -1].argmax(-1)
        mx.eval(y)
    sent, start = lo_bytes(), time.perf_counter()
    for _ in range(tokens):
        y = model(y[None], cache=cache)[:, -1].argmax(-1)
        mx.eval(y)
    elapsed, sent = time.perf_counter() - start, lo_bytes() - sent
    row = {"ms_per_token": round(1000 * elapsed / tokens, 2), "ranks": size}
    row["bytes_per_token_per_rank"] = round(sent / max(size, 1) / tokens) if size > 1 else 0
    if mode != "whole":
        row |= messages_ms(group)
    if rank == 0:
        print("RESULT " + json.dumps(row), flush=True)


def messages_ms(group: Any, times: int = 200) -> dict:
    """Milliseconds rank 0's messages take (the median of ``times``; both ranks share
    this VM's cores, so single collectives wait on the scheduler): a plain step's, a
    speculative round's."""
    proposed = {"op": "proposed", "drafts": [[1000 + i] * 4 for i in range(4)]}
    kept = {"op": "kept", "accepts": [2, 1, 4, 0], "last": [7, 8, 9, 10], "keep": [0, 1, 2, 3]}
    out = {}
    for name, told in (("step_messages_ms", []), ("spec_round_messages_ms", [proposed, kept])):
        took = []
        for _ in range(times):
            start = time.perf_counter()
            group.step()
            for message in told:
                group.tell(message)
            if not group.leads:
                for _ in range(1 + len(told)):
                    group.listen()
            took.append(time.perf_counter() - start)
        out[name] = round(1000 * statistics.median(took), 3)
    return out


def measured(target: str, mode: str, tokens: int) -> dict:
    py = sys.executable
    here = [py, str(Path(__file__).resolve()), "--rank-run", mode, "--target", target]
    here += ["--tokens", str(tokens)]
    if mode == "whole":
        cmd = here
    else:
        launch = str(Path(py).with_name("mlx.launch"))
        cmd = [launch, "--backend", "ring", "-n", "2", "--python", py, *here[1:]]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=900, cwd=ROOT)
    line = next((x for x in out.stdout.splitlines() if x.startswith("RESULT ")), None)
    if line is None:
        raise SystemExit(f"{mode}: no result\n{out.stdout[-2000:]}\n{out.stderr[-2000:]}")
    return json.loads(line[len("RESULT ") :])


def cost_model(target: str, mode: str, ranks: int = 2) -> int:
    """Bytes per token per rank the split must send (payload only)."""
    config = json.loads((Path(target) / "config.json").read_text())
    hidden, layers = config["hidden_size"], config["num_hidden_layers"]
    width = {"float32": 4, "float16": 2, "bfloat16": 2}.get(config.get("torch_dtype"), 4)
    state = hidden * width
    if mode == "tensor":
        return round(layers * 2 * state * 2 * (ranks - 1) / ranks)
    return round(state * 2)  # one boundary, and the output back (all_gather of a state)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--rank-run", choices=["whole", "tensor", "pipeline"])
    ap.add_argument("--target")
    args = ap.parse_args()
    if args.rank_run:
        rank_run(args.target, args.rank_run, args.tokens)
        return
    from bench.fixtures import model

    rows = []
    for name, split in (("wide", "tensor"), ("wide-qwen35", "pipeline")):
        target = model(name)
        whole = measured(target, "whole", args.tokens)
        split_row = measured(target, split, args.tokens)
        row = {
            "model": name,
            "split": split,
            "whole_ms_per_token": whole["ms_per_token"],
            "group_ms_per_token": split_row["ms_per_token"],
            "group_vs_whole": round(split_row["ms_per_token"] / whole["ms_per_token"], 3),
            "bytes_per_token_per_rank": split_row["bytes_per_token_per_rank"],
            "cost_model_bytes": cost_model(target, split),
            "step_messages_ms": split_row["step_messages_ms"],
            "spec_round_messages_ms": split_row["spec_round_messages_ms"],
        }
        rows.append(row)
        print(json.dumps(row), flush=True)
    OUT.mkdir(exist_ok=True)
    (OUT / "group.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    if str(ROOT) not in sys.path:  # (run as a script by mlx.launch)
        sys.path.insert(0, str(ROOT))
    main()
