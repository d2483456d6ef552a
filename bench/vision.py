"""Image jobs: 32 greedy jobs (4 images x 8 questions) on the tiny Gemma 3 VLM.

Arms, side by side in one run: mlxq batched (``--max-batch 8``) with the prefix cache (each
image's prefill kept and shared by its 8 questions), mlxq batched without it, mlxq one job
at a time, and mlx-vlm's own ``generate`` one request at a time in this process (the model
loaded once): its text must equal mlxq's. mlxq's arms count from submit (Redis, the queue,
validation) to the last record; mlx-vlm's from its first request. Also Redis bytes per
queued job, and for ``--store-jobs`` jobs over 10 images (each image stored once per batch).

    .venv/bin/python -m bench.vision [--rounds 3] [--tokens 24] [--store-jobs 10000]
        [--arch gemma3|mistral3] [--small]

mlx-vlm's ``batch_generate`` is tried as well; in mlx-vlm 0.7.10 it fails on the tiny
models (its processors' batched inputs), and the bench says so. And mlx-vlm's server
(``python -m mlx_vlm.server``: continuous batching), the 32 requests sent at once, the model
loaded and answered once before: it imports mlx-audio and cryptography, which mlxq does not
install (``pip install --no-deps mlx-audio; pip install cryptography``); without them the
bench says it was not run.
"""

from __future__ import annotations

import argparse
import base64
import io
import json
import statistics
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
from PIL import Image
from redis import Redis

from bench.serve import burst
from producer import Client
from producer.localredis import LocalRedis
from worker.dev.tinyvlm import ARCHS, ensure_vlm
from worker.engine.models import ModelCache
from worker.runner import runtime

ROOT = Path(__file__).resolve().parents[1]
OUT = Path(__file__).parent / "out"
QUESTIONS = [
    f"question {i}: what is the {w} in this image"
    for i, w in enumerate("queue worker batch model token cache draft fleet".split())
]


def png(seed: int) -> bytes:
    pixels = (np.random.RandomState(seed).rand(480, 640, 3) * 255).astype("uint8")
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="PNG")
    return out.getvalue()


def bodies(model: str, images: list[bytes], tokens: int) -> list[dict]:
    out = []
    for image in images:
        url = f"data:image/png;base64,{base64.b64encode(image).decode()}"
        for q in QUESTIONS:
            content = [
                {"type": "image_url", "image_url": {"url": url}},
                {"type": "text", "text": q},
            ]
            out.append(
                {
                    "model": model,
                    "messages": [{"role": "user", "content": content}],
                    "max_tokens": tokens,
                    "temperature": 0,
                }
            )
    return out


def mlx_vlm_arm(model_path: str, images: list[bytes], tokens: int) -> tuple[list[str], float]:
    from mlx_vlm import generate, load

    model, processor = load(model_path)
    texts = []
    start = time.perf_counter()
    for image in images:
        pil = Image.open(io.BytesIO(image)).convert("RGB")
        for q in QUESTIONS:
            messages = [
                {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": q}]}
            ]
            prompt = processor.tokenizer.apply_chat_template(
                messages, add_generation_prompt=True, tokenize=False
            )
            out = generate(
                model, processor, prompt, image=[pil], max_tokens=tokens, temperature=0.0
            )
            texts.append(out.text)
    return texts, time.perf_counter() - start


def mlx_vlm_batch_arm(
    model_path: str, images: list[bytes], tokens: int
) -> tuple[list[str] | None, float]:
    """mlx-vlm's own ``batch_generate`` over all 32 prompts at once (greedy); (None, 0) if
    it fails on this model."""
    from mlx_vlm import load
    from mlx_vlm.generate import batch_generate

    model, processor = load(model_path)
    pils, prompts = [], []
    for image in images:
        pil = Image.open(io.BytesIO(image)).convert("RGB")
        for q in QUESTIONS:
            messages = [
                {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": q}]}
            ]
            prompts.append(
                processor.tokenizer.apply_chat_template(
                    messages, add_generation_prompt=True, tokenize=False
                )
            )
            pils.append(pil)
    start = time.perf_counter()
    try:
        out = batch_generate(model, processor, images=pils, prompts=prompts, max_tokens=tokens)
    except Exception as e:  # its batching is young; say so rather than stop
        print(f"mlx-vlm batch_generate failed: {type(e).__name__}: {e}")
        return None, 0.0
    return list(out.texts), time.perf_counter() - start


def mlx_vlm_server_arm(model_path: str, jobs: list[dict]) -> tuple[list[str] | None, float]:
    """mlx-vlm's own server over every job at once; (None, 0) if it cannot start here."""
    import subprocess
    import sys

    from bench.peer import free_port, post

    port = free_port()
    cmd = [sys.executable, "-m", "mlx_vlm.server", "--model", model_path]
    cmd += ["--host", "127.0.0.1", "--port", str(port)]
    # (its request log to a file: a pipe could fill and stall it)
    with tempfile.TemporaryFile("w+") as log:
        server = subprocess.Popen(cmd, stdout=log, stderr=log, text=True)
        try:
            deadline = time.monotonic() + 120
            while True:
                try:
                    post(port, jobs[0], attempts=1)  # (loaded and warm)
                    break
                except OSError:
                    if server.poll() is not None or time.monotonic() > deadline:
                        log.seek(0)
                        why = log.read().strip().splitlines()
                        print(f"mlx-vlm server not run: {why[-1] if why else 'did not start'}")
                        return None, 0.0
                    time.sleep(0.5)
            start = time.perf_counter()
            with ThreadPoolExecutor(len(jobs)) as pool:
                replies = list(pool.map(lambda b: post(port, b), jobs))
            elapsed = time.perf_counter() - start
            return [r["choices"][0]["message"]["content"] for r in replies], elapsed
        finally:
            server.terminate()
            server.wait(30)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=24)
    ap.add_argument("--store-jobs", type=int, default=10_000, help="jobs over 10 images")
    ap.add_argument("--arch", choices=ARCHS, default="gemma3")
    ap.add_argument("--small", action="store_true", help="the bench-sized VLM (64 image tokens)")
    args = ap.parse_args()
    size = "small" if args.small else "tiny"
    where = ROOT / ".mlxq" / "bench" / f"{size}-{args.arch}-vlm"
    model = str(ensure_vlm(where, arch=args.arch, small=args.small))
    images = [png(i) for i in range(4)]
    jobs = bodies(model, images, args.tokens)
    arms = {"batched+prefix": (8, None), "batched": (8, 0), "alone": (1, None)}
    times: dict[str, list[float]] = {a: [] for a in [*arms, "mlx-vlm generate"]}
    texts: dict[str, list[str]] = {}
    with LocalRedis() as server:
        conn = Redis.from_url(server.url)
        for _ in range(args.rounds):
            for arm, (batch, prefix) in arms.items():
                cache = ModelCache() if prefix is None else ModelCache(prefix_bytes=prefix)
                rt = runtime.WorkerRuntime(cache=cache)
                burst(conn, jobs[:1], rt, max_batch=1)  # load the model outside the timing
                records, elapsed = burst(conn, jobs, rt, max_batch=batch)
                times[arm].append(elapsed)
                texts[arm] = [r.response.choices[0].message.content for r in records]
            ref, elapsed = mlx_vlm_arm(model, images, args.tokens)
            times["mlx-vlm generate"].append(elapsed)
            texts["mlx-vlm generate"] = ref
            batch, elapsed = mlx_vlm_batch_arm(model, images, args.tokens)
            if batch is not None:
                times.setdefault("mlx-vlm batch_generate", []).append(elapsed)
                texts["mlx-vlm batch_generate"] = batch
            served, elapsed = mlx_vlm_server_arm(model, jobs)
            if served is not None:
                times.setdefault("mlx-vlm server", []).append(elapsed)
                texts["mlx-vlm server"] = served
        conn.flushall()
        before = conn.info("memory")["used_memory"]
        Client(connection=conn).submit(jobs)
        job_bytes = (conn.info("memory")["used_memory"] - before) // len(jobs)
        # Redis for --store-jobs jobs over 10 images (submitted, not run).
        ten = [png(100 + i) for i in range(10)]
        many = bodies(model, ten, args.tokens)
        many = [many[i % len(many)] for i in range(args.store_jobs)]
        conn.flushall()
        before = conn.info("memory")["used_memory"]
        start = time.perf_counter()
        Client(connection=conn).submit(many)
        submit_s = time.perf_counter() - start
        many_bytes = conn.info("memory")["used_memory"] - before
    median = {a: statistics.median(t) for a, t in times.items()}
    ref = texts["mlx-vlm generate"]
    equal = {a: sum(x == y for x, y in zip(t, ref, strict=True)) for a, t in texts.items()}
    print(
        f"{len(jobs)} image jobs (4 images x 8 questions, 640x480 PNG), {args.tokens} tokens "
        f"each, {size} {args.arch} VLM"
    )
    for arm, t in median.items():
        same = f"{equal[arm]}/{len(jobs)}"
        print(f"  {arm:22s} {len(jobs) / t:7.2f} jobs/s  texts equal to mlx-vlm generate: {same}")
    print(f"batched+prefix / alone:            {median['alone'] / median['batched+prefix']:.2f}x")
    print(f"batched+prefix / batched:          {median['batched'] / median['batched+prefix']:.2f}x")
    best = median["batched+prefix"]
    print(f"batched+prefix / mlx-vlm generate: {median['mlx-vlm generate'] / best:.2f}x")
    for peer in ("mlx-vlm batch_generate", "mlx-vlm server"):
        if peer in median:
            print(f"batched+prefix / {peer}: {median[peer] / best:.2f}x")
    print(f"Redis bytes per queued job: {job_bytes:,} (4 images of {len(images[0]):,} bytes)")
    print(
        f"{args.store_jobs:,} jobs over 10 images: {many_bytes / 1e6:.1f} MB in Redis "
        f"({many_bytes / args.store_jobs:,.0f} bytes per job; the images: "
        f"{sum(map(len, ten)) / 1e6:.1f} MB), submitted in {submit_s:.1f} s"
    )
    OUT.mkdir(exist_ok=True)
    (OUT / "vision.json").write_text(
        json.dumps(
            {"times": times, "equal": equal, "job_bytes": job_bytes, "many_bytes": many_bytes},
            indent=1,
        )
    )


if __name__ == "__main__":
    main()
