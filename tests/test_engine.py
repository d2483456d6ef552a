import pytest

from schemas import ChatRequest, ContextLengthError, InvalidRequestError
from tests.conftest import chat
from tests.models import with_eos
from worker.engine.generator import ChatGenerator
from worker.engine.models import ModelCache


@pytest.fixture(scope="module")
def cache():
    return ModelCache()


def run(cache, model, draft=None, **fields):
    fields = {"temperature": 0} | fields | ({"draft_model": draft} if draft else {})
    req = ChatRequest.model_validate(chat(model, **fields))
    return ChatGenerator.get_or_create(model, draft, cache=cache).generate(req)


def test_greedy_with_identical_draft_equals_plain_and_accepts_everything(cache, tiny):
    plain = run(cache, tiny.target, max_tokens=30)
    spec = run(cache, tiny.target, tiny.twin, max_tokens=30, num_draft_tokens=3)
    assert spec.token_ids == plain.token_ids and spec.text == plain.text
    assert len(set(plain.token_ids)) > 5  # the tiny model says something, not one token
    # 30 tokens in rounds of 3 accepted + 1 verified: 7 full rounds + a last round of 2.
    assert spec.draft_tokens_accepted == spec.draft_tokens_proposed == 3 * 7 + 2
    assert spec.acceptance_rate == 1.0


def test_greedy_with_unrelated_draft_equals_plain_and_counts_add_up(cache, tiny):
    plain = run(cache, tiny.target, max_tokens=40)
    k = 4
    spec = run(cache, tiny.target, tiny.draft, max_tokens=40, num_draft_tokens=k)
    assert spec.token_ids == plain.token_ids
    assert spec.completion_tokens == 40
    assert spec.acceptance_rate < 0.5
    # Every round ends with one token of the target's own and a round starting at n
    # drafts min(k, 40 - n) tokens. This random pair never agrees, so each round
    # yields exactly one token: proposed = sum over n < 40 of min(4, 40 - n).
    assert spec.draft_tokens_accepted == 0
    assert spec.draft_tokens_proposed == sum(min(k, 40 - n) for n in range(40)) == 154


def test_max_tokens_gives_length(cache, tiny):
    out = run(cache, tiny.target, max_tokens=7)
    assert out.completion_tokens == 7 and out.finish_reason == "length"
    assert out.prompt_tokens > 0


@pytest.mark.parametrize("draft", [None, "twin", "draft"])
def test_stop_string_trims_text_and_gives_stop(cache, tiny, draft):
    draft = getattr(tiny, draft) if draft else None
    full = run(cache, tiny.target, max_tokens=40).text
    stop = full[len(full) // 2 : len(full) // 2 + 3]
    out = run(cache, tiny.target, draft, max_tokens=40, stop=["never-there", stop])
    assert out.finish_reason == "stop"
    assert out.text == full[: full.find(stop)]
    assert out.completion_tokens < 40


def test_eos_token_gives_stop_and_excludes_it(cache, tiny, tmp_path):
    plain = run(cache, tiny.target, max_tokens=30)
    eos = plain.token_ids[5]
    first = plain.token_ids.index(eos)
    model = with_eos(tiny.target, tmp_path / "eos", eos)
    out = run(cache, model, max_tokens=30)
    assert out.finish_reason == "stop"
    assert out.token_ids == plain.token_ids[: first + 1]
    from mlx_lm import load

    _, tok = load(model)
    assert out.text == tok.decode(list(plain.token_ids[:first]))


def test_seed_makes_sampling_reproducible(cache, tiny):
    a = run(cache, tiny.target, max_tokens=20, temperature=1.0, seed=7)
    b = run(cache, tiny.target, max_tokens=20, temperature=1.0, seed=7)
    c = run(cache, tiny.target, max_tokens=20, temperature=1.0, seed=8)
    assert a.token_ids == b.token_ids
    assert a.token_ids != c.token_ids


def test_logit_bias_is_honoured(cache, tiny):
    out = run(cache, tiny.target, max_tokens=6, logit_bias={"42": 100})
    assert out.token_ids == (42,) * 6
    with pytest.raises(InvalidRequestError, match="outside the vocabulary"):
        run(cache, tiny.target, max_tokens=6, logit_bias={"99999": 1})


def test_prompt_longer_than_context_is_refused(cache, tiny):
    with pytest.raises(ContextLengthError, match="maximum context length is 64"):
        run(cache, tiny.small_ctx, content="queue worker " * 80)
    with pytest.raises(ContextLengthError):
        run(cache, tiny.small_ctx, max_tokens=500)
    ok = run(cache, tiny.small_ctx)  # the default limit fits the room left
    assert ok.prompt_tokens + ok.completion_tokens <= 64


ENGINES = ["alone", "alone-draft", "alone-lookup", "batch", "specbatch", "specbatch-lookup"]


def _engine(kind: str, gen: ChatGenerator):
    from worker.engine.batch import BatchEngine
    from worker.engine.single import SingleEngine
    from worker.engine.specbatch import SpecBatchEngine

    return {
        "alone": lambda: SingleEngine(gen.target),
        "alone-draft": lambda: SpecBatchEngine(gen.target, gen.draft, 3, solo=True),
        "alone-lookup": lambda: SpecBatchEngine(gen.target, None, 3, solo=True),
        "batch": lambda: BatchEngine(gen.target, 4),
        "specbatch": lambda: SpecBatchEngine(gen.target, gen.draft, 3),
        "specbatch-lookup": lambda: SpecBatchEngine(gen.target, None, 3),
    }[kind]()


@pytest.mark.parametrize("kind", ENGINES)
def test_every_path_is_an_engine_with_one_interface(cache, tiny, kind):
    """Every way a sequence runs (alone plain, alone with a draft or prompt lookup, a
    batch, a speculative batch) is an Engine: add, step, lengths, first_token_at, remove,
    run_to_end; the greedy text is the same through each."""
    from worker.engine.protocol import run_to_end

    gen = ChatGenerator.get_or_create(tiny.target, tiny.twin, cache=cache)
    req = ChatRequest.model_validate(chat(tiny.target, temperature=0, max_tokens=12))
    job = gen.prepare(req)
    want = run(cache, tiny.target, max_tokens=12)
    engine = _engine(kind, gen)
    assert len(engine) == 0 and engine.kv_bytes == 0
    pieces: list[str] = []
    engine.add("a", job, on_text=lambda text, _lp: pieces.append(text))
    assert len(engine) == 1 and engine.first_token_at("a") is None
    assert engine.step().prefilled  # (a batch may take a step more to its first token)
    for _ in range(3):
        if engine.first_token_at("a") is not None:
            break
        engine.step()
    assert engine.first_token_at("a") is not None
    held, left = next(iter(engine.lengths().values()))
    assert held == len(job.prompt) + 12 - left and 0 <= left < 12, (held, left)
    assert engine.kv_bytes > 0
    out = run_to_end(engine)["a"]
    assert out.token_ids == want.token_ids and out.text == want.text == "".join(pieces)
    assert len(engine) == 0
    # A sequence removed mid-way gives no output and leaves the engine empty.
    engine = _engine(kind, gen)
    engine.add("b", job)
    engine.step()
    engine.remove("b")
    assert len(engine) == 0 and run_to_end(engine) == {}


def test_a_job_alone_is_one_sequence(cache, tiny):
    from worker.engine.protocol import CannotTake
    from worker.engine.single import SingleEngine
    from worker.engine.specbatch import SpecBatchEngine

    gen = ChatGenerator.get_or_create(tiny.target, tiny.twin, cache=cache)
    job = gen.prepare(ChatRequest.model_validate(chat(tiny.target, max_tokens=4)))
    for engine in (SingleEngine(gen.target), SpecBatchEngine(gen.target, gen.draft, 3, solo=True)):
        engine.add(1, job)
        with pytest.raises(CannotTake, match="one sequence"):
            engine.add(2, job)
        engine.close()
