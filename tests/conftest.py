"""Shared fixtures: a real redis-server on a free port, tiny real models, an in-process worker."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from redis import Redis
from redis.exceptions import RedisError

from producer.localredis import LocalRedis
from schemas import keys
from tests.waiting import clear, seconds, wait_for, watch

#: The quick tier (``bash tests/run.sh -m quick``, about a minute here): the pure modules'
#: tests and the engines' on the smallest tiny models, plus one job through a real worker
#: and Redis on each path (alone, batched, speculative, speculative batch, prompt lookup,
#: streamed, ``n``, a reused prefix, a schema, tools, reasoning, embeddings). CI runs
#: everything.
QUICK_FILES = {
    "test_step.py",
    "test_batching.py",
    "test_blas.py",
    "test_cache.py",
    "test_choices.py",
    "test_coalesce.py",
    "test_engine.py",
    "test_fairshare.py",
    "test_figures.py",
    "test_goodput.py",
    "test_imagehead.py",
    "test_lifecycle.py",
    "test_logprobs.py",
    "test_lookup.py",
    "test_notify.py",
    "test_policy.py",
    "test_producer_cli.py",
    "test_retry.py",
    "test_schemas.py",
    "test_specbatch.py",
    "test_store.py",
    "test_structure.py",
    "test_twice.py",
    "test_vision.py",
    "test_worker.py",
}
QUICK_TESTS = {
    "tests/test_audio.py::test_every_format_and_sample_rate_decodes_to_16khz_mono",
    "tests/test_audio.py::test_the_timestamp_rule_rules_out_what_mlx_whisper_rules_out",
    "tests/test_audio.py::test_jobs_file_paths_stay_under_their_root",
    "tests/test_messages.py::test_the_translation_keeps_roles_calls_and_results_in_order",
    "tests/test_messages.py::test_errors_have_anthropics_shape_and_name_what_is_wrong",
    "tests/test_constrained.py::test_bad_constraints_are_refused_naming_the_field",
    "tests/test_constrained.py::test_the_output_matches_alone_batched_speculative_streamed_and_n",
    "tests/test_budget.py::test_the_forced_marker_of_several_tokens_is_finished",
    "tests/test_budget.py::test_the_budget_closes_the_thinking_on_every_path",
    "tests/test_stop.py::test_the_least_time_limit_wins_and_is_named",
    "tests/test_stop.py::test_a_bad_time_limit_is_refused_by_name",
    "tests/test_stop.py::test_responses_and_completions_carry_the_time_limit",
    "tests/test_stop.py::test_cancel_flags_are_read_from_redis_and_a_passed_limit_stops",
    "tests/test_group.py::test_a_transport_failure_inside_any_group_call_is_a_lost_group",
    "tests/test_kvquant.py::test_a_batch_of_quantized_rows_gives_each_row_back_exactly",
    "tests/test_kvquant.py::test_a_pass_of_several_tokens_attends_dequantized_and_keeps_them_quantized",
    "tests/test_kvquant.py::test_right_padded_prefill_rolls_the_quantized_rows_like_plain_ones",
    "tests/test_kvquant.py::test_bad_kv_flags_are_refused_by_name",
    "tests/test_fleet.py::test_stream_chunks_concatenate_to_the_final_message",
    "tests/test_prefix.py::test_same_output_with_and_without_the_cache_and_cached_tokens_say_so",
    "tests/test_structured.py::test_schema_is_enforced_alone_batched_speculative_and_streamed",
    "tests/test_structured.py::test_bad_response_formats_are_refused_naming_the_problem",
    "tests/test_tools.py::test_hostile_tool_requests_are_refused_by_name",
    "tests/test_tools.py::test_forced_calls_validate_and_agree_on_every_path",
    "tests/test_reasoning.py::test_the_split_and_the_count",
    "tests/test_reasoning.py::test_every_live_view_is_a_prefix_of_the_final_message",
    "tests/test_hostile.py::test_hostile_hashes_run_nothing_and_every_worker_goes_on",
    "tests/test_interactive.py::test_interactive_jobs_end_while_the_batch_runs",
    "tests/test_interactive.py::test_an_interactive_prompt_prefills_before_batch_prompts_still_waiting",
    "tests/test_interactive.py::test_preemptions_and_latencies_per_queue_are_exported",
    "tests/test_interactive.py::test_a_side_batch_reserves_its_kv_room_beside_the_batch",
    "tests/test_embeddings.py::test_every_input_shape_embeds_the_same_alone_and_in_company",
    "tests/test_embeddings.py::test_bad_inputs_fail_alone_with_a_400_naming_what",
    "tests/test_embeddings.py::test_batch_lines_mix_chat_and_embeddings_and_refuse_bad_ones_by_line",
    "tests/test_legacy.py::test_raw_prompts_continue_the_text_on_every_path",
    "tests/test_responses.py::test_the_translation_keeps_roles_calls_and_outputs_in_order",
    "tests/test_ui.py::test_the_page_loads_without_a_key_and_its_data_needs_one",
    "tests/test_shapes.py::test_responses_and_completions_lines_run_beside_chat_lines",
    "tests/test_shapes.py::test_bad_shaped_lines_are_refused_by_line_and_name",
    "tests/test_prefixdisk.py::test_corrupt_truncated_and_foreign_files_are_skipped_deleted_and_never_fail_a_job",
    "tests/test_prefixdisk.py::test_speculative_jobs_take_the_draft_prefix_from_disk_too",
}


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark the quick tier (:data:`QUICK_FILES`, :data:`QUICK_TESTS`); never a slow or
    real-model test."""
    for item in items:
        slow = item.get_closest_marker("slow") or item.get_closest_marker("real")
        quick = item.path.name in QUICK_FILES or item.nodeid.split("[")[0] in QUICK_TESTS
        if quick and not slow:
            item.add_marker(pytest.mark.quick)


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory) -> Iterator[LocalRedis]:
    server = LocalRedis(data_dir=tmp_path_factory.mktemp("redis"))
    server.start()
    yield server
    server.stop()


@pytest.fixture
def redis_url(redis_server) -> str:
    Redis.from_url(redis_server.url).flushall()
    return redis_server.url


@pytest.fixture
def conn(redis_url) -> Redis:
    return Redis.from_url(redis_url)


@dataclass(frozen=True)
class TinyModels:
    target: str
    draft: str  # same tokenizer, different weights: low acceptance
    twin: str  # same weights and tokenizer as target: acceptance 1.0
    alien: str  # same vocab size, different vocabulary: incompatible
    small_ctx: str  # same as target with a 64-token context
    slow: str  # 4 x 256, 8k context: ~1,000 tokens take seconds (for fault injection)
    root: Path


@pytest.fixture(scope="session")
def tiny(tmp_path_factory) -> TinyModels:
    from worker.dev.tinymodels import TinySpec, ensure_model

    root = tmp_path_factory.mktemp("models")
    spec = TinySpec(layers=2, hidden=64, intermediate=128, seed=1)
    target = ensure_model(root / "target", spec)
    draft = ensure_model(root / "draft", TinySpec(layers=1, hidden=32, intermediate=64, seed=2))
    twin = root / "twin"
    shutil.copytree(target, twin)
    alien = ensure_model(
        root / "alien", TinySpec(layers=1, hidden=32, intermediate=64, seed=3, tokenizer_seed=7)
    )
    small = root / "small-ctx"
    shutil.copytree(target, small)
    config = json.loads((small / "config.json").read_text())
    config["max_position_embeddings"] = 64
    (small / "config.json").write_text(json.dumps(config))
    slow = ensure_model(
        root / "slow", TinySpec(layers=4, hidden=256, intermediate=512, context=8192, seed=5)
    )
    return TinyModels(str(target), str(draft), str(twin), str(alien), str(small), str(slow), root)


def chat(model: str, content: str = "hello queue", **fields) -> dict:
    return {"model": model, "messages": [{"role": "user", "content": content}], **fields}


def write_jsonl(path: Path, lines: list) -> Path:
    path.write_text("".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines))
    return path


def run_worker(redis_url: str, queues=("mlxq",), runtime=None, max_jobs=None, max_batch=1):
    """Run an in-process worker in burst mode until the queues are empty."""
    from worker.runner import runtime as rt_mod
    from worker.runner.loop import Worker

    rt = runtime or rt_mod.WorkerRuntime(worker_id="test-worker")
    conn = Redis.from_url(redis_url)
    name = f"w{time.monotonic_ns()}"
    worker = Worker(
        conn, list(queues), rt, name=name, max_batch=max_batch, burst=True, max_jobs=max_jobs
    )
    worker.work()
    return rt


def run_jobs(
    conn,
    redis_url: str,
    jobs: dict,
    batch_id: str,
    max_batch=1,
    policy=None,
    cache=None,
    **rt_fields,
) -> dict:
    """Submit ``jobs`` as batch ``batch_id``, serve them with a fresh in-process worker
    (``cache`` or a fresh model cache; ``policy`` or auto), and return their records by
    custom_id."""
    from producer import Client
    from schemas.store import read_result
    from worker.engine.models import ModelCache
    from worker.runner import runtime as rt_mod
    from worker.schedule.policy import SpeculationPolicy

    s = Client(connection=conn).submit(jobs, batch_id=batch_id)
    rt = rt_mod.WorkerRuntime(
        cache=cache or ModelCache(),
        worker_id=batch_id,
        policy=policy or SpeculationPolicy("auto"),
        **rt_fields,
    )
    run_worker(redis_url, runtime=rt, max_batch=max_batch)
    return {r.custom_id: r for r in (read_result(conn, j) for j in s.job_ids)}


class WorkerProc:
    """A real ``worker`` process (or ``command``, e.g. a wrapper that slows model loads).
    Watched while its test runs (``tests.waiting``): a wait fails at once if it dies
    unasked (not signalled, not waited for) with an error."""

    def __init__(
        self,
        redis_url: str,
        tmp: Path,
        *args: str,
        name: str = "w",
        command: list[str] | None = None,
        env: dict[str, str] | None = None,
    ) -> None:
        self.name, self.worker_name, self.url = f"worker {name}", name, redis_url
        self.expected_exit = "--burst" in args
        self.served = False  # seen serving (its signal handlers in place)
        self.log = tmp / f"worker-{name}-{time.monotonic_ns()}.log"
        exe = command or [str(Path(sys.executable).with_name("worker"))]
        full_env = os.environ | {"MLXQ_REDIS_URL": redis_url} | (env or {})
        with open(self.log, "w") as log:
            self.proc = subprocess.Popen(
                [*exe, "--name", name, "-v", *args],
                env=full_env,
                stdout=subprocess.DEVNULL,
                stderr=log,
            )

    def signal(self, sig: int) -> None:
        """Send ``sig``. A stop signal (SIGTERM, SIGINT) waits until the worker serves
        (or has exited): before its handlers are in place the signal would kill it."""
        if sig in (signal.SIGTERM, signal.SIGINT) and not self.served:
            conn = Redis.from_url(self.url)
            key = keys.worker_key(self.worker_name)

            def ready() -> bool:
                try:
                    return self.proc.poll() is not None or bool(conn.exists(key))
                except RedisError:  # (a test that took Redis away: it saw it serve)
                    return True

            wait_for(ready, what=f"{self.name} serving before a stop signal")
        self.expected_exit = True
        self.proc.send_signal(sig)

    def wait(self, timeout: float = 60) -> int:
        """Its exit status, within ``timeout`` reference seconds (``tests.waiting``)."""
        self.expected_exit = True
        return self.proc.wait(seconds(timeout))

    def stop(self) -> None:
        self.expected_exit = True
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(seconds(10))

    def serving(self) -> None:
        """Wait until it serves: its state is published once its signal handlers are in
        place (a signal before that kills it instead of stopping it)."""
        conn = Redis.from_url(self.url)
        key = keys.worker_key(self.worker_name)
        wait_for(lambda: conn.exists(key), what=f"{self.name} serving")
        self.served = True

    def begun(self, job_id: str) -> None:
        """Wait until it has begun ``job_id`` (its log says so): a stop from then on lets
        the job end, where a stop during the take hands it back unstarted."""
        wait_for(lambda: f"job {job_id} begun" in self.output, what=f"{self.name} begins {job_id}")

    def returncode(self) -> int | None:
        return self.proc.poll()

    def tail(self, lines: int = 30) -> str:
        return "\n".join(self.output.splitlines()[-lines:])

    @property
    def output(self) -> str:
        return self.log.read_text()


@pytest.fixture
def workers(redis_url, tmp_path, tmp_path_factory):
    """Start real worker processes. Their model directory is this test run's temporary
    root (every test model lives under it), unless ``env`` sets ``MLXQ_MODEL_DIRS``."""
    started: list[WorkerProc] = []
    dirs = {"MLXQ_MODEL_DIRS": str(tmp_path_factory.getbasetemp())}

    def start(
        *args: str,
        name: str = "w",
        url: str | None = None,
        command: list[str] | None = None,
        env: dict[str, str] | None = None,
    ) -> WorkerProc:
        env = dirs | (env or {})
        w = WorkerProc(url or redis_url, tmp_path, *args, name=name, command=command, env=env)
        started.append(w)
        watch(w)
        return w

    yield start
    for w in started:
        w.stop()


@pytest.fixture(autouse=True)
def _watched_processes() -> Iterator[None]:
    """Processes a test watches (``tests.waiting.watch``) are its own."""
    yield
    clear()


def pytest_terminal_summary(terminalreporter) -> None:
    """Print the fault-injection figures gathered by tests/test_faults.py."""
    faults = sys.modules.get("tests.test_faults")
    if faults is not None and faults.FAULT_REPORT:
        terminalreporter.write_line("fault injection: " + json.dumps(faults.FAULT_REPORT))
