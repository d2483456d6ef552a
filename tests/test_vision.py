"""Images in chat jobs: tiny Gemma 3 and 4, Mistral 3, SmolVLM (Idefics 3, SmolVLM 2) and Qwen2-VL /
Qwen2.5-VL / Qwen3-VL VLMs through the real queue, against mlx-vlm itself.

The models are built with mlx-vlm's own classes (worker.dev.tinyvlm) and loaded by
``mlx_vlm.load`` for the reference and by the worker (mlx-lm's language model plus
mlx-vlm's vision tower). Greedy text must equal mlx-vlm's ``generate`` on every path a
job takes; hostile images fail their own job with a clear 400 and nothing else.
"""

from __future__ import annotations

import base64
import hashlib
import io
import json
import signal
from pathlib import Path

import pytest

pytest.importorskip("mlx_vlm")
pytest.importorskip("PIL")

import mlx.core as mx
import numpy as np
from PIL import Image

from producer import Client
from schemas import ChatRequest, InvalidRequestError, keys
from schemas.store import read_result
from worker.dev.tinyvlm import ARCHS, ensure_vlm
from worker.engine.generator import ChatGenerator
from worker.engine.images import ImageCache
from worker.engine.models import ModelCache
from worker.runner.runtime import WorkerRuntime
from worker.schedule.policy import SpeculationPolicy

from .conftest import run_jobs, run_worker
from .test_imagehead import png_declaring

TOKENS = 10
QUESTIONS = ["describe the queue", "what is the batch", "name the worker model"]


@pytest.fixture(scope="module", params=ARCHS)
def vlm(request, tmp_path_factory):
    """A tiny VLM of each architecture (Gemma 3: SigLIP pooled, sliding-window layers;
    Mistral 3: Pixtral, merged patches with row breaks; SmolVLM: pixel-shuffled patches
    between fake tokens, a llama language model mlx-lm does not read as a VLM's; Qwen2-VL
    and Qwen2.5-VL: 3 x 2 merged patches at 2-D positions, mRoPE; Qwen3-VL and its MoE:
    interleaved mRoPE and deepstack features)."""
    root = tmp_path_factory.mktemp("vlm")
    return str(ensure_vlm(root / f"tiny-{request.param}-vlm", arch=request.param))


@pytest.fixture(scope="module")
def vlm_draft(vlm):
    """Other weights, the same tokenizer: a compatible draft (it reads the image tokens as
    tokens; the target's text is exact all the same)."""
    arch = json.loads((Path(vlm) / "config.json").read_text())["model_type"]
    return str(ensure_vlm(Path(vlm).parent / f"tiny-{arch}-draft", seed=1, arch=arch))


def png(seed: int, size: tuple[int, int] = (64, 80)) -> bytes:
    pixels = (np.random.RandomState(seed).rand(size[1], size[0], 3) * 255).astype("uint8")
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="PNG")
    return out.getvalue()


def data_url(data: bytes, kind: str = "png") -> str:
    return f"data:image/{kind};base64,{base64.b64encode(data).decode()}"


def job(model: str, question: str, image: bytes | str, **fields) -> dict:
    url = image if isinstance(image, str) else data_url(image)
    content = [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": question}]
    return {
        "model": model,
        "messages": [{"role": "user", "content": content}],
        "max_tokens": TOKENS,
        "temperature": 0,
    } | fields


def reference(model_path: str, question: str, image: bytes, system: str | None = None) -> str:
    """mlx-vlm's own greedy generation of the same request."""
    from mlx_vlm import generate, load

    model, processor = load(model_path)
    messages = [
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": question}]}
    ]
    if system is not None:
        messages.insert(0, {"role": "system", "content": system})
    prompt = processor.tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=False
    )
    pil = Image.open(io.BytesIO(image)).convert("RGB")
    out = generate(model, processor, prompt, image=[pil], max_tokens=TOKENS, temperature=0.0)
    return out.text


def texts(records: dict) -> dict:
    for c, r in records.items():
        assert r.status == "succeeded", (c, r.error)
    return {c: r.response.choices[0].message.content for c, r in records.items()}


def test_image_jobs_equal_mlx_vlm_alone_batched_and_from_a_kept_image(conn, redis_url, vlm):
    images = [png(1), png(2)]
    jobs = {f"i{i}-q{q}": job(vlm, QUESTIONS[q], images[i]) for i in range(2) for q in range(3)}
    want = {c: reference(vlm, QUESTIONS[int(c[-1])], images[int(c[1])]) for c in jobs}
    assert want["i0-q0"] != want["i1-q0"], "the images must change the text"
    cache = ModelCache()
    alone = texts(run_jobs(conn, redis_url, jobs, "vision-alone", cache=cache))
    assert alone == want
    # Each image was stored once with its batch, and read and decoded once by the worker.
    stored = conn.hgetall(keys.batch_images_key("vision-alone"))
    assert sorted(stored.values()) == sorted(images)
    data = conn.hget(keys.rq_job_key(keys.job_id_for("vision-alone", "i0-q0")), "data")
    assert len(data) < 2000, len(data)  # the reference, not the image
    vision = cache.entries()[0].vision
    assert vision.images.decoded == 2
    # Batched (joins and leaves mid-batch: max_tokens differ), the images kept from above.
    mixed = {c: j | {"max_tokens": TOKENS - 3 * (i % 2)} for i, (c, j) in enumerate(jobs.items())}
    batched = run_jobs(conn, redis_url, mixed, "vision-batch", max_batch=4, cache=cache)
    got = texts(batched)
    for i, c in enumerate(jobs):
        short = TOKENS - 3 * (i % 2)
        assert want[c].startswith(got[c]) and len(got[c]) > 0, (c, got[c], want[c], short)
    reused = [r.response.usage.prompt_tokens_details.cached_tokens for r in batched.values()]
    assert all(n > 0 for n in reused), reused  # every image's prefill was kept
    # Text jobs on the same VLM join the same batch as image jobs, each as it runs alone.
    text = {f"t{q}": job(vlm, QUESTIONS[q], png(1)) for q in range(2)}
    for body in text.values():
        body["messages"][0]["content"] = QUESTIONS[0]
    both = run_jobs(conn, redis_url, jobs | text, "vision-mixed", max_batch=8, cache=cache)
    assert {c: t for c, t in texts(both).items() if c in jobs} == want
    text_alone = texts(run_jobs(conn, redis_url, text, "vision-text", cache=cache))
    assert {c: t for c, t in texts(both).items() if c in text} == text_alone
    assert max(r.metrics.batch_size for r in both.values()) > 2
    # With the prefix cache off, on a fresh cache, batched: the same text again.
    plain = run_jobs(
        conn, redis_url, jobs, "vision-nocache", max_batch=3, cache=ModelCache(prefix_bytes=0)
    )
    assert texts(plain) == want


def test_a_shared_system_prompt_before_different_images_is_prefilled_once(conn, redis_url, vlm):
    system = " ".join(["extract every field of the queue worker batch record"] * 8)
    images = [png(30), png(31), png(32)]
    jobs = {}
    for i, image in enumerate(images):
        body = job(vlm, QUESTIONS[0], image)
        body["messages"].insert(0, {"role": "system", "content": system})
        jobs[f"i{i}"] = body
    got = run_jobs(conn, redis_url, jobs, "vision-system")
    for i, image in enumerate(images):
        want = reference(vlm, QUESTIONS[0], image, system)
        assert texts(got)[f"i{i}"] == want
    cached = [got[f"i{i}"].response.usage.prompt_tokens_details.cached_tokens for i in range(3)]
    assert cached[0] == 0 and cached[1] == cached[2] >= 32, cached  # the system prompt's


def test_image_jobs_speculate_and_give_n_choices(conn, redis_url, vlm, vlm_draft):
    image = png(3)
    want = reference(vlm, QUESTIONS[0], image)
    cache = ModelCache()
    lookup = {"speculation": {"method": "prompt_lookup"}}
    draft = {"draft_model": vlm_draft}
    for name, fields, batch in [
        ("lookup", lookup, 1),
        ("lookup-batch", lookup, 2),
        ("draft", draft, 1),
        ("draft-batch", draft, 2),
    ]:
        jobs = {f"{name}{k}": job(vlm, QUESTIONS[0], image, **fields) for k in range(2)}
        records = run_jobs(
            conn,
            redis_url,
            jobs,
            f"vision-{name}",
            max_batch=batch,
            cache=cache,
            policy=SpeculationPolicy("always"),
        )
        assert set(texts(records).values()) == {want}, (name, texts(records))
        method = "draft" if "draft" in name else "prompt_lookup"
        assert all(r.metrics.speculation_method == method for r in records.values()), name
        if method == "draft":  # (a lookup proposes only what the text repeats)
            assert all(r.metrics.draft_tokens_proposed > 0 for r in records.values()), name
    n = run_jobs(
        conn, redis_url, {"n": job(vlm, QUESTIONS[0], image, n=2)}, "vision-n", cache=cache
    )
    choices = n["n"].response.choices
    assert [c.message.content for c in choices] == [want, want]
    shaped = {
        "json": job(vlm, QUESTIONS[0], image, response_format={"type": "json_object"}),
        "logprobs": job(vlm, QUESTIONS[0], image, logprobs=True, top_logprobs=2),
    }
    got = run_jobs(conn, redis_url, shaped, "vision-shaped", max_batch=2, cache=cache)
    texts(got)
    assert got["json"].response.choices[0].message.content.lstrip().startswith("{")
    entries = got["logprobs"].response.choices[0].logprobs.content
    joined = "".join(e.token for e in entries)  # (a Metaspace first token keeps its space)
    assert joined.lstrip() == want.lstrip(), (joined, want)
    assert all(len(e.top_logprobs) == 2 for e in entries)


def test_an_image_on_a_text_model_and_hostile_images_fail_alone(conn, redis_url, vlm, tiny):
    good = png(4)
    bomb = png_declaring(30_000, 30_000)
    truncated = good[: len(good) // 2]
    svg = b'<svg xmlns="http://www.w3.org/2000/svg" width="10" height="10"></svg>'
    jobs = {
        "good": job(vlm, QUESTIONS[0], good),
        "bomb": job(vlm, QUESTIONS[0], bomb),
        "truncated": job(vlm, QUESTIONS[0], truncated),
        "svg": job(vlm, QUESTIONS[0], data_url(svg, "svg+xml")),
        "base64": job(vlm, QUESTIONS[0], "data:image/png;base64,AAAAA"),
        "text-model": job(tiny.target, QUESTIONS[0], good),
        "good2": job(vlm, QUESTIONS[1], good),
    }
    # Past the door (``schemas.images.check_images`` refuses these at submit): as a job
    # written to Redis by other means, the worker's own checks fail each alone.
    from producer.submit import SubmitItem, submit_items

    items = [SubmitItem(c, ChatRequest.model_validate(b), b) for c, b in jobs.items()]
    s = submit_items(conn, items, batch_id="vision-hostile")
    rt = WorkerRuntime(cache=ModelCache(), worker_id="vision-hostile")
    run_worker(redis_url, runtime=rt, max_batch=4)
    records = {r.custom_id: r for r in (read_result(conn, j) for j in s.job_ids)}
    ok = {c for c, r in records.items() if r.status == "succeeded"}
    assert ok == {"good", "good2"}, {c: r.error for c, r in records.items()}
    expect = {
        "bomb": "declares more pixels than the 40,000,000",
        "truncated": "could not be decoded",
        "svg": "not a PNG, JPEG, WebP or GIF",
        "base64": "not valid base64",
        "text-model": "is a text model: it reads no images",
    }
    for c, words in expect.items():
        error = records[c].error
        assert error.type == "invalid_request_error" and words in error.message, (c, error)
        assert "image 1" in error.message or c == "text-model", error.message


def test_a_stored_image_is_read_from_its_own_batch_only(conn, redis_url, vlm):
    image, cache = png(7), ModelCache()
    first = run_jobs(
        conn, redis_url, {"a": job(vlm, QUESTIONS[0], image)}, "vision-own", cache=cache
    )
    assert texts(first)["a"] == reference(vlm, QUESTIONS[0], image)
    # A job of another batch naming that image's reference: not its batch's, refused, though
    # this worker holds the image decoded.
    ref = f"mlxq-image:{hashlib.sha256(image).hexdigest()}"
    other = run_jobs(
        conn, redis_url, {"b": job(vlm, QUESTIONS[0], ref)}, "vision-other", cache=cache
    )
    assert "is not stored with this job's batch" in other["b"].error.message
    # A stored image changed in Redis no longer matches its name.
    key = keys.batch_images_key("vision-own")
    conn.hset(key, ref.split(":")[1], png(8))
    again = run_jobs(conn, redis_url, {"c": job(vlm, QUESTIONS[0], ref)}, "vision-own")
    assert "do not match their SHA-256" in again["c"].error.message
    # A worker's --max-image-mb, below this image's size: a 400 for it.
    small = ModelCache(max_image_bytes=1000)
    capped = run_jobs(
        conn, redis_url, {"d": job(vlm, QUESTIONS[0], image)}, "vision-cap", cache=small
    )
    assert "the limit is" in capped["d"].error.message, capped["d"].error


def test_a_jobs_file_stores_each_image_once_and_runs_like_the_client(
    tmp_path, conn, redis_url, vlm
):
    from click.testing import CliRunner

    from producer.cli import main

    image = png(9)
    plain = {"custom_id": "plain", **job(vlm, QUESTIONS[0], image)}
    batch_api = {
        "custom_id": "api",
        "method": "POST",
        "url": "/v1/chat/completions",
        "body": job(vlm, QUESTIONS[1], image),
    }
    broken = {"custom_id": "broken", **job(vlm, QUESTIONS[0], "data:image/png;base64,AAAAA")}
    path = tmp_path / "images.jsonl"
    path.write_text("".join(json.dumps(x) + "\n" for x in (plain, batch_api, broken)))
    args = ["submit", str(path), "--redis-url", redis_url, "--batch-id", "vision-file"]
    refused = CliRunner().invoke(main, args, catch_exceptions=False)
    assert refused.exit_code == 2, refused.output  # the broken image, at the door
    assert "images.jsonl:3: messages.0.content.0: image 1: the data URL is not valid base64" in (
        refused.output
    )
    assert conn.llen(keys.rq_queue_key("mlxq")) == 0  # nothing enqueued
    result = CliRunner().invoke(main, [*args, "--skip-invalid"], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    assert conn.hlen(keys.batch_images_key("vision-file")) == 1  # two jobs, one image
    run_worker(redis_url, max_batch=2)
    got = {c: read_result(conn, keys.job_id_for("vision-file", c)) for c in ("plain", "api")}
    assert got["plain"].response.choices[0].message.content == reference(vlm, QUESTIONS[0], image)
    assert got["api"].response.choices[0].message.content == reference(vlm, QUESTIONS[1], image)
    assert read_result(conn, keys.job_id_for("vision-file", "broken")) is None  # never queued


@pytest.fixture
def image_server():
    """A local HTTP server: /a.png (an image), /same (a redirect to it), /meta (a redirect
    to the cloud metadata address); it counts the image's requests."""
    import http.server
    import threading

    image, hits = png(10), []

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            if self.path == "/a.png":
                hits.append(self.path)
                self.send_response(200)
                self.send_header("Content-Length", str(len(image)))
                self.end_headers()
                self.wfile.write(image)
                return
            target = {"/same": "/a.png", "/meta": "http://169.254.169.254/latest/meta-data"}
            self.send_response(302 if self.path in target else 404)
            self.send_header("Location", target.get(self.path, "/"))
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}", image, hits
    server.shutdown()


def test_image_urls_only_from_allowed_hosts_never_internal_by_glob(
    conn, redis_url, vlm, image_server
):
    from worker.runner.imagehosts import ImageHosts

    base, image, hits = image_server
    want = reference(vlm, QUESTIONS[0], image)
    urls = {
        "direct": f"{base}/a.png",
        "redirected": f"{base}/same",
        "again": f"{base}/a.png",
        "to-metadata": f"{base}/meta",
        "metadata": "http://169.254.169.254/latest/meta-data",
        "missing": f"{base}/nothing",
    }
    jobs = {c: job(vlm, QUESTIONS[0], url) for c, url in urls.items()}
    hosts = ImageHosts(("127.0.0.1",))  # named exactly: a loopback host is allowed
    got = run_jobs(conn, redis_url, jobs, "vision-urls", image_hosts=hosts)
    ok = {
        c: r.response.choices[0].message.content for c, r in got.items() if r.status == "succeeded"
    }
    assert ok == {"direct": want, "redirected": want, "again": want}, {
        c: r.error for c, r in got.items()
    }
    assert len(hits) == 2  # "again" came from the worker's cache (the redirect's fetch: 1)
    assert "host '169.254.169.254' is not allowed" in got["to-metadata"].error.message
    assert "host '169.254.169.254' is not allowed" in got["metadata"].error.message
    assert "answered HTTP 404" in got["missing"].error.message
    # A glob never reaches an internal address; no rule at all fetches nothing.
    for rules, words in [(("*",), "resolves to an internal address"), ((), "fetches no image")]:
        one = {"u": job(vlm, QUESTIONS[0], f"{base}/a.png")}
        refused = run_jobs(
            conn, redis_url, one, f"vision-{len(rules)}", image_hosts=ImageHosts(rules)
        )
        assert words in refused["u"].error.message, refused["u"].error


@pytest.mark.slow  # (a lease runs out: the full suite's, not the quick tier's)
def test_sigkill_mid_batch_of_image_jobs_gives_one_record_each(
    conn, redis_url, workers, tmp_path_factory
):
    """Image jobs batched with a text job on a VLM, the worker killed while they decode:
    another worker recovers every job, one record each, with the same text as alone."""
    from tests.test_faults import one_result, running_execution
    from tests.waiting import wait_for

    vlm = str(ensure_vlm(tmp_path_factory.getbasetemp() / "kill-vlm"))
    eos = json.loads((Path(vlm) / "config.json").read_text())["eos_token_id"]
    long = {"max_tokens": 1500, "logit_bias": {str(t): -100 for t in eos}}  # seconds to kill
    jobs = {f"i{i}": job(vlm, QUESTIONS[i], png(20 + i), **long) for i in range(2)}
    jobs["text"] = {**jobs["i0"], "messages": [{"role": "user", "content": QUESTIONS[2]}]}
    s = Client(connection=conn).submit(jobs, batch_id="vision-kill")
    args = ("--lease-seconds", "2", "--max-batch", "4")
    a = workers(*args, name="vision-a")
    wait_for(lambda: all(running_execution(conn, j) for j in s.job_ids))
    a.signal(signal.SIGKILL)
    a.wait()
    b = workers(*args, name="vision-b")
    records = {r.custom_id: r for r in (one_result(conn, j, timeout=180) for j in s.job_ids)}
    assert all(r.status == "succeeded" for r in records.values()), records
    assert all(r.response.usage.completion_tokens == 1500 for r in records.values())
    assert all(conn.get(keys.crashes_key(j)) == b"1" for j in s.job_ids)
    b.signal(signal.SIGTERM)
    assert b.wait() == 0
    alone = run_jobs(conn, redis_url, {"again": jobs["i1"]}, "vision-kill-alone")
    assert alone["again"].response.choices[0].message.content == texts(records)["i1"]


def test_image_size_cap_and_cache(vlm):
    cache = ImageCache(size=2, max_bytes=1000)
    with pytest.raises(InvalidRequestError, match=r"MB image limit|the limit is"):
        cache.get(data_url(png(5, (200, 200))), "image 1")
    small = data_url(png(6, (8, 8)))
    first = cache.get(small, "image 1")
    assert cache.get(small, "image 2") is first and cache.decoded == 1
    gif = io.BytesIO()
    Image.new("RGB", (9, 7), (255, 0, 0)).save(gif, format="GIF")
    assert cache.get(data_url(gif.getvalue(), "gif"), "image 3").size == (9, 7)


def test_images_refused_where_they_are_not_read(vlm):
    with pytest.raises(ValueError, match="'file' image URL is not read"):
        ChatRequest.model_validate(job(vlm, "q", "file:///etc/passwd"))
    huge = "data:image/png;base64," + "A" * (25 * 2**20 * 4 // 3)  # a 25 MB image
    with pytest.raises(ValueError, match="the image is over 20 MB"):
        ChatRequest.model_validate(job(vlm, "q", huge))
    with pytest.raises(ValueError, match="with a host"):
        ChatRequest.model_validate(job(vlm, "q", "https:///a.png"))
    system = job(vlm, "q", png(1))
    system["messages"][0]["role"] = "system"
    with pytest.raises(ValueError, match="images go in user messages"):
        ChatRequest.model_validate(system)
    gen = ChatGenerator.get_or_create(vlm, cache=ModelCache())
    assert gen.target.vision is not None and gen.target.vision.nbytes > 0
    tail = job(vlm, "q", png(1))
    tail["messages"][0]["content"].reverse()  # the image last: the template still ends after
    prepared = gen.prepare(ChatRequest.model_validate(tail))
    assert prepared.vision is not None and prepared.vision.end < len(prepared.prompt)


def test_what_mrope_vlms_refuse_by_name():
    """GLM-4V's mRoPE is not run: an image on it fails naming why."""
    from worker.engine.vision import can_see

    for kind in ("glm4v", "glm4v_moe"):  # (what a model's load says of its images)
        why = can_see({"model_type": kind, "vision_config": {}})
        assert why is not None and "mRoPE" in why and kind in why
    for kind in ("qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe"):
        assert can_see({"model_type": kind, "vision_config": {}}) is None


def test_image_jobs_on_quantized_kv_caches_alone_batched_and_kept(conn, redis_url, vlm):
    """``--kv-bits 8`` with images, on every architecture (mRoPE's turned keys quantized
    again; each VLM with heads of 32): the same text alone, batched with joins and leaves,
    and from a kept image prefix; the records say 8 bits; the image changes the text."""
    from worker.engine.kvquant import KVQuant

    arch = json.loads((Path(vlm) / "config.json").read_text())["model_type"]
    vlm = str(ensure_vlm(Path(vlm).parent / f"tiny-{arch}-wide", arch=arch, wide=True))
    kv = KVQuant(8, 32)  # (the tiny VLMs' heads are 32 wide here)
    images = [png(1), png(2)]
    jobs = {f"i{i}-q{q}": job(vlm, QUESTIONS[q], images[i]) for i in range(2) for q in range(2)}
    cold = ModelCache(prefix_bytes=0, kv_quant=kv)
    alone = run_jobs(conn, redis_url, jobs, "kv-alone", cache=cold)
    want = texts(alone)
    assert want["i0-q0"] != want["i1-q0"], "the images must change the text"
    assert {r.metrics.kv_bits for r in alone.values()} == {8}
    kept = ModelCache(kv_quant=kv)
    mixed = {c: j | {"max_tokens": TOKENS - 3 * (i % 2)} for i, (c, j) in enumerate(jobs.items())}
    for name in ("kv-batch", "kv-again"):  # the second from the image prefixes kept
        batched = run_jobs(conn, redis_url, mixed, name, max_batch=4, cache=kept)
        for c, text in texts(batched).items():
            assert want[c].startswith(text) and text, (name, c, text, want[c])
    reused = [r.response.usage.prompt_tokens_details.cached_tokens for r in batched.values()]
    assert all(n > 0 for n in reused), reused
    assert max(r.metrics.batch_size for r in batched.values()) > 1


def test_a_quantized_image_prefix_gives_about_the_logits_of_a_plain_one(vlm):
    """The first token's log-probabilities after an image prefix prefilled into 8-bit KV
    caches are within 8-bit error of those after a plain one, on every architecture: for
    mRoPE's, only if the kept keys were turned (not turning quantized ones: 0.39-2.5 off
    on these tiny models; turned: at most 0.10)."""
    from worker.engine.kvquant import KVQuant

    arch = json.loads((Path(vlm) / "config.json").read_text())["model_type"]
    vlm = str(ensure_vlm(Path(vlm).parent / f"tiny-{arch}-wide", arch=arch, wide=True))
    out = []
    for kv in (None, KVQuant(8, 32)):
        gen = ChatGenerator.get_or_create(vlm, cache=ModelCache(prefix_bytes=0, kv_quant=kv))
        prepared = gen.prepare(ChatRequest.model_validate(job(vlm, QUESTIONS[0], png(3))))
        target = gen.target
        assert target.vision is not None and prepared.vision is not None
        cache = target.vision.prefill(
            target.model, prepared.prompt, prepared.vision, target.new_cache()
        )
        assert (target.kv_bits, type(cache[-1]).__name__) in ((None, "KVCache"), (8, "QuantizedKV"))
        rest = mx.array(prepared.prompt[prepared.vision.end :])[None]
        logits = target.model(rest, cache=cache)[0, -1]
        out.append(logits - mx.logsumexp(logits))
    assert mx.abs(out[0] - out[1]).max().item() < 0.2


def test_the_logits_after_an_image_prefix_are_mlx_vlms(vlm):
    """Stronger than equal greedy text: the first token's log-probabilities, after the
    image prefix is prefilled here (mlx-lm's language model; mRoPE turned, deepstack added,
    Gemma 4's ids and scale) and the rest of the prompt runs on the plain path, equal those
    of mlx-vlm's own generation."""
    from mlx_vlm import load, stream_generate

    question = "describe the queue"
    gen = ChatGenerator.get_or_create(vlm, cache=ModelCache(prefix_bytes=0))
    prepared = gen.prepare(ChatRequest.model_validate(job(vlm, question, png(3))))
    target = gen.target
    assert target.vision is not None and prepared.vision is not None
    cache = target.vision.prefill(
        target.model, prepared.prompt, prepared.vision, target.new_cache()
    )
    rest = mx.array(prepared.prompt[prepared.vision.end :])[None]
    logits = target.model(rest, cache=cache)[0, -1]
    ours = logits - mx.logsumexp(logits)
    model, processor = load(vlm)
    messages = [
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": question}]}
    ]
    prompt = processor.tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=False
    )
    pil = Image.open(io.BytesIO(png(3))).convert("RGB")
    first = next(iter(stream_generate(model, processor, prompt, image=[pil], max_tokens=1)))
    theirs = mx.array(first.logprobs).reshape(-1)
    assert first.prompt_tokens == len(prepared.prompt)
    assert mx.abs(ours - theirs).max().item() < 1e-4
