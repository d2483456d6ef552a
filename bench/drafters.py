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


def train_eagle3(
    path: Path, target: Path, prompts: list[list[int]], steps: int = 300, new: int = 48
) -> dict[str, float]:
    """Train the drafter at ``path`` (written by :func:`write_eagle3`) on ``target``'s own
    greedy continuations of ``prompts`` (``new`` tokens each): each pair (state at p,
    token at p + 1) learns the token at p + 2. Its embedding stays the target's. Saves
    it in place; returns the first and last loss."""
    import mlx.nn as nn
    import mlx.optimizers as optim
    from mlx_lm import load

    from worker.engine import eagle
    from worker.engine.hidden import Tap

    model, _ = load(str(target))
    module, _ = eagle.load(Path(path))
    seqs = [_greedy(model, p, new) for p in prompts]
    width = min(len(s) for s in seqs)
    tokens = mx.array([s[:width] for s in seqs])
    tap = Tap(model, list(module.config.capture_layer_ids))
    with tap:
        model(tokens)
    states = tap.take()
    assert states is not None
    mx.eval(states)
    module.embed_tokens.freeze()

    def loss_fn(m: nn.Module) -> mx.array:
        hidden = m.fc(m.input_norm(states) if m.input_norm is not None else states)
        embeds = m.embed_tokens(tokens[:, 1:])
        h = hidden[:, :-1]
        for i, layer in enumerate(m.layers):
            h = layer(embeds, h, "causal", None, 1) if i == 0 else layer(h, "causal", None, 1)
        h = m.norm(h)
        logits = m.embed_tokens.as_linear(h) if m.lm_head is None else m.lm_head(h)
        return nn.losses.cross_entropy(logits[:, :-1], tokens[:, 2:]).mean()

    opt = optim.Adam(learning_rate=3e-3)
    step = nn.value_and_grad(module, loss_fn)
    first = last = 0.0
    for i in range(steps):
        loss, grads = step(module)
        opt.update(module, grads)
        mx.eval(module.parameters(), opt.state, loss)
        first, last = (float(loss), float(loss)) if i == 0 else (first, float(loss))
    weights = dict(tree_flatten(module.parameters()))
    mx.save_safetensors(str(Path(path) / "model.safetensors"), weights, metadata={"format": "mlx"})
    return {"first_loss": first, "last_loss": last}
