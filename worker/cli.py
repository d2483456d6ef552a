"""The ``worker`` command: serve chat jobs from Redis with warm MLX models."""

from __future__ import annotations

import atexit
import logging
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import click
from redis import Redis
from redis.exceptions import RedisError

from schemas import MlxqError, keys
from schemas.audio import MAX_AUDIO_S
from schemas.connect import redis_from_url
from schemas.settings import (
    DEFAULT_REDIS_URL,
    ENV_QUEUE,
    ENV_REDIS_URL,
    check_queue,
    redact_url,
    wait_replicas_option,
)

if TYPE_CHECKING:
    from worker.engine.group import Group
    from worker.engine.kvquant import KVQuant

log = logging.getLogger("worker")


def connect(redis_url: str) -> Redis:
    """A Redis client that rides out outages of up to about a minute (retries with backoff)."""
    from redis.backoff import ExponentialBackoff
    from redis.exceptions import ConnectionError, TimeoutError
    from redis.retry import Retry

    return redis_from_url(
        redis_url,
        retry=Retry(ExponentialBackoff(cap=2.0, base=0.05), retries=40),
        retry_on_error=[ConnectionError, TimeoutError],
        health_check_interval=15,
    )


class BatchSize(click.ParamType):
    """``auto`` (None) or a whole number from 1 to 256."""

    name = "auto|N"

    def convert(
        self, value: object, param: click.Parameter | None, ctx: click.Context | None
    ) -> int | None:
        if value is None or isinstance(value, int):
            return value
        text = str(value).strip().lower()
        if text == "auto":
            return None
        if text.isdigit() and 1 <= int(text) <= 256:
            return int(text)
        self.fail(f"{value!r} is neither 'auto' nor a whole number from 1 to 256", param, ctx)


class _Commands(click.Group):
    """``worker`` serves jobs; its subcommands are loaded when named (click's lazy group)."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return ["import-gguf"]

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        if cmd_name != "import-gguf":
            return None
        from worker.gguf.cli import import_command

        return import_command


@click.group(cls=_Commands, invoke_without_command=True)
@click.option(
    "--redis-url",
    envvar=ENV_REDIS_URL,
    default=DEFAULT_REDIS_URL,
    show_default=True,
    help="Redis URL (rediss:// for TLS; credentials here or in the env var).",
)
@click.option(
    "--queue",
    "queues",
    envvar=ENV_QUEUE,
    multiple=True,
    default=[keys.INTERACTIVE_QUEUE, keys.DEFAULT_QUEUE],
    show_default=True,
    callback=check_queue,
    help="Queue to serve, first ones first (repeatable; env var: space-separated). The "
    "default serves the gateway's chat completions before batch jobs.",
)
@click.option(
    "--model",
    "models",
    envvar="MLXQ_WORKER_MODELS",
    multiple=True,
    help="Model to preload, keep warm (never evicted) and serve: its queue "
    "(`producer submit --route model`) comes first (repeatable).",
)
@click.option(
    "--shared/--no-shared",
    envvar="MLXQ_SHARED",
    default=True,
    show_default=True,
    help="With --model: also take jobs from the --queue queues after the model queues.",
)
@click.option("--burst", is_flag=True, envvar="MLXQ_BURST", help="Exit when the queues are empty.")
@click.option(
    "--max-jobs",
    envvar="MLXQ_MAX_JOBS",
    type=click.IntRange(1),
    default=None,
    show_default=True,
    help="Exit after taking this many jobs (each job of a batch counts).",
)
@click.option(
    "--cache-gb",
    envvar="MLXQ_CACHE_GB",
    type=click.FloatRange(min=0, min_open=True),
    default=None,
    show_default=True,
    help="Memory budget for loaded models in GB (LRU eviction) [default: no limit].",
)
@click.option(
    "--prefix-cache-gb",
    envvar="MLXQ_PREFIX_CACHE_GB",
    type=click.FloatRange(min=0),
    default=1.0,
    show_default=True,
    help="Memory for KV state of shared prompt prefixes (system prompts, few-shot turns), "
    "kept across jobs and counted inside --cache-gb; 0 turns it off.",
)
@click.option(
    "--max-image-mb",
    envvar="MLXQ_MAX_IMAGE_MB",
    type=click.FloatRange(min=0, min_open=True, max=20),
    default=20.0,
    show_default=True,
    help="Largest image a job may show (bytes of the PNG, JPEG, WebP or GIF); larger "
    "ones fail their job with a 400.",
)
@click.option(
    "--allow-image-host",
    "image_hosts",
    envvar="MLXQ_ALLOW_IMAGE_HOSTS",
    multiple=True,
    help="Host (name, glob or IP) that jobs' http(s) image URLs may be fetched from "
    "(repeatable) [default: none: images come inline or stored with their batch]. An "
    "internal address (loopback, link-local, private) only if named exactly.",
)
@click.option(
    "--prefix-cache-dir",
    envvar="MLXQ_PREFIX_CACHE_DIR",
    type=click.Path(file_okay=False, path_type=Path),
    default=None,
    help="Also keep shared prefixes on disk here: a new or restarted worker on this machine "
    "starts from them (keyed by the weights, not the name) [default: memory only].",
)
@click.option(
    "--prefix-cache-disk-gb",
    envvar="MLXQ_PREFIX_CACHE_DISK_GB",
    type=click.FloatRange(min=0.001),
    default=10.0,
    show_default=True,
    help="Size of --prefix-cache-dir: least recently used files go first.",
)
@click.option(
    "--kv-bits",
    envvar="MLXQ_KV_BITS",
    type=click.Choice(["4", "8"]),
    default=None,
    help="Quantize full-attention KV caches to this many bits on every path: more jobs fit "
    "in memory; outputs change slightly [default: unquantized].",
)
@click.option(
    "--kv-group-size",
    envvar="MLXQ_KV_GROUP_SIZE",
    type=click.Choice(["32", "64", "128"]),
    default=None,
    help="Values per quantization group of --kv-bits (a model whose head size it does not "
    "divide runs unquantized, said in the log) [default: 64 at 8 bits, 32 at 4].",
)
@click.option(
    "--shard",
    envvar="MLXQ_SHARD",
    type=click.Choice(["auto", "tensor", "pipeline"]),
    default=None,
    help="Serve each model split across a worker group started by mlx.launch (rank 0 talks "
    "to Redis; the others follow): tensor or pipeline parallel, auto: tensor where the "
    "model has it [default: one machine].",
)
@click.option(
    "--group-timeout",
    envvar="MLXQ_GROUP_TIMEOUT",
    type=click.FloatRange(1, 3600),
    default=60.0,
    show_default=True,
    help="With --shard: seconds rank 0 waits on a step of the group (a model's load: 10 "
    "times it) before it counts a rank as hung, hands its jobs back and exits.",
)
@click.option(
    "--allow-model",
    "allow_models",
    envvar="MLXQ_ALLOW_MODELS",
    multiple=True,
    help="Glob of hub repositories, or of absolute local paths outside --model-dir, that "
    "jobs may name (repeatable) [default: any hub repository, no other local path].",
)
@click.option(
    "--model-dir",
    "model_dirs",
    envvar="MLXQ_MODEL_DIRS",
    multiple=True,
    type=click.Path(file_okay=False, path_type=str),
    help="Directory of local models jobs may name, by path or by name inside it "
    "(repeatable; env: paths separated by ':') [default: .mlxq/models].",
)
@click.option(
    "--num-draft-tokens",
    envvar="MLXQ_NUM_DRAFT_TOKENS",
    type=click.IntRange(1, 32),
    default=3,
    show_default=True,
    help="Draft tokens per round when a job names a draft but no count.",
)
@click.option(
    "--speculative",
    envvar="MLXQ_SPECULATIVE",
    type=click.Choice(["auto", "always", "never"]),
    default="auto",
    show_default=True,
    help="auto: per (target, draft) pair, run plain or the draft length measured fastest.",
)
@click.option(
    "--lookup",
    envvar="MLXQ_LOOKUP",
    type=click.Choice(["never", "auto", "always"]),
    default="never",
    show_default=True,
    help="Prompt lookup (draft tokens copied from the job's own prompt, no draft model) for "
    "jobs that name no draft: never (only jobs asking for it), auto (as --speculative "
    "decides), always.",
)
@click.option(
    "--interactive-join",
    envvar="MLXQ_INTERACTIVE_JOIN",
    type=click.Choice(["auto", "always", "never"]),
    default="auto",
    show_default=True,
    help="Interactive jobs arriving during a batch: auto (join it while its step costs at "
    "most 2x a small one's, else run beside it), always join (taking a batch job's place "
    "at the cap), never join (always beside).",
)
@click.option(
    "--time-limit",
    envvar="MLXQ_TIME_LIMIT",
    type=click.FloatRange(min=0, min_open=True),
    default=None,
    metavar="SECONDS",
    help="The most seconds a job may run here once taken: past them it stops and fails "
    "with timeout, its text so far in the record (default: none; a batch's job timeout "
    "and a request's time_limit_s hold too, the least wins).",
)
@click.option(
    "--max-audio-seconds",
    envvar="MLXQ_MAX_AUDIO_SECONDS",
    type=click.FloatRange(min=1),
    default=MAX_AUDIO_S,
    show_default=True,
    metavar="SECONDS",
    help="The longest recording an audio job may carry: decoding stops there and the job "
    "fails with a 400 (a small file of hours of silence cannot fill memory).",
)
@click.option(
    "--thinking-budget",
    envvar="MLXQ_THINKING_BUDGET",
    type=click.IntRange(min=0),
    default=None,
    metavar="TOKENS",
    help="The most tokens a reasoning model may think for a request that sets no "
    "thinking_budget or reasoning_effort; then its thinking block is closed for it and the "
    "answer follows (default: no cap).",
)
@click.option(
    "--lookup-tokens",
    envvar="MLXQ_LOOKUP_TOKENS",
    type=click.IntRange(1, 64),
    default=4,
    show_default=True,
    help="Prompt lookup's proposal length per round when a job does not fix it (auto "
    "measures this and twice this).",
)
@click.option(
    "--max-batch",
    envvar="MLXQ_MAX_BATCH",
    type=BatchSize(),
    default="auto",
    show_default=True,
    help="Jobs on one model decoded together (continuous batching). auto: as many as the "
    "memory budget holds (KV cache of prompt + max_tokens) while a larger batch measures "
    "faster; N (1-256): at most N (memory still applies); 1 disables batching.",
)
@click.option(
    "--share-figures/--no-share-figures",
    envvar="MLXQ_SHARE_FIGURES",
    default=True,
    show_default=True,
    help="Keep what auto measures (speeds, acceptance, batch sizes) in Redis per machine "
    "kind and model weights, and start from what the fleet measured.",
)
@click.option(
    "--machine-kind",
    envvar="MLXQ_MACHINE_KIND",
    default=None,
    help="The kind whose figures this worker shares [default: chip, memory and device].",
)
@click.option(
    "--max-n",
    envvar="MLXQ_MAX_N",
    type=click.IntRange(1, 128),
    default=16,
    show_default=True,
    help="The most choices (n) one job may ask for; a job asking more fails with a 400.",
)
@click.option(
    "--lease-seconds",
    envvar="MLXQ_LEASE_SECONDS",
    type=click.IntRange(2, 3600),
    default=30,
    show_default=True,
    help="A running job's lease: a dead worker's job is requeued about 1.5x this later.",
)
@click.option(
    "--max-crashes",
    envvar="MLXQ_MAX_CRASHES",
    type=click.IntRange(1, 100),
    default=3,
    show_default=True,
    help="A job whose worker died this many times is failed as poison.",
)
@click.option(
    "--model-wait",
    envvar="MLXQ_MODEL_WAIT",
    type=click.FloatRange(min=0),
    default=30.0,
    show_default=True,
    metavar="SECONDS",
    help="Take jobs for the models loaded here before a job for another model that has "
    "waited less than this (a mixed queue does not make the worker reload models); 0 "
    "takes every queue in order. Not on the interactive queue.",
)
@click.option(
    "--name",
    envvar="MLXQ_WORKER_NAME",
    default=None,
    show_default=True,
    help="Worker name [default: host.pid].",
)
@wait_replicas_option("writing records")
@click.option("-v", "--verbose", count=True, help="More logging (-v info, -vv debug).")
@click.pass_context
def main(
    ctx: click.Context,
    redis_url: str,
    queues: tuple[str, ...],
    models: tuple[str, ...],
    shared: bool,
    burst: bool,
    max_jobs: int | None,
    cache_gb: float | None,
    prefix_cache_gb: float,
    max_image_mb: float,
    image_hosts: tuple[str, ...],
    prefix_cache_dir: Path | None,
    prefix_cache_disk_gb: float,
    kv_bits: str | None,
    kv_group_size: str | None,
    shard: str | None,
    group_timeout: float,
    allow_models: tuple[str, ...],
    model_dirs: tuple[str, ...],
    num_draft_tokens: int,
    speculative: str,
    lookup: str,
    interactive_join: str,
    time_limit: float | None,
    max_audio_seconds: float,
    thinking_budget: int | None,
    lookup_tokens: int,
    max_batch: int | None,
    share_figures: bool,
    machine_kind: str | None,
    max_n: int,
    lease_seconds: int,
    max_crashes: int,
    name: str | None,
    wait_replicas: int,
    model_wait: float,
    verbose: int,
) -> None:
    """Serve mlxq chat jobs: keep models warm, decode speculatively, write results to Redis
    (no command), or run a command (worker import-gguf --help)."""
    if ctx.invoked_subcommand is not None:
        return
    level = logging.WARNING if verbose == 0 else logging.INFO if verbose == 1 else logging.DEBUG
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # Import the job code (mlx-lm, transformers: ~1-2 s) before registering, so
    # the first job does not pay for it and "registered" means "ready".
    from worker.engine.group import GroupLost
    from worker.engine.kvquant import KVQuant
    from worker.engine.models import ModelCache
    from worker.runner import runtime
    from worker.runner.access import DEFAULT_MODEL_DIR, ModelAccess
    from worker.runner.imagehosts import ImageHosts
    from worker.runner.loop import ColdShutdown, StopWaiting, Worker
    from worker.schedule.policy import SpeculationPolicy
    from worker.schedule.step import StepConfig

    kv_quant = KVQuant(int(kv_bits), int(kv_group_size or 0)) if kv_bits else None
    group = None
    if shard is not None and prefix_cache_dir is not None:
        raise click.BadParameter(
            "a worker group keeps prefixes in memory only (each rank holds its part)",
            param_hint="--prefix-cache-dir",
        )
    if shard is not None:
        group = _join_group(shard, group_timeout, model_dirs, allow_models, models, kv_quant)
        if group is None:
            return  # a follower's work is done (rank 0 said exit)
    try:  # fail fast on a wrong URL or password; retry only once we are running
        redis_from_url(redis_url).ping()
    except ValueError as e:
        raise click.BadParameter(str(e), param_hint="--redis-url") from None
    except RedisError as e:
        raise click.ClickException(f"cannot reach Redis at {redact_url(redis_url)}: {e}") from None
    conn = connect(redis_url)
    budget = int(cache_gb * 1e9) if cache_gb else None
    access = ModelAccess.build(model_dirs or (DEFAULT_MODEL_DIR,), allow_models)
    for model in models:  # the operator's own names are served wherever they are
        try:
            access = access.with_named(model)
        except MlxqError as e:
            raise click.ClickException(f"--model {model}: {e}") from None
    disk = None
    if prefix_cache_dir is not None and prefix_cache_gb > 0:
        from worker.engine.prefixdisk import PrefixDisk

        try:
            disk = PrefixDisk(prefix_cache_dir, int(prefix_cache_disk_gb * 1e9))
        except OSError as e:
            raise click.BadParameter(str(e), param_hint="--prefix-cache-dir") from None
    rt = runtime.WorkerRuntime(
        cache=ModelCache(
            budget,
            prefix_bytes=int(prefix_cache_gb * 1e9),
            locate=access.locate,
            prefix_disk=disk,
            kv_quant=kv_quant,
            group=group,
            max_image_bytes=int(max_image_mb * 2**20),
        ),
        access=access,
        image_hosts=ImageHosts(tuple(image_hosts)),
        default_num_draft_tokens=num_draft_tokens,
        policy=SpeculationPolicy(
            speculative, default_k=num_draft_tokens, lookup=lookup, lookup_k=lookup_tokens
        ),
        max_n=max_n,
        share_figures=share_figures,
        machine_kind=machine_kind,
        step=StepConfig(join_mode=interactive_join),
        time_limit_s=time_limit,
        max_audio_s=max_audio_seconds,
        thinking_budget=thinking_budget,
    )
    if name:
        rt.worker_id = name
    if group is not None:
        group.guard(lambda what: None)  # (a hang while preloading: no job is held yet)
        atexit.register(group.exit)
    for model in models:
        try:
            rt.check_allowed(model)
            entry, _ = rt.cache.get(model, pin=True)
        except MlxqError as e:
            raise click.ClickException(f"--model {model}: {e}") from None
        click.echo(f"preloaded {model} ({entry.nbytes / 1e6:.1f} MB)", err=True)
    served = [keys.queue_for_model(m) for m in models]
    served += [q for q in queues if q not in served] if (shared or not models) else []
    if keys.INTERACTIVE_QUEUE in served:  # someone is waiting on these: before model queues
        served.remove(keys.INTERACTIVE_QUEUE)
        served.insert(0, keys.INTERACTIVE_QUEUE)
    worker = Worker(
        conn,
        served,
        rt,
        name=rt.worker_id,
        lease_s=lease_seconds,
        max_crashes=max_crashes,
        max_batch=max_batch,
        burst=burst,
        max_jobs=max_jobs,
        wait_replicas=wait_replicas,
        model_wait_s=model_wait,
    )
    if group is not None:  # a rank that hangs: the jobs go back, uncounted, and we exit
        group.guard(lambda what: worker.lifecycle.hand_back_all())
    click.echo(
        f"worker {rt.worker_id}: serving {', '.join(served)} from {redact_url(redis_url)} "
        f"(max batch {max_batch or 'auto'}, speculative {speculative}, lookup {lookup})",
        err=True,
    )
    try:
        worker.work()
    except RuntimeError as e:  # e.g. the name is taken by a live worker
        raise click.ClickException(str(e)) from None
    except GroupLost as e:  # (its held jobs come back when their lease expires)
        raise click.ClickException(f"the worker group lost a rank: {e}") from None
    except (ColdShutdown, StopWaiting):  # a stop signal during the exit itself
        pass
    sys.exit(0)


def _join_group(
    mode: str,
    timeout_s: float,
    model_dirs: tuple[str, ...],
    allow_models: tuple[str, ...],
    models: tuple[str, ...],
    kv_quant: KVQuant | None,
) -> Group | None:
    """This process's place in a worker group (``--shard``): rank 0 gets the group and
    goes on to serve; a follower loads and runs what rank 0 tells it, then returns None."""
    from worker.engine.group import GroupLost, init
    from worker.engine.mirror import follow
    from worker.engine.models import ModelCache
    from worker.runner.access import DEFAULT_MODEL_DIR, ModelAccess

    try:
        group = init(mode, timeout_s)
    except ValueError as e:
        raise click.BadParameter(str(e), param_hint="--shard") from None
    if group.leads:
        return group
    access = ModelAccess.build(model_dirs or (DEFAULT_MODEL_DIR,), allow_models)
    for model in models:
        access = access.with_named(model)
    # No budget of its own: rank 0 decides what is loaded and evicted, and says so.
    cache = ModelCache(None, prefix_bytes=0, locate=access.locate, kv_quant=kv_quant, group=group)
    try:
        follow(group, cache)
    except GroupLost as e:
        raise click.ClickException(f"the worker group lost a rank: {e}") from None
    return None


def entry() -> None:
    """``worker [OPTIONS]`` serves jobs; ``worker import-gguf FILE OUT`` imports a GGUF file."""
    main()


if __name__ == "__main__":
    entry()
