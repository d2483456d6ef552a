"""Running one job alone: plain or speculative decoding, streamed or not, or its n choices.

A job gets here from the worker loop (``worker.runner.loop``) already taken and
started by the lifecycle; what comes back is its result record, which the loop
ends it with. Jobs run by a continuous batch go through ``worker.runner.continuous``.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager

from redis import Redis

from schemas import GenerationError, MlxqError, ResultRecord
from worker.engine.generator import ChatGenerator
from worker.engine.models import LoadedModel
from worker.engine.output import GenerationOutput
from worker.engine.protocol import Steps, Stop, Stopped, drive
from worker.engine.request import Prepared
from worker.engine.sequence import OnText
from worker.lifecycle.held import Job
from worker.lifecycle.streaming import ChunkWriter
from worker.runner import records
from worker.runner.company import Upcoming, company
from worker.runner.images import images_of
from worker.runner.kv import projected
from worker.runner.runtime import WorkerRuntime
from worker.runner.stops import Stops
from worker.runner.streamer import Streamer
from worker.schedule.policy import LOOKUP, Decision, JobSpeed
from worker.schedule.route import Route

log = logging.getLogger(__name__)


def speed_of(out: GenerationOutput) -> JobSpeed:
    """What the speculation policy learns from a finished job. A round that proposed
    nothing (a lookup's miss) counts as a rejection: like one, it emitted one token, so
    the policy's tokens per round stay what the job measured."""
    rejections = out.draft_rejections + out.idle_rounds
    accepted = out.draft_tokens_accepted
    if out.gave_up_after:  # what it measured while speculating (the rest ran plainly)
        return JobSpeed(out.gave_up_after, out.speculated_s, accepted, rejections)
    return JobSpeed(out.completion_tokens, out.decode_s, accepted, rejections)


#: How a job alone holds its KV room while it runs: (bytes, what) -> a context.
Reserve = Callable[[int, str], AbstractContextManager[None]]


def generate_reserved(
    generator: ChatGenerator,
    job: Prepared,
    speculative: bool = False,
    on_text: OnText | None = None,
    stop: Stop | None = None,
    lookup: bool = False,
    give_up_below: float | None = None,
    others: Sequence[Sequence[int]] = (),
    reserve: Reserve | None = None,
) -> Steps[GenerationOutput]:
    """``job`` alone, a step at a time (with the draft when ``speculative``; by prompt
    lookup instead with ``lookup``), its KV caches reserved while it runs (``reserve``;
    by default in the model cache, on top of what a paused batch holds): they must fit,
    or it fails naming the numbers, and kept prefixes keep out of that room.
    ``others``: prompts of jobs queued after it (``worker.runner.company``)."""
    models = _reserved_models(generator, speculative, lookup)
    hold = reserve or generator.models.reserving
    with hold(projected(models, [job.length()]), job.label):
        return (
            yield from generator.generate_steps(
                job,
                on_text=on_text,
                use_draft=speculative,
                stop=stop,
                lookup=job.params.lookup if speculative and lookup else None,
                give_up_below=give_up_below,
                company=others,
            )
        )


def kv_need(job: Job, route: Route, rt: WorkerRuntime, conn: Redis) -> int | None:
    """The KV bytes ``job`` reserves running alone as ``route`` says, or None when a model
    it names is not loaded (loading could evict what a running batch uses). A job that
    cannot even be prepared needs 0: running it fails it, naming why."""
    req = job.envelope.request
    draft = (req.draft_model, None) if req.draft_model else None
    if (req.model, req.adapter) not in rt.cache or (draft and draft not in rt.cache):
        return None
    try:
        generator = ChatGenerator.get_or_create(
            req.model, req.draft_model, req.adapter, cache=rt.cache
        )
        prepared = generator.prepare(  # (its length only: no worker default changes it)
            req, rt.default_num_draft_tokens, images_of(conn, job, rt.image_hosts)
        )
    except MlxqError:
        return 0
    if req.n > 1:  # the choices decode as one plain batch
        return projected([generator.target], [prepared.length()] * req.n)
    models = _reserved_models(generator, route.speculative, route.proposer == LOOKUP)
    return projected(models, [prepared.length()])


def _reserved_models(
    generator: ChatGenerator, speculative: bool, lookup: bool
) -> list[LoadedModel]:
    """The models whose KV caches a job alone holds: the target, and the draft (or the
    drafter) when it speculates with one (prompt lookup has none)."""
    if speculative and generator.proposer is not None and not lookup:
        return [generator.target, generator.proposer]
    return [generator.target]


def _gave_up(decision: Decision, out: GenerationOutput) -> str:
    rate = out.gave_up_after / max(out.speculated_s, 1e-9)
    return (
        f"{decision.reason}; plain after {out.gave_up_after} tokens: speculating measured "
        f"{rate:.1f} tok/s, plain {decision.give_up_below:.1f}"
    )


#: What to do once a job's record is stored: a streamed job's final chunk (a reader
#: that sees the stream end can then read the record), or nothing.
AfterRecord = Callable[[], None] | None


def run_alone(
    job: Job, route: Route, rt: WorkerRuntime, conn: Redis, upcoming: Upcoming | None = None
) -> tuple[ResultRecord, AfterRecord]:
    """Generate ``job`` on its own, to its end (:func:`alone_steps`)."""
    return drive(alone_steps(job, route, rt, conn, upcoming))


def alone_steps(
    job: Job,
    route: Route,
    rt: WorkerRuntime,
    conn: Redis,
    upcoming: Upcoming | None = None,
    reserve: Reserve | None = None,
) -> Steps[tuple[ResultRecord, AfterRecord]]:
    """Generate ``job`` on its own, a step at a time, as ``route`` says
    (``worker.schedule.route``: plain or speculative, k and why, decided when it was
    taken); ``reserve``: how its KV room is held (:func:`generate_reserved`). Whatever
    goes wrong becomes its failed record; only BaseExceptions (a cold shutdown) escape.

    With ``stream: true`` the text is also appended to the job's chunk stream
    (``worker.lifecycle.streaming``) as it is produced; the final chunk (or the error
    chunk) is what the caller runs once it has stored the record.
    """
    req = job.envelope.request
    completion_id = records.new_completion_id()
    ttl = job.envelope.result_ttl
    writer = None
    stop = Stops(conn, rt.time_limit_s).of(job)  # a cancel, a time limit
    try:
        rt.check_request(req)
        generator = ChatGenerator.get_or_create(
            req.model, req.draft_model, req.adapter, cache=rt.cache
        )
        target = generator.target
        if req.stream:
            writer = ChunkWriter(conn, job.id, completion_id, req.model, ttl)
            writer.start()
        prepared = generator.prepare(
            rt.with_defaults(req), rt.default_num_draft_tokens, images_of(conn, job, rt.image_hosts)
        )
        if req.n > 1:
            need = projected([target], [prepared.length()] * req.n)
            with rt.cache.reserving(need, f"{req.n} x {prepared.label}"):
                out = generator.generate_choices(prepared, stop=stop)
            record = records.success(
                job,
                rt,
                out,
                generator,
                completion_id=completion_id,
                batched_with=req.n,
                route=route,
            )
            return record, None
        decision = route.decision
        if route.speculative and decision is not None:
            prepared = prepared.with_params(num_draft_tokens=decision.k)
        streamer = None
        if writer is not None:
            streamer = Streamer.for_job(writer, target, prepared, bool(req.logprobs))
        out = yield from generate_reserved(
            generator,
            prepared,
            route.speculative,
            on_text=streamer,
            stop=stop,
            lookup=route.proposer == LOOKUP,
            give_up_below=decision.give_up_below if decision is not None else None,
            others=company(generator, prepared, upcoming, rt.scout),
            reserve=reserve,
        )
        if decision is not None and route.proposer is not None:
            rt.policy.record(req.model, route.proposer, decision, speed_of(out))
            if out.gave_up_after:
                decision = dataclasses.replace(decision, reason=_gave_up(decision, out))
        route = route.with_decision(decision)
        parsed = streamer.parser if streamer is not None else None
        record = records.success(
            job, rt, out, generator, completion_id=completion_id, route=route, parser=parsed
        )
        if streamer is not None:
            return record, functools.partial(streamer.end, record)
        return record, None
    except Stopped as halt:
        cut = [halt.outputs[tag] for tag in sorted(halt.outputs)]  # (by choice)
        record = records.stopped(job, rt, halt.error, cut, batched_with=req.n)
    except MlxqError as e:
        record = records.failure(job, rt, e)
    except Exception as e:  # never let one job's surprise take the worker down
        log.exception("job %s failed unexpectedly", job.id)
        record = records.failure(job, rt, GenerationError(f"{type(e).__name__}: {e}"))
    if req.stream and record.error is not None:
        # Whatever failed, a streaming job's readers get a final (error) chunk.
        error = ChunkWriter(conn, job.id, completion_id, req.model, ttl).error
        return record, functools.partial(error, record.error.model_dump(mode="json"))
    return record, None
