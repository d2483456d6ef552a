"""Training drafters here, on their target's own greedy continuations.

``train_eagle3`` / ``train_dflash`` take a drafter written by
``worker.dev.tinydrafters`` (``train_mtp`` a checkpoint with an MTP layer) and a list
of prompts: the target continues each greedily, its states at the layers the drafter
reads are recorded (``worker.engine.hidden.Tap``), and the drafter learns
(cross-entropy, Adam; the target's embedding and output layer stay frozen). A head
(EAGLE-3, MTP) learns, for each pair (state at p, token at p + 1), the token at p + 2:
only one step ahead (not EAGLE-3's training-time test of several), so its proposals
after the first are weaker. A DFlash drafter learns whole blocks: from the context up
to an anchor and a block (the anchor's token, then masks) of 2 to 5 positions, the
tokens after the anchor (many anchors in one batch). Seconds on 2 cores for the
tests' tiny targets; ``bench.eagle`` trains longer on more prompts.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import mlx.core as mx
from mlx.utils import tree_flatten


def _greedy(model: object, prompt: list[int], n: int) -> list[int]:
    """``prompt`` and the target's ``n`` greedy tokens after it."""
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    logits = model(mx.array(prompt)[None], cache=cache)  # type: ignore[operator]
    out = list(prompt)
    for _ in range(n):
        token = int(mx.argmax(logits[0, -1]).item())
        out.append(token)
        logits = model(mx.array([[token]]), cache=cache)  # type: ignore[operator]
    return out


def _record(head: Any, model: Any, prompts: list[list[int]], new: int) -> tuple[mx.array, mx.array]:
    """The model's greedy continuations of ``prompts`` (``new`` tokens each, cut to the
    shortest), (B, W), and its states at the layers ``head`` reads, (B, W, n * H)."""
    seqs = [_greedy(model, p, new) for p in prompts]
    width = min(len(s) for s in seqs)
    tokens = mx.array([s[:width] for s in seqs])
    with head.tap:
        model(tokens)
    states = head.tap.take()
    assert states is not None
    mx.eval(states)
    embed = getattr(head.module, "embed_tokens", None)
    if embed is not None:  # (the target's, frozen)
        embed.freeze()
    return tokens, states


def _fit(module: Any, loss_fn: Any, steps: int, rate: float = 3e-3) -> dict[str, float]:
    """``steps`` of Adam on ``module``'s own weights; the first and last loss."""
    import mlx.nn as nn
    import mlx.optimizers as optim

    opt = optim.Adam(learning_rate=rate)
    step = nn.value_and_grad(module, loss_fn)
    losses = []
    for i in range(steps):
        loss, grads = step(module, i)
        opt.update(module, grads)
        mx.eval(module.parameters(), opt.state, loss)
        losses.append(float(loss))
    return {"first_loss": losses[0], "last_loss": losses[-1]}


def train(
    head: Any, model: Any, prompts: list[list[int]], steps: int, new: int
) -> dict[str, float]:
    """Train ``head`` (bound to ``model``) on the model's own greedy continuations of
    ``prompts`` (``new`` tokens each): each pair (state at p, token at p + 1) learns the
    token at p + 2. Only the head's own weights learn; returns the first and last loss."""
    import mlx.nn as nn
    from mlx_lm.models.cache import BatchKVCache

    tokens, states = _record(head, model, prompts, new)
    b = tokens.shape[0]

    def loss_fn(_: Any, __: int) -> mx.array:
        caches = [BatchKVCache([0] * b) for _ in head.layers]
        h = head.forward(tokens[:, 1:], head.from_target(states)[:, :-1], caches)
        return nn.losses.cross_entropy(head.logits(h)[:, :-1], tokens[:, 2:]).mean()

    return _fit(head.module, loss_fn, steps)


def train_blocks(
    head: Any,
    model: Any,
    prompts: list[list[int]],
    steps: int,
    new: int,
    anchors: int = 8,
    rate: float = 3e-3,
) -> dict[str, float]:
    """Train a DFlash drafter (``head``, bound to ``model``) on the model's greedy
    continuations of ``prompts``: each step, ``anchors`` anchor positions a per
    sequence (drawn from a seeded generator) and one block length of 2 to 5, all in one
    batch (each row's context left-padded); from the states before a and the block
    (the token at a, then mask tokens), the tokens after a."""
    import random

    import mlx.nn as nn
    from mlx_lm.models.cache import BatchKVCache

    tokens, states = _record(head, model, prompts, new)
    b, width = tokens.shape
    draws = random.Random(0)
    plan = [
        (draws.randrange(2, 6), [draws.randrange(1, width - 5) for _ in range(anchors)])
        for _ in range(steps)
    ]

    def loss_fn(_: Any, i: int) -> mx.array:
        n, starts = plan[i]
        rows = [(s, a) for s in range(b) for a in starts]
        most = max(starts)
        ctx = mx.stack([mx.pad(states[s, :a], [(most - a, 0), (0, 0)]) for s, a in rows])
        caches = [BatchKVCache([most - a for _, a in rows]) for _ in head.layers]
        head.context(ctx, caches)
        first = mx.stack([tokens[s, a : a + 1] for s, a in rows])
        masks = mx.full((len(rows), n - 1), head.mask, tokens.dtype)
        logits = head.block_logits(mx.concatenate([first, masks], axis=1), caches)
        want = mx.stack([tokens[s, a + 1 : a + n] for s, a in rows])
        return nn.losses.cross_entropy(logits, want).mean()

    return _fit(head.module, loss_fn, steps, rate)


def train_eagle3(
    path: Path, target: Path, prompts: list[list[int]], steps: int = 300, new: int = 48
) -> dict[str, float]:
    """Train the EAGLE-3 drafter at ``path`` (``worker.dev.tinydrafters.write_eagle3``)
    for ``target`` (:func:`train`) and save it in place."""
    return _train_at(path, target, prompts, steps, new, train)


def train_dflash(
    path: Path,
    target: Path,
    prompts: list[list[int]],
    steps: int = 300,
    new: int = 48,
    anchors: int = 8,
) -> dict[str, float]:
    """Train the DFlash drafter at ``path`` (``worker.dev.tinydrafters.write_dflash``)
    for ``target`` (:func:`train_blocks`, ``anchors`` per sequence a step) and save it
    in place (without the target's embedding it reads)."""
    import functools

    how = functools.partial(train_blocks, anchors=anchors)
    return _train_at(path, target, prompts, steps, new, how, drop="embed_tokens.")


def _train_at(
    path: Path,
    target: Path,
    prompts: list[list[int]],
    steps: int,
    new: int,
    how: Any,
    drop: str = "",
) -> dict[str, float]:
    from mlx_lm import load

    from worker.engine import heads

    model, _ = load(str(target))
    module, _ = heads.load(Path(path))
    losses = how(heads.bind(module, model), model, prompts, steps, new)
    weights = {
        k: v for k, v in tree_flatten(module.parameters()) if not (drop and k.startswith(drop))
    }
    mx.save_safetensors(str(Path(path) / "model.safetensors"), weights, metadata={"format": "mlx"})
    return losses


def train_mtp(
    target: Path, prompts: list[list[int]], steps: int = 300, new: int = 48
) -> dict[str, float]:
    """Train the MTP head inside the checkpoint at ``target``
    (``worker.dev.tinydrafters.write_mtp``) on its own continuations (:func:`train`) and
    save it back into the checkpoint (``mtp.*``)."""
    from mlx_lm import load

    from worker.engine import heads

    model, _ = load(str(target))
    module, _ = heads.load(Path(target), own=True)
    losses = train(heads.bind(module, model), model, prompts, steps, new)
    file = Path(target) / "model.safetensors"
    weights = dict(mx.load(str(file)))
    weights.update({"mtp." + k: v for k, v in tree_flatten(module.parameters())})
    mx.save_safetensors(str(file), weights, metadata={"format": "mlx"})
    return losses
