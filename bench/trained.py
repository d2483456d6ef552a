"""A realistic (target, draft) pair: small llamas trained on the CPython standard library.

Synthetic pairs agree by construction (copy) or never (unrelated); this pair
shows real acceptance on real text. Both models share a byte-level BPE
tokenizer (1024 entries) trained on the same sources; the target is 4 x 256,
the draft 1 x 128. Files are split by a hash of their path: one in ten is
held out, and benchmark prompts are the openings of held-out files, so the
models never saw them. Training (800 steps of 8 x 128 tokens each) is seeded
and takes about 10 minutes on a 2-core x86 CPU (OpenBLAS preloaded); the
result is cached next to the synthetic fixtures and reused.

    .venv/bin/python -m bench.trained            # build (or reuse) and print paths
"""

from __future__ import annotations

import hashlib
import json
import math
import sysconfig
import time
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
from mlx.utils import tree_flatten
from mlx_lm.models import llama

from bench.fixtures import cache_dir
from worker.dev.tinymodels import TinySpec, model_config, save_tokenizer, train_bytelevel_bpe

VOCAB = 1024
SEQ = 128
BATCH = 8
CODE_TEMPLATE = "{% for m in messages %}{{ m['content'] }}{% endfor %}"


@dataclass(frozen=True)
class Recipe:
    spec: TinySpec
    steps: int
    lr: float
    seed: int


TARGET = Recipe(
    TinySpec(layers=4, hidden=256, intermediate=688, heads=4, kv_heads=4, vocab=VOCAB, seed=201),
    steps=800,
    lr=2e-3,
    seed=1,
)
DRAFT = Recipe(
    TinySpec(layers=1, hidden=128, intermediate=344, heads=4, kv_heads=4, vocab=VOCAB, seed=202),
    steps=800,
    lr=3e-3,
    seed=2,
)
CORPUS_BYTES = 6_000_000


def sources() -> tuple[list[Path], list[Path]]:
    """(training files, held-out files) of the stdlib, split by a hash of the path."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(
        p
        for p in root.rglob("*.py")
        if not any(part in {"test", "tests", "site-packages", "idlelib"} for part in p.parts)
    )
    held = [p for p in files if hashlib.sha256(str(p.relative_to(root)).encode()).digest()[0] < 26]
    train = [p for p in files if p not in set(held)]
    return train, held


def _read(p: Path) -> str:
    return p.read_text(encoding="utf-8", errors="replace")


def prompts(n: int = 3, chars: int = 400) -> list[str]:
    """Openings of ``n`` held-out stdlib files (never trained on), cut at a line end."""
    return openings(sources()[1], n, chars)


def openings(files: list[Path], n: int, chars: int = 400) -> list[str]:
    """Openings of the first ``n`` of ``files`` at least twice ``chars`` long, cut at a
    line end."""
    out = []
    for p in files:
        text = _read(p)
        if len(text) < 2 * chars:
            continue
        out.append(text[: text.rfind("\n", 0, chars) + 1])
        if len(out) == n:
            break
    return out


def _tokenizer(path: Path, texts: list[str]) -> None:
    save_tokenizer(train_bytelevel_bpe(texts, VOCAB), path, CODE_TEMPLATE)


def _train(path: Path, recipe: Recipe, data: mx.array, eos: int) -> float:
    """Train one model on random windows of ``data``; returns the last loss."""
    config = model_config(recipe.spec, eos_token_id=eos)
    mx.random.seed(recipe.spec.seed)
    model = llama.Model(llama.ModelArgs.from_dict(config))
    warmup = 100

    def schedule(step: mx.array) -> mx.array:
        ramp = mx.minimum(step / warmup, 1.0)
        cos = 0.5 * (1 + mx.cos(math.pi * mx.minimum(step / recipe.steps, 1.0)))
        return recipe.lr * ramp * (0.1 + 0.9 * cos)

    opt = optim.AdamW(learning_rate=schedule, weight_decay=0.01)

    def loss_fn(m: nn.Module, x: mx.array, y: mx.array) -> mx.array:
        return nn.losses.cross_entropy(m(x), y).mean()

    grad = nn.value_and_grad(model, loss_fn)
    state = [model.state, opt.state]

    @partial(mx.compile, inputs=state, outputs=state)
    def step(x: mx.array, y: mx.array) -> mx.array:
        loss, grads = grad(model, x, y)
        opt.update(model, grads)
        return loss

    mx.random.seed(recipe.seed)
    start, last = time.perf_counter(), 0.0
    for i in range(recipe.steps):
        at = mx.random.randint(0, data.size - SEQ - 1, (BATCH,))
        windows = data[at[:, None] + mx.arange(SEQ + 1)[None]]
        loss = step(windows[:, :-1], windows[:, 1:])
        mx.eval(state, loss)
        last = loss.item()
        if i % 200 == 0 or i == recipe.steps - 1:
            rate = (i + 1) / (time.perf_counter() - start)
            done = f"step {i + 1}/{recipe.steps}"
            print(f"  {path.name}: {done} loss {last:.3f} ({rate:.1f} steps/s)", flush=True)
    weights = dict(tree_flatten(model.parameters()))
    mx.save_safetensors(str(path / "model.safetensors"), weights, metadata={"format": "mlx"})
    (path / "config.json").write_text(json.dumps(config, indent=1))
    return last


def _stamp(recipe: Recipe) -> str:
    return json.dumps(
        {"recipe": asdict(recipe), "vocab": VOCAB, "seq": SEQ, "batch": BATCH}, sort_keys=True
    )


def ensure_pair() -> tuple[str, str]:
    """Paths of the trained (target, draft), training them on first use."""
    root = cache_dir()
    target, draft = root / "cpython-target", root / "cpython-draft"
    if all(
        (p / "mlxq-trained.json").exists() and (p / "mlxq-trained.json").read_text() == _stamp(r)
        for p, r in ((target, TARGET), (draft, DRAFT))
    ):
        return str(target), str(draft)
    train, _ = sources()
    texts, size = [], 0
    for p in train:
        texts.append(_read(p))
        size += len(texts[-1])
        if size >= CORPUS_BYTES:
            break
    print(f"training on {len(texts)} stdlib files ({size / 1e6:.1f} MB); ~10 min on 2 cores")
    _tokenizer(target, texts)
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(target / "tokenizer.json"))
    ids = [i for enc in tok.encode_batch(texts) for i in (*enc.ids, tok.token_to_id("</s>"))]
    data = mx.array(ids, dtype=mx.uint32)
    eos = tok.token_to_id("</s>")
    for path, recipe in ((target, TARGET), (draft, DRAFT)):
        if path != target:
            path.mkdir(parents=True, exist_ok=True)
            for f in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
                (path / f).write_bytes((target / f).read_bytes())
        (path / "mlxq-trained.json").unlink(missing_ok=True)
        loss = _train(path, recipe, data, eos)
        print(f"  {path.name}: final training loss {loss:.3f}")
        (path / "mlxq-trained.json").write_text(_stamp(recipe))
    return str(target), str(draft)


if __name__ == "__main__":
    t, d = ensure_pair()
    print("target", t)
    print("draft", d)
    print("prompts (held out):", [p[:60] for p in prompts()])
