"""The ``producer`` command: submit jobs files, watch batches, collect results."""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TextIO

import click
from redis import Redis
from redis.exceptions import RedisError

from producer.batches import (
    BatchNotFoundError,
    BatchStatus,
    RateWindow,
    batch_queues,
    batch_status,
    cancel_batch,
    iter_output_lines,
    queue_watchers,
)
from producer.figures import beliefs, beliefs_table
from producer.fleet import fleet_table, live_workers
from producer.jobsfile import FileChangedError, check_file, enqueue_file, spool
from producer.lines import Defaults
from producer.retry import RetryFilter, retry_batch
from producer.streams import chunk_text, iter_chunks
from producer.submit import DEFAULT_JOB_TIMEOUT, BatchCancelledError, new_batch_id
from producer.tenants import limits, queued, set_limits, set_weight, usage, weights
from producer.webhooks import (
    ENV_ALLOW_PRIVATE,
    ENV_SECRET,
    Deliverer,
    WebhookError,
    deliveries,
    set_webhook,
)
from schemas import InvalidRequestError, keys
from schemas.connect import redis_from_url
from schemas.settings import (
    DEFAULT_REDIS_URL,
    ENV_QUEUE,
    ENV_REDIS_URL,
    check_queue,
    redact_url,
    wait_replicas_option,
)

EXIT_INVALID = 2


def _redis_option(f: Callable[..., Any]) -> Callable[..., Any]:
    return click.option(
        "--redis-url",
        envvar=ENV_REDIS_URL,
        default=DEFAULT_REDIS_URL,
        show_default=True,
        help="Redis URL (rediss:// for TLS; put credentials here or in the env var).",
    )(f)


def _connect(redis_url: str) -> Redis:
    try:
        conn = redis_from_url(redis_url)
    except ValueError as e:
        raise click.BadParameter(str(e), param_hint="--redis-url") from None
    try:
        conn.ping()
    except RedisError as e:
        raise click.ClickException(f"cannot reach Redis at {redact_url(redis_url)}: {e}") from None
    return conn


def _fmt_eta(seconds: float | None) -> str:
    if seconds is None:
        return "?"
    return time.strftime("%H:%M:%S", time.gmtime(seconds))


def _status_line(s: BatchStatus) -> str:
    rate = f"{s.rate_per_s:.2f} jobs/s" if s.rate_per_s else "- jobs/s"
    return (
        f"{s.batch_id}: {s.done}/{s.total} done (succeeded {s.succeeded}, failed {s.failed}"
        + (f", cancelled {s.cancelled}" if s.cancelled else "")
        + f"), running {s.running}, queued {s.queued}, {rate}, ETA {_fmt_eta(s.eta_s)}"
    )


def _watch(conn: Redis, batch_id: str, label: str) -> BatchStatus:
    """Show a progress bar (on a terminal) until every job of the batch has ended."""
    status = batch_status(conn, batch_id)
    window = RateWindow()
    with click.progressbar(
        length=max(status.total, 1),
        label=label,
        file=sys.stderr,
        show_pos=True,
        item_show_func=lambda item: item,
    ) as bar:
        shown = 0
        while True:
            # The last minute's rate once there is one (the batch's own until then).
            rate = window.add(time.monotonic(), status.done) or status.rate_per_s
            left = status.total - status.done
            shown_rate = (
                f"{rate:.2f} jobs/s, ETA {_fmt_eta(left / rate)}" if rate and left else None
            )
            bar.update(status.done - shown, current_item=shown_rate)
            shown = status.done
            if status.finished:
                return status
            time.sleep(0.5)
            status = batch_status(conn, batch_id)


@click.group()
def main() -> None:
    """Submit chat jobs to mlxq workers through Redis, and collect the results."""


@main.command()
@click.argument(
    "file", type=click.Path(exists=True, dir_okay=False, allow_dash=True, path_type=Path)
)
@_redis_option
@click.option(
    "--queue",
    envvar=ENV_QUEUE,
    default=keys.DEFAULT_QUEUE,
    show_default=True,
    callback=check_queue,
    help="RQ queue to put the jobs on.",
)
@click.option(
    "--model",
    envvar="MLXQ_MODEL",
    default=None,
    show_default=True,
    help="Model for lines that name none (hub id or local path).",
)
@click.option(
    "--draft-model",
    envvar="MLXQ_DRAFT_MODEL",
    default=None,
    show_default=True,
    help="Draft model for lines that name none (an explicit null keeps no draft).",
)
@click.option(
    "--num-draft-tokens",
    envvar="MLXQ_NUM_DRAFT_TOKENS",
    type=click.IntRange(1, 32),
    default=None,
    show_default=True,
    help="Draft length for lines with a draft and none.",
)
@click.option(
    "--job-timeout",
    envvar="MLXQ_JOB_TIMEOUT",
    type=click.IntRange(1),
    default=DEFAULT_JOB_TIMEOUT,
    show_default=True,
    help="Seconds a job may run.",
)
@click.option(
    "--result-ttl",
    envvar="MLXQ_RESULT_TTL",
    type=click.IntRange(60),
    default=keys.DEFAULT_RESULT_TTL,
    show_default=True,
    help="Seconds results and batch records are kept.",
)
@click.option(
    "--batch-id",
    envvar="MLXQ_BATCH_ID",
    default=None,
    show_default=True,
    help="Batch id (reuse it to resume an interrupted submit without duplicates).",
)
@click.option(
    "--route",
    envvar="MLXQ_ROUTE",
    type=click.Choice(["queue", "model"]),
    default="queue",
    show_default=True,
    help="'model': each job goes to its model's queue (served by `worker --model`).",
)
@click.option(
    "--tenant",
    envvar="MLXQ_TENANT",
    default=keys.DEFAULT_TENANT,
    show_default=True,
    help="Whose batch this is: workers share each queue fairly between tenants "
    "(weights: producer tenant set).",
)
@click.option(
    "--priority",
    type=click.IntRange(keys.MIN_PRIORITY, keys.MAX_PRIORITY),
    default=0,
    show_default=True,
    help="Within its tenant, batches of higher priority are taken first (FIFO at equal priority).",
)
@click.option(
    "--audio-root",
    type=click.Path(exists=True, file_okay=False, path_type=Path),
    default=None,
    help="Folder audio lines' file paths are read from and must stay under "
    "(default: FILE's folder; the current folder for '-').",
)
@click.option(
    "--skip-invalid",
    is_flag=True,
    envvar="MLXQ_SKIP_INVALID",
    help="Enqueue the valid lines and write the invalid ones to --rejected.",
)
@click.option(
    "--rejected",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="Where --skip-invalid writes rejected lines [default: FILE.rejected.jsonl;\n"
    "stdin.rejected.jsonl for standard input].",
)
@wait_replicas_option("each chunk")
@click.option("--json", "as_json", is_flag=True, help="Print a JSON summary on stdout.")
def submit(
    file: Path,
    redis_url: str,
    queue: str,
    model: str | None,
    draft_model: str | None,
    num_draft_tokens: int | None,
    job_timeout: int,
    result_ttl: int,
    batch_id: str | None,
    route: str,
    tenant: str,
    priority: int,
    audio_root: Path | None,
    skip_invalid: bool,
    rejected: Path | None,
    wait_replicas: int,
    as_json: bool,
) -> None:
    """Validate every line of FILE, then enqueue them as one batch and print its id.

    Lines are plain chat.completions bodies or OpenAI Batch API lines; FILE '-'
    reads standard input (copied to a temporary file first). If any line is
    invalid, nothing is enqueued (exit status 2) unless --skip-invalid.
    """
    if batch_id is not None:
        try:
            keys.validate_batch_id(batch_id)
        except ValueError as e:
            raise click.BadParameter(str(e), param_hint="--batch-id") from None
    try:
        queue = keys.tenant_queue(queue, tenant, priority)
    except ValueError as e:
        raise click.BadParameter(str(e), param_hint="--tenant") from None
    stdin = str(file) == "-"
    path = spool(sys.stdin.buffer) if stdin else file
    try:
        _submit(
            path,
            "<stdin>" if stdin else str(file),
            rejected
            or (
                Path("stdin.rejected.jsonl")
                if stdin
                else file.with_name(file.name + ".rejected.jsonl")
            ),
            redis_url=redis_url,
            queue=queue,
            defaults=Defaults(
                model,
                draft_model,
                num_draft_tokens,
                audio_root=audio_root or (Path.cwd() if stdin else file.parent),
            ),
            job_timeout=job_timeout,
            result_ttl=result_ttl,
            batch_id=batch_id or new_batch_id(),
            route=route,
            skip_invalid=skip_invalid,
            as_json=as_json,
            wait_replicas=wait_replicas,
        )
    finally:
        if stdin:
            path.unlink(missing_ok=True)


def _submit(
    path: Path,
    name: str,
    rejected: Path,
    *,
    redis_url: str,
    queue: str,
    defaults: Defaults,
    job_timeout: int,
    result_ttl: int,
    batch_id: str,
    route: str,
    skip_invalid: bool,
    as_json: bool,
    wait_replicas: int = 0,
) -> None:
    with (
        _Rejects(name, rejected if skip_invalid else None) as rejects,
        click.progressbar(
            length=max(path.stat().st_size, 1), label="checking", file=sys.stderr
        ) as bar,
    ):
        checked = check_file(path, defaults, rejects.add, progress=bar.update)
    if checked.invalid and not skip_invalid:
        click.echo(
            f"{checked.invalid} invalid line(s); nothing enqueued "
            "(fix them, or use --skip-invalid)",
            err=True,
        )
        sys.exit(EXIT_INVALID)
    if not checked.valid:
        raise click.ClickException(f"{name}: no valid lines to submit")
    conn = _connect(redis_url)
    try:
        with click.progressbar(length=checked.valid, label="enqueueing", file=sys.stderr) as bar:
            summary = enqueue_file(
                conn,
                checked,
                defaults,
                batch_id=batch_id,
                queue=queue,
                job_timeout=job_timeout,
                result_ttl=result_ttl,
                route=route,
                source=name,
                progress=bar.update,
                wait_replicas=wait_replicas,
            )
    except (FileChangedError, BatchCancelledError) as e:
        raise click.ClickException(str(e)) from None
    info = summary.as_dict() | {"invalid": checked.invalid}
    if as_json:
        click.echo(json.dumps(info))
    else:
        click.echo(summary.batch_id)
        click.echo(
            f"{summary.submitted} job(s) enqueued on {queue!r}"
            + (f", {summary.already_present} already present" if summary.already_present else "")
            + (f", {checked.invalid} invalid line(s) skipped" if checked.invalid else ""),
            err=True,
        )
    if summary.replica_shortfalls:
        click.echo(
            f"warning: {summary.replica_shortfalls} chunk(s) reached fewer than "
            f"{wait_replicas} replica(s) in time; if the primary fails now they can be lost: "
            f"submit again with --batch-id {summary.batch_id} to make sure",
            err=True,
        )


class _Rejects:
    """Prints each bad line as NAME:LINE: message; with a path, writes the lines there too."""

    def __init__(self, name: str, path: Path | None) -> None:
        self.name, self.path = name, path
        self.count = 0
        self._out: TextIO | None = None

    def add(self, lineno: int, message: str, text: str) -> None:
        click.echo(f"{self.name}:{lineno}: {message}", err=True)
        self.count += 1
        if self.path is not None:
            if self._out is None:
                self._out = open(self.path, "w", encoding="utf-8")  # noqa: SIM115
            self._out.write(text + "\n")

    def __enter__(self) -> _Rejects:
        return self

    def __exit__(self, *exc: object) -> None:
        if self._out is not None:
            self._out.close()
            click.echo(f"{self.count} rejected line(s) written to {self.path}", err=True)


@main.command()
@click.argument("batch_id")
@_redis_option
@click.option("--watch", is_flag=True, help="Show a live progress bar until the batch is done.")
@click.option("--json", "as_json", is_flag=True, help="Print the counts as JSON.")
def status(batch_id: str, redis_url: str, watch: bool, as_json: bool) -> None:
    """Counts for BATCH_ID: queued, running, succeeded, failed, rate and ETA."""
    conn = _connect(redis_url)
    try:
        s = _watch(conn, batch_id, batch_id) if watch else batch_status(conn, batch_id)
    except BatchNotFoundError as e:
        raise click.ClickException(str(e)) from None
    waiting = _unserved(conn, batch_id) if not s.finished else []
    if as_json:
        extra = {"queues_without_workers": waiting, "webhooks": deliveries(conn, batch_id)}
        click.echo(json.dumps(s.as_dict() | extra))
        return
    click.echo(_status_line(s))
    for queue in waiting:
        click.echo(f"  waiting: no live worker serves queue {queue!r}", err=True)
    for d in deliveries(conn, batch_id):
        why = f"HTTP {d['status']}" if d.get("status") else d.get("error", "")
        click.echo(f"  webhook {d['event']}: {d['result']} ({why})".replace(" ()", ""))


def _unserved(conn: Redis, batch_id: str) -> list[str]:
    """The batch's queues that hold jobs but have no live worker listening."""
    lists = [q for q in batch_queues(conn, batch_id) if conn.llen(keys.rq_queue_key(q))]
    queues = sorted({keys.base_queue(q) for q in lists})  # workers serve a tenant's queue
    return [q for q, n in queue_watchers(conn, queues).items() if n == 0]


@main.command()
@click.argument("batch_id")
@_redis_option
@click.option(
    "-o",
    "--output",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="Output JSONL file [default: stdout].",
)
@click.option("--wait", is_flag=True, help="Block (with a progress bar) until every job has ended.")
def results(batch_id: str, redis_url: str, output: Path | None, wait: bool) -> None:
    """Write BATCH_ID's results as OpenAI Batch output lines (failures carry an error)."""
    conn = _connect(redis_url)
    try:
        if wait:
            _watch(conn, batch_id, "waiting")
        else:
            batch_status(conn, batch_id)
    except BatchNotFoundError as e:
        raise click.ClickException(str(e)) from None
    written = pending = 0
    with click.open_file(str(output) if output else "-", "w", encoding="utf-8") as out:
        for line in iter_output_lines(conn, batch_id):
            if isinstance(line, str):
                pending += 1
                continue
            out.write(line.model_dump_json() + "\n")
            written += 1
    click.echo(f"{written} result line(s) written", err=True)
    if pending:
        click.echo(f"{pending} job(s) not finished yet (use --wait to block)", err=True)


@main.command()
@click.argument("batch_id")
@_redis_option
def cancel(batch_id: str, redis_url: str) -> None:
    """Cancel BATCH_ID: its queued jobs never run (no record each: status and results count
    them as cancelled, from the batch's flag); running ones stop at their next step, each
    with a cancelled record holding the text it made."""
    conn = _connect(redis_url)
    try:
        cancelled, running = cancel_batch(conn, batch_id)
    except BatchNotFoundError as e:
        raise click.ClickException(str(e)) from None
    click.echo(
        f"{cancelled} queued job(s) cancelled; {running} running job(s) stop at their next step"
    )


@main.command()
@click.argument("batch_id")
@click.option(
    "--status-code",
    "status_codes",
    multiple=True,
    metavar="CODE",
    help="Only jobs that failed with this HTTP status: 503, or a class: 5xx (repeatable).",
)
@click.option(
    "--error-code",
    "error_codes",
    multiple=True,
    metavar="CODE",
    help="Only jobs whose error.code is CODE, e.g. model_load_error (repeatable).",
)
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
@_redis_option
def retry(
    batch_id: str,
    status_codes: tuple[str, ...],
    error_codes: tuple[str, ...],
    as_json: bool,
    redis_url: str,
) -> None:
    """Run BATCH_ID's failed jobs again (all of them, or those the filters match). Each
    keeps its failed record until its new run ends; jobs already queued again are left
    alone, so running this twice runs nothing twice."""
    try:
        flt = RetryFilter(status_codes, error_codes)
    except InvalidRequestError as e:
        raise click.BadParameter(str(e)) from None
    conn = _connect(redis_url)
    try:
        report = retry_batch(conn, batch_id, flt)
    except InvalidRequestError as e:
        raise click.ClickException(str(e)) from None
    if as_json:
        click.echo(json.dumps(report.as_dict()))
        return
    causes = ", ".join(f"{n} {code}" for code, n in sorted(report.by_code.items()))
    click.echo(f"{report.queued} failed job(s) queued again" + (f" ({causes})" if causes else ""))
    for n, why in (
        (report.pending, "already queued again or running"),
        (report.unmatched, "failed with another cause (not matched)"),
        (report.changed, "ended again while this ran (run retry again)"),
        (report.unkept, "have no request kept to run (refused before queueing)"),
    ):
        if n:
            click.echo(f"{n} job(s) {why}")


@main.command()
@_redis_option
@click.option("--watch", is_flag=True, help="Refresh every 2 seconds until interrupted.")
@click.option("--json", "as_json", is_flag=True, help="Print the registry as JSON.")
def fleet(redis_url: str, watch: bool, as_json: bool) -> None:
    """Live workers: host, state, models loaded, cache, jobs done, tokens/s and acceptance."""
    conn = _connect(redis_url)
    while True:
        workers = live_workers(conn)
        if as_json:
            click.echo(json.dumps([w.model_dump(mode="json") for w in workers]))
        else:
            if watch:
                click.clear()
            click.echo(fleet_table(workers))
            found, notes = beliefs(conn)
            if found or notes:
                click.echo("\nshared figures (producer policy show):")
                click.echo(beliefs_table(found, notes))
        if not watch:
            return
        time.sleep(2)


@main.command()
@_redis_option
@click.option("--host", envvar="MLXQ_METRICS_HOST", default="127.0.0.1", show_default=True)
@click.option(
    "--port",
    envvar="MLXQ_METRICS_PORT",
    type=click.IntRange(1, 65535),
    default=9121,
    show_default=True,
)
@click.option("--once", is_flag=True, help="Print one scrape to stdout and exit.")
def metrics(redis_url: str, host: str, port: int, once: bool) -> None:
    """Serve the fleet's Prometheus metrics on http://HOST:PORT/metrics (read from Redis)."""
    from prometheus_client import generate_latest, start_http_server

    from producer.metrics import registry_for

    registry = registry_for(_connect(redis_url))
    if once:
        click.echo(generate_latest(registry).decode(), nl=False)
        return
    try:
        start_http_server(port, addr=host, registry=registry)
    except OSError as e:
        raise click.ClickException(f"cannot listen on {host}:{port}: {e}") from None
    click.echo(f"metrics on http://{host}:{port}/metrics", err=True)
    while True:
        time.sleep(3600)


@main.group()
def tenant() -> None:
    """Tenants' weights in fair share, and what each has queued."""


@tenant.command("set")
@click.argument("name")
@click.option("--weight", type=float, default=None, help="Share weight (default 1): 0.01-100.")
@click.option(
    "--max-running", type=int, default=None, help="Most jobs held fleet-wide at once (0: none)."
)
@click.option(
    "--tokens-per-day",
    type=int,
    default=None,
    help="Most prompt + completion tokens per UTC day; past it jobs fail 429 (0: none).",
)
@click.option(
    "--webhook",
    default=None,
    metavar="URL",
    help="POST the tenant's batch events here, signed with MLXQ_WEBHOOK_SECRET ('': none).",
)
@_redis_option
def tenant_set(
    name: str,
    weight: float | None,
    max_running: int | None,
    tokens_per_day: int | None,
    webhook: str | None,
    redis_url: str,
) -> None:
    """Set tenant NAME's weight (its share of each queue's takes while it has work), its
    running limit (its jobs wait past it), its daily token quota and its webhook URL
    (private addresses only with MLXQ_WEBHOOK_ALLOW_PRIVATE=1)."""
    if weight is None and max_running is None and tokens_per_day is None and webhook is None:
        raise click.UsageError("give --weight, --max-running, --tokens-per-day or --webhook")
    conn = _connect(redis_url)
    try:
        keys.validate_tenant(name)
        if weight is not None:
            set_weight(conn, name, weight)
        set_limits(conn, name, max_running, tokens_per_day)
        if webhook is not None:
            allow = os.environ.get(ENV_ALLOW_PRIVATE, "") in ("1", "true", "yes")
            set_webhook(conn, name, webhook, allow)
    except ValueError as e:
        raise click.BadParameter(str(e)) from None
    click.echo(f"tenant {name}: updated")


@tenant.command("list")
@_redis_option
def tenant_list(redis_url: str) -> None:
    """Tenants with a weight or with jobs waiting: weight and jobs waiting per queue."""
    conn = _connect(redis_url)
    given, waiting, capped = weights(conn), queued(conn), limits(conn)
    names = sorted(set(given) | set(waiting) | set(capped))
    if not names:
        click.echo("no tenants with a weight, a limit or jobs waiting")
    for name in names:
        per = ", ".join(f"{q}: {n}" for q, n in sorted(waiting.get(name, {}).items())) or "-"
        lim = capped.get(name, {})
        caps = "".join(f"  {k.replace('_', ' ')} {v}" for k, v in sorted(lim.items()))
        click.echo(f"{name:<34}weight {given.get(name, 1.0):<8g}waiting {per}{caps}")


@main.command()
@_redis_option
@click.option("--once", is_flag=True, help="Deliver what is due now, then exit.")
def webhooks(redis_url: str, once: bool) -> None:
    """Deliver tenants' batch webhook events (every `producer serve` process does this too,
    when MLXQ_WEBHOOK_SECRET is set)."""
    conn = _connect(redis_url)
    try:
        deliverer = Deliverer.from_env(conn)
    except WebhookError as e:
        raise click.UsageError(str(e)) from None
    if deliverer is None:
        raise click.UsageError(f"set {ENV_SECRET} (whsec_ + base64) to sign the events")
    while True:
        n = deliverer.run_once()
        if once:
            click.echo(f"{n} delivery attempt(s)")
            return
        time.sleep(1.0)


@main.command("usage")
@click.option("--tenant", default=None, help="Only this tenant.")
@click.option(
    "--days",
    type=click.IntRange(1, 40),
    default=1,
    show_default=True,
    help="UTC days to sum, today included (kept 40 days).",
)
@click.option("--json", "as_json", is_flag=True, help="Print the totals as JSON.")
@_redis_option
def usage_cmd(tenant: str | None, days: int, as_json: bool, redis_url: str) -> None:
    """Per tenant: jobs, failed jobs, prompt and completion tokens, and job seconds (each
    job's run time) of the last DAYS days, counted once per record written."""
    if tenant is not None:
        try:
            keys.validate_tenant(tenant)
        except ValueError as e:
            raise click.BadParameter(str(e), param_hint="--tenant") from None
    totals = usage(_connect(redis_url), days, tenant)
    if as_json:
        click.echo(json.dumps(totals))
        return
    if not totals:
        click.echo(f"no usage in the last {days} day(s)")
        return
    click.echo(
        f"{'tenant':<34}{'jobs':>9}{'failed':>8}{'prompt tok':>12}{'compl. tok':>12}{'job s':>10}"
    )
    for name, f in totals.items():
        click.echo(
            f"{name:<34}{f['jobs']:>9.0f}{f['failed']:>8.0f}{f['prompt_tokens']:>12.0f}"
            f"{f['completion_tokens']:>12.0f}{f['job_seconds']:>10.1f}"
        )


@main.group()
def policy() -> None:
    """What --speculative auto and --max-batch auto measured, shared by the fleet."""


@policy.command("show")
@_redis_option
@click.option("--json", "as_json", is_flag=True, help="Print the merged figures as JSON.")
def policy_show(redis_url: str, as_json: bool) -> None:
    """Per target and machine kind: plain and speculative speeds, acceptance, batch speeds,
    merged over the workers that measured them."""
    found, notes = beliefs(_connect(redis_url))
    if as_json:
        rows = [
            {
                "target": b.label.target,
                "machine_kind": b.label.kind,
                "mlx": b.label.mlx,
                "workers": b.workers,
                "figures": b.figures.model_dump(mode="json") if b.figures else None,
            }
            for b in found
        ]
        click.echo(json.dumps(rows))
        return
    click.echo(beliefs_table(found, notes))


@policy.command("reset")
@_redis_option
@click.option("--model", default=None, help="Only figures where this model is target or draft.")
def policy_reset(redis_url: str, model: str | None) -> None:
    """Forget shared figures (all, or one model's): workers measure again at their next job
    of it (a running worker keeps what it holds until it restarts)."""
    from producer.figures import reset

    n = reset(_connect(redis_url), model)
    click.echo(f"forgot the figures of {n} target(s) x machine kind(s)")


@main.group()
def acl() -> None:
    """Least-privilege Redis users per role: write the ACL file, check a live Redis."""


@acl.command("file")
@click.option(
    "--from-env",
    is_flag=True,
    help="Passwords from MLXQ_ACL_<ROLE>_PASSWORD (ADMIN, PRODUCER, WORKER, GATEWAY, READER, "
    "EXPORTER, REPLICA, SENTINEL) [default: @ROLE_PASSWORD@ placeholders].",
)
def acl_file_command(from_env: bool) -> None:
    """Print the ACL file (redis-server --aclfile) with a user per role."""
    from producer.acl import ROLES, acl_file

    passwords = None
    if from_env:
        roles = ["admin", *ROLES]
        passwords = {r: os.environ.get(f"MLXQ_ACL_{r.upper()}_PASSWORD", "") for r in roles}
    try:
        click.echo(acl_file(passwords), nl=False)
    except ValueError as e:
        raise click.ClickException(f"{e} (set MLXQ_ACL_<ROLE>_PASSWORD)") from None


@acl.command("check")
@click.argument("user")
@click.option("--role", required=True, help="producer, worker, gateway, reader or exporter.")
@_redis_option
def acl_check(user: str, role: str, redis_url: str) -> None:
    """Check that USER may run what ROLE needs and nothing it must not (ACL DRYRUN;
    --redis-url must be an admin user's)."""
    from producer.acl import ROLES, check

    if role not in ROLES:
        raise click.BadParameter(f"{role!r} is not one of {', '.join(ROLES)}", param_hint="--role")
    try:
        problems = check(_connect(redis_url), user, role)
    except RedisError as e:
        raise click.ClickException(f"ACL DRYRUN failed (is --redis-url an admin's?): {e}") from None
    for p in problems:
        click.echo(p)
    if problems:
        raise click.ClickException(
            f"user {user!r} does not fit role {role!r}: {len(problems)} problem(s)"
        )
    click.echo(f"user {user!r} fits role {role!r}")


@main.command()
@click.argument("job_id")
@_redis_option
@click.option(
    "--timeout",
    type=click.FloatRange(min=0),
    default=None,
    help="Give up after this many seconds [default: wait].",
)
@click.option("--json", "as_json", is_flag=True, help="Print each chunk object as a JSON line.")
def tail(job_id: str, redis_url: str, timeout: float | None, as_json: bool) -> None:
    """Print a streaming job's text live (jobs submitted with "stream": true)."""
    conn = _connect(redis_url)
    try:
        for chunk in iter_chunks(conn, job_id, timeout=timeout):
            if as_json:
                click.echo(json.dumps(chunk))
            elif chunk.get("error"):
                raise click.ClickException(f"job failed: {chunk['error'].get('message')}")
            else:
                click.echo(chunk_text(chunk), nl=False)
    except TimeoutError as e:
        raise click.ClickException(str(e)) from None
    if not as_json:
        click.echo()


@main.command()
@_redis_option
@click.option("--host", envvar="MLXQ_GATEWAY_HOST", default="127.0.0.1", show_default=True)
@click.option(
    "--port",
    envvar="MLXQ_GATEWAY_PORT",
    type=click.IntRange(1, 65535),
    default=8000,
    show_default=True,
)
@click.option(
    "--api-key-file",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    default=None,
    help="API keys, one per line: KEY, KEY TENANT [WEIGHT], or KEY * for an operator "
    "(also env MLXQ_API_KEYS: KEY, KEY=TENANT[:WEIGHT], KEY=*; comma-separated).",
)
@click.option("--no-auth", is_flag=True, help="Accept requests without a key (local use only).")
@click.option(
    "--allow-model",
    "allow_models",
    multiple=True,
    envvar="MLXQ_ALLOW_MODELS",
    help="Glob of models clients may name (repeatable; default: any).",
)
@click.option(
    "--queue",
    envvar=ENV_QUEUE,
    default=keys.DEFAULT_QUEUE,
    show_default=True,
    callback=check_queue,
    help="Queue of Batch API jobs.",
)
@click.option(
    "--interactive-queue",
    default=keys.INTERACTIVE_QUEUE,
    show_default=True,
    callback=check_queue,
    help="Queue of chat completions (workers serve it first by default).",
)
@click.option(
    "--max-queued",
    type=click.IntRange(1),
    default=256,
    show_default=True,
    help="Answer 429 while the interactive queue holds this many jobs.",
)
@click.option(
    "--max-file-mb", type=click.IntRange(1), default=200, show_default=True, help="Largest upload."
)
@click.option(
    "--max-body-mb",
    type=click.IntRange(1),
    default=8,
    show_default=True,
    help="Largest request body.",
)
@click.option(
    "--timeout",
    "chat_timeout",
    type=click.FloatRange(1),
    default=600.0,
    show_default=True,
    help="Seconds a chat completion waits for its result (504 after).",
)
@click.option(
    "--workers", type=click.IntRange(1), default=1, show_default=True, help="Gateway processes."
)
@wait_replicas_option("each enqueue")
def serve(
    redis_url: str,
    host: str,
    port: int,
    api_key_file: Path | None,
    no_auth: bool,
    allow_models: tuple[str, ...],
    queue: str,
    interactive_queue: str,
    max_queued: int,
    max_file_mb: int,
    max_body_mb: int,
    chat_timeout: float,
    workers: int,
    wait_replicas: int,
) -> None:
    """Serve an OpenAI-compatible API (chat completions, Batch API, models) on this Redis."""
    import os

    import uvicorn

    from producer.serve.settings import (
        ENV_API_KEYS,
        ENV_CONFIG,
        MB,
        GatewaySettings,
        load_api_keys,
        load_key_tenants,
        load_operator_keys,
        load_tenant_weights,
    )
    from producer.tenants import set_weight

    try:
        api_keys = load_api_keys(api_key_file, os.environ.get(ENV_API_KEYS))
        key_tenants = load_key_tenants(api_key_file, os.environ.get(ENV_API_KEYS))
        operator_keys = load_operator_keys(api_key_file, os.environ.get(ENV_API_KEYS))
        weights = load_tenant_weights(api_key_file, os.environ.get(ENV_API_KEYS))
    except ValueError as e:
        raise click.UsageError(f"API keys: {e}") from None
    if not api_keys and not no_auth:
        raise click.UsageError(
            "no API keys: pass --api-key-file or set MLXQ_API_KEYS (or --no-auth)"
        )
    conn = _connect(redis_url)
    for tenant, weight in sorted(weights.items()):  # the key file's weights: set at start
        set_weight(conn, tenant, weight)
        click.echo(f"tenant {tenant}: weight {weight:g} (from the API keys)", err=True)
    settings = GatewaySettings(
        redis_url=redis_url,
        api_keys=api_keys,
        key_tenants=key_tenants,
        operator_keys=operator_keys,
        auth=not no_auth,
        allow_models=allow_models,
        queue=queue,
        interactive_queue=interactive_queue,
        max_interactive=max_queued,
        max_file_bytes=max_file_mb * MB,
        max_body_bytes=max_body_mb * MB,
        chat_timeout_s=chat_timeout,
        wait_replicas=wait_replicas,
    )
    os.environ[ENV_CONFIG] = settings.to_env()
    click.echo(
        f"mlxq gateway on http://{host}:{port}/v1 ({len(api_keys)} API key(s), Redis "
        f"{redact_url(redis_url)}, {workers} process(es))",
        err=True,
    )
    uvicorn.run(
        "producer.serve.app:factory",
        factory=True,
        host=host,
        port=port,
        workers=workers,
        log_level="warning",
        access_log=False,
    )


if __name__ == "__main__":
    main()
