"""Which drafters run, and how a loaded one is bound to its target.

The kinds (``worker.engine.eagle``'s EAGLE-3 heads, ``worker.engine.mtp``'s MTP heads,
``worker.engine.dflash``'s block drafters) share the speculative engine's round; this
module chooses between them: loading through mlx-vlm (refusing other families by
name), checking a drafter against a target, binding it, and its KV bytes per token.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import mlx.nn as nn

import worker.engine.dflash as dflash
import worker.engine.eagle as eagle
from worker.engine.drafters import Head, drafter_type
from worker.engine.memory import KVProfile
from worker.engine.mtp import QwenMTP, why_not_load
from worker.engine.mtp import why_not as mtp_why_not


def load(path: Path, own: bool = False) -> tuple[nn.Module, dict[str, Any]]:
    """A drafter checkpoint (``own``: the MTP head(s) inside the target checkpoint at
    ``path``) through mlx-vlm's loader, and its config; a ValueError naming the family
    for one mlxq does not run."""
    config = json.loads((path / "config.json").read_text())
    if own:
        why = why_not_load(config)
    else:
        kind = drafter_type(config)
        why = None if kind in eagle.RUNS + dflash.RUNS else f"a {kind} drafter: {_RUNS}"
    if why is not None:
        raise ValueError(why)
    from mlx_vlm.speculative import load_drafter

    module, _ = load_drafter(str(path))
    module.eval()
    if dflash.is_dflash(module) and (why := dflash.why_not_run(module)) is not None:
        raise ValueError(why)
    return module, {"model_type": module.config.model_type} if own else config


_RUNS = (
    "mlxq runs EAGLE-3 and DFlash (qwen3_dflash) drafters, "
    'and Qwen3.5\'s own MTP heads as draft_model "mtp"'
)


def is_mtp(module: nn.Module) -> bool:
    """Whether a loaded drafter is an MTP head (else an EAGLE-3 or DFlash drafter)."""
    return str(getattr(module.config, "model_type", "")).endswith("_mtp")


def kv_profile(module: nn.Module) -> KVProfile:
    """A loaded drafter's KV bytes per sequence: per token, keys and values of each of
    its layers (all full attention)."""
    if is_mtp(module):
        cfg = module.config.text_config
    else:
        cfg = module.config if dflash.is_dflash(module) else module.config.transformer_layer_config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    size = module.layers[0].input_layernorm.weight.dtype.size
    return KVProfile(2 * int(cfg.num_key_value_heads) * int(head_dim) * size * len(module.layers))


def bind(module: nn.Module, target: nn.Module) -> Head:
    """The head for ``module`` (as loaded) bound to ``target``."""
    if is_mtp(module):
        return QwenMTP(module, target)
    return (
        dflash.DFlash(module, target) if dflash.is_dflash(module) else eagle.Eagle3(module, target)
    )


def why_not(module: nn.Module, target: nn.Module, vocab: int) -> str | None:
    """Why ``module`` cannot draft for ``target``, or None."""
    if is_mtp(module):
        return mtp_why_not(module, target)
    if dflash.is_dflash(module):
        return dflash.why_not(module, target, vocab)
    return eagle.why_not(module, target, vocab)
