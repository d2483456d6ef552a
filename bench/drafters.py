"""Training an EAGLE-3 drafter here, on its target's own greedy continuations.

``train_eagle3`` takes a drafter written by ``worker.dev.tinydrafters.write_eagle3`` and
a list of prompts: the target continues each greedily, its states at the layers the
drafter reads are recorded (``worker.engine.hidden.Tap``), and the drafter learns, for
each pair (state at p, token at p + 1), the token at p + 2 (cross-entropy, Adam; its
embedding stays the target's, frozen). Seconds on 2 cores for the tests' tiny targets;
``bench.eagle`` trains longer on more prompts. Only one step ahead is trained (not
EAGLE-3's training-time test of several), so proposals after the first are weaker.
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


def train(
    head: Any, model: Any, prompts: list[list[int]], steps: int, new: int
) -> dict[str, float]:
    """Train ``head`` (bound to ``model``) on the model's own greedy continuations of
    ``prompts`` (``new`` tokens each): each pair (state at p, token at p + 1) learns the
    token at p + 2. Only the head's own weights learn; returns the first and last loss."""
    import mlx.nn as nn
    import mlx.optimizers as optim
    from mlx_lm.models.cache import BatchKVCache

    seqs = [_greedy(model, p, new) for p in prompts]
    width = min(len(s) for s in seqs)
    tokens = mx.array([s[:width] for s in seqs])
    with head.tap:
        model(tokens)
    states = head.tap.take()
    assert states is not None
    mx.eval(states)
    embed = getattr(head.module, "embed_tokens", None)
    if embed is not None:  # (an EAGLE-3 head reads its target's, frozen)
        embed.freeze()

    def loss_fn(_: nn.Module) -> mx.array:
        caches = [BatchKVCache([0] * len(seqs)) for _ in head.layers]
        h = head.forward(tokens[:, 1:], head.from_target(states)[:, :-1], caches)
        return nn.losses.cross_entropy(head.logits(h)[:, :-1], tokens[:, 2:]).mean()

    opt = optim.Adam(learning_rate=3e-3)
    step = nn.value_and_grad(head.module, loss_fn)
    losses = []
    for _ in range(steps):
        loss, grads = step(head.module)
        opt.update(head.module, grads)
        mx.eval(head.module.parameters(), opt.state, loss)
        losses.append(float(loss))
    return {"first_loss": losses[0], "last_loss": losses[-1]}


def train_eagle3(
    path: Path, target: Path, prompts: list[list[int]], steps: int = 300, new: int = 48
) -> dict[str, float]:
    """Train the EAGLE-3 drafter at ``path`` (``worker.dev.tinydrafters.write_eagle3``)
    for ``target`` (:func:`train`) and save it in place."""
    from mlx_lm import load

    from worker.engine import heads

    model, _ = load(str(target))
    module, _ = heads.load(Path(path))
    losses = train(heads.bind(module, model), model, prompts, steps, new)
    weights = dict(tree_flatten(module.parameters()))
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
