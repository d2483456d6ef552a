"""Kept prefixes on disk (``worker --prefix-cache-dir``): a new worker starts from what
another wrote, on every cache type, alone and speculative; bad files never fail a job."""

from __future__ import annotations

import logging

import pytest

from producer import Client
from schemas import ChatRequest
from schemas.store import read_result
from tests.conftest import chat
from worker.dev.tinymodels import ARCHS, TinySpec, ensure_model
from worker.engine.generator import ChatGenerator
from worker.engine.models import ModelCache
from worker.engine.prefixdisk import SUFFIX, PrefixDisk

SYSTEM = "You answer questions about the queue, its workers, models and batches. " * 6


def _req(model: str, question: str, draft: str | None = None) -> ChatRequest:
    body = chat(model, question, max_tokens=24, temperature=0)
    body["messages"].insert(0, {"role": "system", "content": SYSTEM})
    if draft:
        body["draft_model"] = draft
    return ChatRequest.model_validate(body)


def _run(cache: ModelCache, req: ChatRequest):
    gen = ChatGenerator.get_or_create(req.model, req.draft_model, cache=cache)
    return gen.generate(req, use_draft=req.draft_model is not None)


def _disk_cache(path) -> ModelCache:
    return ModelCache(prefix_disk=PrefixDisk(path))


def _files(path) -> list:
    return sorted(p for p in path.iterdir() if p.name.endswith(SUFFIX) and p.name[0] != ".")


@pytest.fixture(scope="module", params=ARCHS)
def arch_model(request, tmp_path_factory) -> str:
    root = tmp_path_factory.mktemp(f"disk-{request.param}")
    spec = TinySpec(arch=request.param, layers=4, hidden=64, intermediate=128, seed=1)
    return str(ensure_model(root / "model", spec))


def test_a_new_worker_starts_from_what_another_wrote_on_every_cache_type(arch_model, tmp_path):
    want = _run(ModelCache(prefix_bytes=0), _req(arch_model, "which worker?"))
    first = _disk_cache(tmp_path)
    _run(first, _req(arch_model, "how many batches?"))  # keeps the system prompt's prefix
    first.prefixes.disk.flush()
    assert len(_files(tmp_path)) == 1
    second = _disk_cache(tmp_path)  # a restarted worker: nothing in memory
    got = _run(second, _req(arch_model, "which worker?"))
    assert second.prefixes.stats.disk_hits == 1 and got.cached_tokens > 0
    assert got.token_ids == want.token_ids and got.text == want.text


def test_speculative_jobs_take_the_draft_prefix_from_disk_too(tiny, tmp_path):
    req = _req(tiny.target, "which worker?", draft=tiny.draft)
    want = _run(ModelCache(prefix_bytes=0), req)
    first = _disk_cache(tmp_path)
    _run(first, _req(tiny.target, "how many batches?", draft=tiny.draft))
    first.prefixes.disk.flush()
    assert len(_files(tmp_path)) == 2  # the target's entry and the draft's (other weights)
    second = _disk_cache(tmp_path)
    got = _run(second, req)
    assert second.prefixes.stats.disk_hits == 2 and got.cached_tokens > 0
    assert got.token_ids == want.token_ids and got.draft_tokens_proposed > 0


def test_a_copy_of_the_weights_under_another_name_is_one_model_on_disk(tiny, tmp_path):
    first = _disk_cache(tmp_path)
    _run(first, _req(tiny.target, "how many batches?"))
    first.prefixes.disk.flush()
    second = _disk_cache(tmp_path)
    got = _run(second, _req(tiny.twin, "which worker?"))  # (a copy of the target)
    assert second.prefixes.stats.disk_hits == 1 and got.cached_tokens > 0


def test_entries_follow_the_weights_not_the_name(tiny, tmp_path):
    """A file written for one model's weights is never used for another's, whatever it is
    called: the draft (other weights) finds nothing of the target's."""
    first = _disk_cache(tmp_path)
    _run(first, _req(tiny.target, "how many batches?"))
    first.prefixes.disk.flush()
    second = _disk_cache(tmp_path)
    want = _run(ModelCache(prefix_bytes=0), _req(tiny.draft, "which worker?"))
    got = _run(second, _req(tiny.draft, "which worker?"))
    assert second.prefixes.stats.disk_hits == 0 and got.token_ids == want.token_ids


def test_corrupt_truncated_and_foreign_files_are_skipped_deleted_and_never_fail_a_job(
    tiny, tmp_path, caplog
):
    first = _disk_cache(tmp_path)
    _run(first, _req(tiny.target, "how many batches?"))
    first.prefixes.disk.flush()
    (good,) = _files(tmp_path)
    data = good.read_bytes()
    (tmp_path / f"random{SUFFIX}").write_bytes(b"\x00\x01garbage" * 100)
    (tmp_path / f"short{SUFFIX}").write_bytes(data[:5])
    (tmp_path / f"cut{SUFFIX}").write_bytes(data[: len(data) // 2])  # header whole, arrays cut
    foreign = data.replace(b"mlxq-prefix-1", b"mlxq-prefix-9")
    (tmp_path / f"foreign{SUFFIX}").write_bytes(foreign)
    good.write_bytes(data[: len(data) - 100])  # the only match, truncated
    with caplog.at_level(logging.WARNING, logger="worker.engine.prefixdisk"):
        second = _disk_cache(tmp_path)
        want = _run(ModelCache(prefix_bytes=0), _req(tiny.target, "which worker?"))
        got = _run(second, _req(tiny.target, "which worker?"))
    assert got.token_ids == want.token_ids and second.prefixes.stats.disk_hits == 0
    skipped = [r.getMessage() for r in caplog.records if "skipped and deleted" in r.getMessage()]
    assert len(skipped) == 5, skipped  # one warning each
    for name in ("random", "short", "cut", "foreign"):
        assert not (tmp_path / f"{name}{SUFFIX}").exists()
    # The job made its own entry again, and wrote it.
    second.prefixes.disk.flush()
    assert len(_files(tmp_path)) == 1


def test_a_file_whose_layers_are_not_the_models_is_deleted(tiny, tmp_path, tmp_path_factory):
    """Same identity, other layers (as a file written by another mlx-lm for other caches
    would be): checked against the model's own caches, skipped and deleted."""
    other = ensure_model(
        tmp_path_factory.mktemp("other") / "m",
        TinySpec(arch="gemma3_text", layers=4, hidden=64, intermediate=128, seed=1),
    )
    first = _disk_cache(tmp_path)
    _run(first, _req(str(other), "how many batches?"))
    first.prefixes.disk.flush()
    second = _disk_cache(tmp_path)
    _run(second, ChatRequest.model_validate(chat(tiny.target, "warm up", max_tokens=2)))
    (theirs,) = _files(tmp_path)
    mine = second.prefixes._ids[(tiny.target, None)]
    renamed = theirs.read_bytes().replace(theirs.name.split("-")[0].encode(), mine.encode())
    theirs.write_bytes(renamed)
    second.prefixes.disk._seen_mtime = -1.0  # (same second: look again)
    want = _run(ModelCache(prefix_bytes=0), _req(tiny.target, "which worker?"))
    got = _run(second, _req(tiny.target, "which worker?"))
    assert got.token_ids == want.token_ids and second.prefixes.stats.disk_hits == 0
    assert not theirs.exists()


def test_two_writers_on_one_directory_leave_whole_files(tiny, tmp_path):
    caches = [_disk_cache(tmp_path) for _ in range(2)]
    for c in caches:  # both queue the same entry; their writer threads write at once
        _run(c, _req(tiny.target, "how many batches?"))
    for c in caches:
        c.prefixes.disk.flush()
    assert len(_files(tmp_path)) == 1  # the same entry twice: one file, renamed into place whole
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temporary
    third = _disk_cache(tmp_path)
    got = _run(third, _req(tiny.target, "which worker?"))
    assert third.prefixes.stats.disk_hits == 1 and got.cached_tokens > 0


def test_a_failing_disk_turns_itself_off_and_jobs_go_on(tiny, tmp_path, caplog, monkeypatch):
    import worker.engine.prefixdisk as prefixdisk

    def full(*_a, **_k):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(prefixdisk.os, "replace", full)
    cache = _disk_cache(tmp_path)
    with caplog.at_level(logging.WARNING, logger="worker.engine.prefixdisk"):
        _run(cache, _req(tiny.target, "how many batches?"))
        cache.prefixes.disk.flush()
        got = _run(cache, _req(tiny.target, "which worker?"))
    assert not cache.prefixes.disk.enabled and got.cached_tokens > 0  # memory still serves
    assert sum("off for this worker" in r.getMessage() for r in caplog.records) == 1
    assert not list(tmp_path.iterdir())  # no file, no temporary left


def test_the_directory_keeps_to_its_size_least_recently_used_first(tiny, tmp_path):
    first = _disk_cache(tmp_path)
    _run(first, _req(tiny.target, "how many batches?"))
    first.prefixes.disk.flush()
    (one,) = _files(tmp_path)
    size = one.stat().st_size
    disk = PrefixDisk(tmp_path, int(size * 1.8))  # room for one entry
    cache = ModelCache(prefix_disk=disk)
    body = chat(tiny.target, "which worker?", max_tokens=4, temperature=0)
    other = SYSTEM.replace("queue", "fleet")  # as long, another prefix
    body["messages"].insert(0, {"role": "system", "content": other})
    _run(cache, ChatRequest.model_validate(body))  # another prefix: the older file goes
    disk.flush()
    (kept,) = _files(tmp_path)
    assert kept != one


def test_worker_processes_share_the_directory(conn, redis_url, tiny, tmp_path, workers):
    disk = tmp_path / "prefixes"
    client = Client(connection=conn)
    first = client.submit([_req(tiny.target, "how many batches?")], batch_id="one")
    workers("--burst", "--prefix-cache-dir", str(disk)).wait(120)
    assert read_result(conn, first.job_ids[0]).status == "succeeded"
    assert _files(disk)  # written before the first process exited
    second = client.submit([_req(tiny.target, "which worker?")], batch_id="two")
    w = workers("--burst", "--prefix-cache-dir", str(disk), name="w2")
    assert w.wait(120) == 0
    record = read_result(conn, second.job_ids[0])
    want = _run(ModelCache(prefix_bytes=0), _req(tiny.target, "which worker?"))
    assert record.response.usage.prompt_tokens_details.cached_tokens > 0
    assert record.response.choices[0].message.content == want.text
