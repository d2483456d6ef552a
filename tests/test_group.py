"""One model across ranks: a worker group on mlx.distributed (``worker --shard``).

Two ranks on this machine, started by mlx's own launcher over its ring backend (TCP),
exactly as across Macs (``mlx.launch --hosts mac1,mac2``): rank 0 serves Redis, rank 1
follows. Each job's text must be the text of the same job on one unsplit model (greedy),
alone and in a continuous batch, streamed, with a schema and with logprobs, and
speculative (rank 0's draft, prompt lookup); what a group does not do yet (adapters, a
model mlx-lm cannot split) ends by name.
"""

from __future__ import annotations

import os
import random
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from schemas import ChatRequest
from schemas.store import read_result
from tests.conftest import chat
from tests.test_structured import schema_format
from tests.waiting import seconds
from worker.dev.tinymodels import TinySpec, ensure_model
from worker.engine.generator import ChatGenerator
from worker.engine.models import ModelCache

LONG = "the queue worker model token draft target redis job batch result metric apple silicon"
BIN = Path(sys.executable).parent


def _free_port_run(n: int) -> int:
    """A base port with ``n`` free ports from it (the ring backend takes one per rank),
    below the ephemeral range: no outgoing connection (a Redis client of a test running
    beside this one) can take one between this check and the ring's bind."""
    low, _ = (int(x) for x in Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    rng = random.Random()
    for _ in range(200):
        base = rng.randrange(max(1024, low - 12000), low - n)
        if all(_free(base + i) for i in range(n)):
            return base
    raise RuntimeError("no run of free ports")


def _free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
            return True
        except OSError:
            return False


def run_group(redis_url: str, tmp: Path, *args: str, timeout: float = 240) -> str:
    """A worker group of 2 ranks with ``--burst``: its combined log once it has exited."""
    log = tmp / f"group-{time.monotonic_ns()}.log"
    cmd = [
        str(BIN / "mlx.launch"),
        "--backend",
        "ring",
        "-n",
        "2",
        "--starting-port",
        str(_free_port_run(2)),
        "--",
        str(BIN / "worker"),
        "--burst",
        "-v",
        *args,
    ]
    env = os.environ | {"MLXQ_REDIS_URL": redis_url}
    with open(log, "w") as out:
        p = subprocess.run(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, timeout=timeout)
    text = log.read_text()
    assert p.returncode == 0, text[-3000:]
    return text


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("group")
    made = {
        arch: str(ensure_model(root / arch, TinySpec(arch=arch, layers=4, seed=2)))
        for arch in ("llama", "qwen3_moe", "qwen3_next", "gemma3_text")
    }
    made["draft"] = str(ensure_model(root / "draft", TinySpec(layers=2, seed=5)))
    made["long"] = str(ensure_model(root / "long", TinySpec(layers=4, seed=3, context=8192)))
    return made | {"dir": str(root)}


def _plain_text(model: str, body: dict) -> str:
    gen = ChatGenerator.get_or_create(model, cache=ModelCache(prefix_bytes=0))
    return gen.generate(ChatRequest.model_validate(body)).text


@pytest.mark.parametrize(("arch", "max_batch"), [("qwen3_moe", "1"), ("llama", "4")])
def test_a_split_model_gives_each_job_the_text_of_the_whole_one(
    conn, redis_url, tmp_path, models, arch, max_batch
):
    """Tensor parallel (a dense llama, an MoE qwen3_moe): plain, streamed, a schema,
    logprobs, a regex, penalties, XTC, alone (--max-batch 1) and in a continuous batch (4)."""
    from producer import Client

    target = models[arch]

    def body(i: int, **fields) -> dict:
        return (
            chat(target, f"{LONG} {i} " + "job " * i, max_tokens=24) | {"temperature": 0} | fields
        )

    jobs = {
        "plain": body(0),
        "stream": body(1, stream=True),
        "schema": body(2, response_format=schema_format(), max_tokens=40),
        "logprobs": body(3, logprobs=True, top_logprobs=2),
        "more": body(5),
        "sampled": body(6, temperature=0.9, seed=7),  # the same draws on both ranks
        # request controls: each rank rebuilds the grammar and the XTC tokens alike
        "regex": body(7, structured_outputs={"regex": "[a-z]{2,8}( [a-z]{2,8}){0,3}"}),
        "penalty": body(8, repetition_penalty=1.5, min_tokens=8),
        "xtc": body(9, temperature=0.9, seed=3, xtc_probability=0.5, xtc_threshold=0.05),
    }
    s = Client(connection=conn).submit(jobs)
    args = ("--shard", "auto", "--max-batch", max_batch, "--model-dir", models["dir"])
    log = run_group(redis_url, tmp_path, *args)
    assert "split by tensor parallelism across 2 ranks" in log
    # each rank holds about half the weights (the tied embedding is whole on each)
    whole, _ = ModelCache(prefix_bytes=0).get(target)
    held = [float(m) for m in re.findall(rf"loaded \S+/{arch} in \S+ \(([\d.]+) MB\)", log)]
    assert len(held) == 2 and all(mb * 1e6 < 0.75 * whole.nbytes for mb in held), held
    for rid in s.job_ids:
        r = read_result(conn, rid)
        assert r is not None and r.status == "succeeded", (r.custom_id if r else rid, r and r.error)
        body_ = jobs[r.custom_id] | {"stream": False}
        assert r.response.choices[0].message.content == _plain_text(target, body_), r.custom_id
    if max_batch == "4":
        sizes = [read_result(conn, rid).metrics.batch_size for rid in s.job_ids]
        assert max(sizes) > 1, sizes  # they ran as a batch, mirrored on both ranks


@pytest.mark.parametrize(("arch", "max_batch"), [("llama", "1"), ("qwen3_next", "4")])
def test_a_group_speculates_with_rank_0s_draft_and_by_prompt_lookup(
    conn, redis_url, tmp_path, models, arch, max_batch
):
    """Speculation in a group: rank 0 holds the draft whole (a random one: most proposals
    rejected, so every round rewinds) and proposes; every rank verifies. Greedy text is
    the whole model's plain text, alone (--max-batch 1, tensor parallel llama) and in a
    speculative batch (4, pipeline qwen3_next, whose recurrent layers rewind by replay),
    by a draft and by prompt lookup, streamed, with a schema and logprobs; a sampled job
    keeps the ranks in step (the jobs after it still match)."""
    from producer import Client

    target, draft = models[arch], models["draft"]
    repeat = "alpha beta gamma delta " * 6  # (prompt lookup finds its proposals here)

    def body(i: int, **fields) -> dict:
        base = chat(target, f"{repeat}{LONG} {i}", max_tokens=24) | {"temperature": 0}
        return base | {"draft_model": draft} | fields

    lookup = {"draft_model": None, "speculation": {"method": "prompt_lookup", "ngram_min": 1}}
    jobs = {
        "sampled": body(0, temperature=0.9, seed=7),
        "draft": body(1),
        "stream": body(2, stream=True),
        "schema": body(3, response_format=schema_format(), max_tokens=40),
        "logprobs": body(4, logprobs=True, top_logprobs=2),
        "lookup": body(5, **lookup),
        "lookup2": body(6, **lookup),
        "more": body(7),
    }
    s = Client(connection=conn).submit(jobs)
    args = ("--shard", "auto", "--max-batch", max_batch, "--speculative", "always")
    log = run_group(redis_url, tmp_path, *args, "--model-dir", models["dir"])
    assert "draft (whole, on rank 0 alone)" in log
    got = {r.custom_id: r for r in (read_result(conn, j) for j in s.job_ids)}
    for name, r in got.items():
        assert r.status == "succeeded", (name, r.error)
        assert r.metrics.speculative, name
        if name == "sampled":
            continue
        plain = jobs[name] | {"stream": False, "draft_model": None, "speculation": None}
        assert r.response.choices[0].message.content == _plain_text(target, plain), name
    assert got["draft"].metrics.draft_tokens_proposed > got["draft"].metrics.draft_tokens_accepted
    if max_batch == "4":
        assert max(r.metrics.batch_size for r in got.values()) > 1


@pytest.mark.parametrize(("arch", "max_batch"), [("llama", "1"), ("qwen3_next", "4")])
def test_a_group_keeps_shared_prefixes_on_every_rank(
    conn, redis_url, tmp_path, models, arch, max_batch
):
    """The prefix cache in a group: each rank keeps its part of every shared prefix (rank
    0 tells each prefill and each entry it drops). Two system prompts take turns under
    a prefix budget of about one entry (each new entry drops the other), alone (tensor
    llama) and batched (pipeline qwen3_next: recurrent entries), plain and speculative
    (rank 0's draft keeps its own entries): later jobs start from a kept prefix
    (cached_tokens) and every job's text is the whole model's without a prefix cache."""
    from producer import Client

    target = models[arch]
    systems = [f"{LONG} {word} " * 4 for word in ("first", "second")]

    def body(i: int, **fields) -> dict:
        messages = [
            {"role": "system", "content": systems[(i // 2) % 2]},
            {"role": "user", "content": f"job {i} " * (1 + i % 3)},
        ]
        return {"model": target, "messages": messages, "max_tokens": 12, "temperature": 0} | fields

    jobs = {f"j{i}": body(i) for i in range(8)}
    jobs |= {f"d{i}": body(i, draft_model=models["draft"]) for i in (8, 9)}
    s = Client(connection=conn).submit(jobs)
    args = ("--shard", "auto", "--max-batch", max_batch, "--speculative", "always")
    args += ("--prefix-cache-gb", "0.0002", "--model-dir", models["dir"])
    run_group(redis_url, tmp_path, *args)
    got = {r.custom_id: r for r in (read_result(conn, j) for j in s.job_ids)}
    for name, r in got.items():
        assert r.status == "succeeded", (name, r.error)
        plain = jobs[name] | {"draft_model": None}
        assert r.response.choices[0].message.content == _plain_text(target, plain), name
    assert sum(r.metrics.cached_tokens > 0 for r in got.values()) >= 4
    assert any(got[d].metrics.speculative and got[d].metrics.cached_tokens for d in ("d8", "d9"))


def test_pipeline_where_the_model_has_no_tensor_split_and_refusals_by_name(
    conn, redis_url, tmp_path, models
):
    """qwen3_next has only mlx-lm's pipeline: auto takes it, and its text is the whole
    model's, n choices too (their prompt prefilled once, as a kept prefix every rank
    holds, then dropped); a model mlx-lm cannot split (gemma3_text) fails by name; the
    group goes on serving after each."""
    from producer import Client

    nxt, gemma = models["qwen3_next"], models["gemma3_text"]
    good = chat(nxt, LONG, max_tokens=20) | {"temperature": 0}
    longer = chat(nxt, f"{LONG} {LONG} {LONG}", max_tokens=20) | {"temperature": 0}
    jobs = {
        "good": good,
        "n": longer | {"n": 2},  # (long enough for its choices to share one kept prefill)
        "gemma": chat(gemma, LONG, max_tokens=8),
        "after": chat(nxt, LONG + " again", max_tokens=12) | {"temperature": 0},
    }
    s = Client(connection=conn).submit(jobs)
    log = run_group(redis_url, tmp_path, "--shard", "auto", "--model-dir", models["dir"])
    assert "split by pipeline parallelism across 2 ranks" in log
    got = {r.custom_id: r for r in (read_result(conn, j) for j in s.job_ids)}
    for name in ("good", "after"):
        assert got[name].status == "succeeded", got[name].error
        assert got[name].response.choices[0].message.content == _plain_text(nxt, jobs[name])
    choices = got["n"].response.choices  # n choices: each rank runs them all
    assert [c.message.content for c in choices] == [_plain_text(nxt, longer)] * 2
    assert got["gemma"].status == "failed" and "cannot be split" in got["gemma"].error.message


def test_shard_without_a_group_is_refused_by_name(redis_url):
    p = subprocess.run(
        [str(BIN / "worker"), "--shard", "auto", "--burst"],
        env=os.environ | {"MLXQ_REDIS_URL": redis_url},
        capture_output=True,
        text=True,
        timeout=seconds(60),
    )
    assert p.returncode == 2 and "mlx.launch" in p.stderr, p.stderr


def _rank_pid(launcher: int, rank: int) -> int:
    """The pid of ``rank`` among the processes ``mlx.launch`` (pid ``launcher``) started."""
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            stat = (proc / "stat").read_text().rsplit(")", 1)[1].split()
            env = (proc / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if int(stat[1]) == launcher and f"MLX_RANK={rank}".encode() in env:
            return int(proc.name)
    raise AssertionError(f"no rank {rank} under {launcher}")


@pytest.mark.parametrize("fault", ["kill-1", "kill-0", "stop-1", "spec-kill-1"])
def test_a_rank_lost_mid_batch_loses_no_job(conn, redis_url, tmp_path, models, workers, fault):
    """A rank lost while the group decodes a batch (plain, or speculative: "spec-"): SIGKILL
    of rank 1 (its collectives fail) or SIGSTOP (they never return: rank 0's
    --group-timeout ends it) makes rank 0 hand its jobs back with no crash counted;
    SIGKILL of rank 0 leaves them to their leases. Either way each job then runs once,
    with the whole model's text: on a worker on one machine, or (after the hang) on the
    group restarted."""
    import json
    import signal

    from producer import Client
    from schemas import keys
    from tests.test_faults import one_result, running_execution
    from tests.waiting import wait_for

    spec = fault.startswith("spec-")  # a speculative batch (rank 0's draft proposes)
    fault = fault.removeprefix("spec-")
    how, victim = fault.split("-")
    target = models["llama"]
    eos = json.loads((Path(target) / "config.json").read_text())["eos_token_id"]

    def body(i: int) -> dict:
        base = chat(target, f"{LONG} {i}", max_tokens=160) | {"temperature": 0}
        base |= {"draft_model": models["draft"]} if spec else {}
        return base | {"logit_bias": {str(eos): -100}}  # all 160 tokens: time to kill

    jobs = {f"j{i}": body(i) for i in range(4)}
    s = Client(connection=conn).submit(jobs)
    launch = [str(BIN / "mlx.launch"), "--backend", "ring", "-n", "2"]
    launch += ["--starting-port", str(_free_port_run(2)), "--", str(BIN / "worker")]
    args = ("--shard", "auto", "--max-batch", "4", "--lease-seconds", "2", "--group-timeout", "4")
    args += ("--speculative", "always") if spec else ()
    group = workers(*args, command=launch)
    wait_for(lambda: any(running_execution(conn, j) for j in s.job_ids), timeout=120)
    wait_for(lambda: group.output.count(" loaded ") >= 2, timeout=120)  # both ranks: decoding
    time.sleep(0.5)
    pid, leader = _rank_pid(group.proc.pid, int(victim)), _rank_pid(group.proc.pid, 0)
    group.expected_exit = True  # (the group ends of this: waits go on without it)
    os.kill(pid, signal.SIGKILL if how == "kill" else signal.SIGSTOP)
    try:
        wait_for(lambda: not _alive(leader), timeout=60)
        if victim == "1":  # rank 0 handed every job back: none is held, none crashed
            assert not conn.hlen(keys.RUNNING)
            assert not any(conn.exists(keys.crashes_key(j)) for j in s.job_ids)
    finally:
        if how == "stop":
            os.kill(pid, signal.SIGKILL)  # (a stopped rank never exits by itself)
    group.wait(60)
    said = {"kill-1": "lost a rank", "stop-1": "the worker group hung: a step"}
    assert said.get(fault, "") in group.log.read_text(), group.log.read_text()[-2000:]
    if how == "stop":  # the group again, restarted: it takes the jobs handed back
        run_group(
            redis_url, tmp_path, "--shard", "auto", "--max-batch", "4", "--model-dir", models["dir"]
        )
    else:
        alone = workers("--lease-seconds", "2", name="alone")
    for rid in s.job_ids:
        r = one_result(conn, rid, timeout=180)
        assert r.status == "succeeded", r.error
        assert r.response.usage.completion_tokens == 160
        want = _plain_text(target, jobs[r.custom_id] | {"draft_model": None})
        assert r.response.choices[0].message.content == want, r.custom_id
    if how != "stop":
        alone.signal(signal.SIGTERM)
        assert alone.wait() == 0


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie, exited but not yet reaped, does not)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def test_a_transport_failure_inside_any_group_call_is_a_lost_group():
    """A peer that dies mid-forward fails mlx's collective inside the model's own layers
    (``[ring] connection to a peer was lost`` out of mlx-lm's step), not in the group's
    message sums: it must end the group (GroupLost: the jobs go back), never fail the
    batch's jobs as a generation error; and a lost group never calls the transport again
    (a lost ring can hang instead of failing: the close after it did)."""
    from types import SimpleNamespace

    import mlx.core as mx

    from worker.engine.group import Group, GroupLost
    from worker.engine.mirror import GroupEngine

    class Dies:
        models = ()

        def step(self):
            raise RuntimeError("[ring] connection to a peer was lost")

        def close(self):
            pass

    group = Group(mx.distributed.init(), "auto")
    with pytest.raises(RuntimeError, match="shape"), group.call("a step"):
        raise RuntimeError("shape mismatch")  # a job's own error stays one
    assert not group.lost
    engine = GroupEngine(group, Dies(), SimpleNamespace(name="m", adapter=None))
    with pytest.raises(GroupLost, match="a step"):
        engine.step()
    assert group.lost
    with pytest.raises(GroupLost, match="lost earlier"):
        engine.close()  # (no collective on a lost group)


@pytest.mark.parametrize("max_batch", ["1", "4"])
def test_a_group_stops_a_job_past_its_time_limit_and_goes_on(
    conn, redis_url, tmp_path, models, max_batch
):
    """Rank 0 stops the row (its followers remove it too, as told), the job's record
    holds what it made, and the group runs the next jobs with the text of the whole
    model: alone (--max-batch 1) and in a batch (4) beside them."""
    from producer import Client
    from tests.waiting import seconds

    target = models["long"]  # (room for 8,000 tokens)
    late = chat(target, "never done", max_tokens=8000) | {
        "temperature": 0,
        "logit_bias": {"3": -100},
        "time_limit_s": seconds(2),
    }
    after = {
        f"after{i}": chat(target, f"{LONG} {i}", max_tokens=16, temperature=0) for i in range(2)
    }
    s = Client(connection=conn).submit({"late": late} | after)
    args = ("--shard", "auto", "--max-batch", max_batch, "--model-dir", models["dir"])
    run_group(redis_url, tmp_path, *args)
    record = read_result(conn, s.job_ids[0])
    assert record.status == "failed" and record.error.code == "timeout", record.error
    assert record.partial is not None and 0 < record.partial.usage.completion_tokens < 8000
    for job_id, (name, body) in zip(s.job_ids[1:], after.items(), strict=True):
        r = read_result(conn, job_id)
        assert r.status == "succeeded", name
        assert r.response.choices[0].message.content == _plain_text(target, body), name
