import pytest

from schemas import (
    ChatRequest,
    IncompatibleDraftError,
    ModelNotFoundError,
    ModelTooLargeError,
)
from tests.conftest import chat
from tests.models import write_lora_adapter
from worker.engine.generator import ChatGenerator
from worker.engine.models import ModelCache, weight_bytes


def test_second_use_is_warm(tiny):
    cache = ModelCache()
    first, hit1 = cache.get(tiny.target)
    again, hit2 = cache.get(tiny.target)
    assert (hit1, hit2) == (False, True) and again is first and cache.loads == 1


def test_target_shared_by_two_drafts_and_alone_is_loaded_once(tiny):
    cache = ModelCache()
    a = ChatGenerator.get_or_create(tiny.target, tiny.draft, cache=cache)
    b = ChatGenerator.get_or_create(tiny.target, tiny.twin, cache=cache)
    c = ChatGenerator.get_or_create(tiny.target, cache=cache)
    assert a.target is b.target is c.target
    assert cache.loads == 3  # target, draft, twin
    assert a.has_draft_model() and not c.has_draft_model()
    assert not a.cache_hit and b.target_was_warm and c.cache_hit and c.load_time_s == 0


def test_lru_eviction_under_budget(tiny):
    sizes = {
        m: weight_bytes(__import__("pathlib").Path(m)) for m in (tiny.target, tiny.twin, tiny.draft)
    }
    budget = sizes[tiny.target] + sizes[tiny.twin] + sizes[tiny.draft] // 2
    cache = ModelCache(budget_bytes=budget)
    cache.get(tiny.target)
    cache.get(tiny.twin)
    cache.get(tiny.target)  # twin is now least recently used
    cache.get(tiny.draft)
    names = [e.name for e in cache.entries()]
    assert names == [tiny.target, tiny.draft]
    assert cache.evictions == 1 and cache.used_bytes <= budget


def test_model_larger_than_budget_is_refused_before_loading(tiny):
    cache = ModelCache(budget_bytes=1000)
    with pytest.raises(ModelTooLargeError, match="cache budget"):
        cache.get(tiny.target)
    assert cache.loads == 0 and cache.entries() == []


def test_pinned_and_in_use_models_are_not_evicted(tiny):
    from pathlib import Path

    size = weight_bytes(Path(tiny.target))
    cache = ModelCache(budget_bytes=int(size * 1.5))
    cache.get(tiny.target, pin=True)
    with pytest.raises(ModelTooLargeError, match="pinned or in use"):
        cache.get(tiny.twin)
    assert [e.name for e in cache.entries()] == [tiny.target]


def test_incompatible_tokenizer_names_both_models(tiny):
    with pytest.raises(IncompatibleDraftError) as e:
        ChatGenerator.get_or_create(tiny.target, tiny.alien, cache=ModelCache())
    assert tiny.alien in str(e.value) and tiny.target in str(e.value)


def test_unknown_models_are_clear_errors(tiny, tmp_path, monkeypatch):
    import huggingface_hub.constants as hf

    monkeypatch.setattr(hf, "HF_HUB_OFFLINE", True)
    cache = ModelCache()
    with pytest.raises(ModelNotFoundError, match="no such local directory"):
        cache.get(str(tmp_path / "nope"))
    with pytest.raises(ModelNotFoundError, match="could not be fetched from the hub"):
        cache.get("mlx-community/definitely-not-here-4bit")
    with pytest.raises(ModelNotFoundError, match="nor a valid hub repository id"):
        cache.get("bad name with spaces!")
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ModelNotFoundError, match=r"has no config\.json"):
        cache.get(str(empty))


def test_adapter_changes_output_without_touching_the_shared_base(tiny, tmp_path):
    adapter = write_lora_adapter(tiny.target, tmp_path / "lora")
    cache = ModelCache()
    req = ChatRequest.model_validate(chat(tiny.target, max_tokens=15, temperature=0))
    before = ChatGenerator.get_or_create(tiny.target, cache=cache).generate(req)
    tuned = ChatGenerator.get_or_create(tiny.target, adapter_path=adapter, cache=cache)
    with_adapter = tuned.generate(req)
    after = ChatGenerator.get_or_create(tiny.target, cache=cache).generate(req)
    assert with_adapter.token_ids != before.token_ids
    assert after.token_ids == before.token_ids
    assert cache.loads == 2  # the base once, the adapter once
    base_entry = cache.entries()[-1] if cache.entries()[-1].adapter is None else None
    assert base_entry is not None
    # The adapter entry accounts only for its own LoRA parameters, not a second base.
    adapter_entry = next(e for e in cache.entries() if e.adapter)
    assert adapter_entry.nbytes < base_entry.nbytes / 4
