"""What a job may name: local models only from the worker's model directories (and its
``--model`` names and ``--allow-model`` globs); refusals that say nothing of the disk."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from producer import Client
from schemas import ModelNotAllowedError
from schemas.store import read_result
from tests.conftest import chat
from tests.waiting import seconds
from worker.runner.access import ModelAccess

HOSTILE = [
    "/etc",
    "/etc/passwd",
    "../../../../etc/passwd",
    "~/.ssh",
    "/no/such/place",
    "./relative/outside",
]


def refusal(access: ModelAccess, name: str) -> str:
    with pytest.raises(ModelNotAllowedError) as e:
        access.where(name)
    return str(e.value).replace(repr(name), "NAME")


def test_paths_outside_the_model_dirs_are_refused_alike(tmp_path):
    models = tmp_path / "models"
    (models / "m").mkdir(parents=True)
    access = ModelAccess.build([models])
    messages = {refusal(access, name) for name in HOSTILE}
    # One message whatever the path is (a directory, a file, nothing): it tells nothing.
    assert len(messages) == 1, messages
    assert "not allowed on this worker" in messages.pop()


def test_names_inside_the_model_dirs_are_served_by_path_or_by_name(tmp_path):
    models = tmp_path / "models"
    (models / "m").mkdir(parents=True)
    (models / "org" / "tuned").mkdir(parents=True)
    access = ModelAccess.build([models])
    assert access.where(str(models / "m")) == models.resolve() / "m"
    assert access.where("m") == models.resolve() / "m"
    assert access.where("org/tuned") == models.resolve() / "org" / "tuned"
    # Not there: a hub id (fetched, or refused by the hub), never a local probe elsewhere.
    assert access.where("mlx-community/Qwen3-0.6B-4bit") == "mlx-community/Qwen3-0.6B-4bit"
    # Inside by path but missing: the worker's own directory, so "not found" may say so.
    assert access.where(str(models / "gone")) == models.resolve() / "gone"


def test_dot_dot_and_symlinks_cannot_walk_out_of_a_model_dir(tmp_path):
    models, outside = tmp_path / "models", tmp_path / "secret"
    models.mkdir()
    (outside / "model").mkdir(parents=True)
    (models / "link").symlink_to(outside / "model")
    access = ModelAccess.build([models])
    for name in (
        str(models / ".." / "secret" / "model"),
        str(models / "link"),
        "../secret/model",
        str(outside / "model"),
    ):
        with pytest.raises(ModelNotAllowedError):
            access.where(name)
    # A bare name whose directory links out is not served from disk: it can only be a
    # hub repository id (which the hub then refuses or serves).
    assert access.where("link") == "link"
    # A glob over the resolved path lets the operator serve it on purpose.
    opened = ModelAccess.build([models], [str(outside / "*")])
    assert opened.where(str(models / "link")) == (outside / "model").resolve()
    # ... but a glob over the path as written cannot be fooled by "..".
    sneaky = ModelAccess.build([models], [str(models / "*")])
    with pytest.raises(ModelNotAllowedError):
        sneaky.where(str(models / ".." / "secret" / "model"))


def test_globs_restrict_the_hub_and_model_names_are_checked(tmp_path):
    access = ModelAccess.build([tmp_path], ["mlx-community/*"])
    assert access.where("mlx-community/gemma-3-1b-it-4bit") == "mlx-community/gemma-3-1b-it-4bit"
    for name in ("evil/model", "", "x" * 2000, "bad\x00name", "line\nbreak"):
        with pytest.raises(ModelNotAllowedError):
            access.where(name)
    assert "mlx-community/*" in " ".join(access.describe())


def test_operator_models_are_served_wherever_they_are(tmp_path):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    access = ModelAccess.build([tmp_path / "models"]).with_named(str(elsewhere))
    assert access.where(str(elsewhere)) == elsewhere.resolve()
    with pytest.raises(ModelNotAllowedError):  # its siblings are not
        access.where(str(tmp_path))
    with pytest.raises(ModelNotAllowedError):  # globs bind the operator too
        ModelAccess.build([tmp_path / "models"], ["mlx-community/*"]).with_named(str(elsewhere))


def test_a_worker_serves_its_model_dir_and_refuses_the_rest(conn, redis_url, tiny, tmp_path):
    models = tmp_path / "models"
    models.mkdir()
    shutil.copytree(tiny.target, models / "tiny")
    (models / "escape").symlink_to(Path(tiny.draft))
    names = {
        "by-name": "tiny",
        "by-path": str(models / "tiny"),
        "outside": tiny.target,  # a real model, but not in the worker's directories
        "etc": "/etc",
        "passwd": "../../../../etc/passwd",
        "symlink": "escape",
        "draft-outside": None,
        "nowhere": "no-such-model-anywhere",
    }
    jobs = {k: chat(v, max_tokens=3, temperature=0) for k, v in names.items() if v}
    jobs["draft-outside"] = chat("tiny", max_tokens=3, draft_model=tiny.draft)
    s = Client(connection=conn).submit(jobs)
    env = os.environ | {"MLXQ_REDIS_URL": redis_url}
    proc = subprocess.run(
        [str(Path(sys.executable).with_name("worker")), "--burst", "--model-dir", str(models)],
        env=env,
        capture_output=True,
        text=True,
        timeout=seconds(300),
    )
    assert proc.returncode == 0, proc.stderr
    records = {r.custom_id: r for r in (read_result(conn, j) for j in s.job_ids)}
    assert {k: r.status for k, r in records.items()} == {
        "by-name": "succeeded",
        "by-path": "succeeded",
        "outside": "failed",
        "etc": "failed",
        "passwd": "failed",
        "symlink": "failed",
        "draft-outside": "failed",
        "nowhere": "failed",
    }
    assert records["by-name"].response.choices[0].message.content == (
        records["by-path"].response.choices[0].message.content
    )
    # A bare name that is not in the model directory is a hub repository id: the link's
    # job fails as a name that exists nowhere does, word for word.
    hub_miss = {
        k: records[k].error.message.replace(repr(names[k]), "NAME") for k in ("symlink", "nowhere")
    }
    assert len(set(hub_miss.values())) == 1, hub_miss
    assert str(tiny.draft) not in hub_miss["symlink"]
    refused = {k: r for k, r in records.items() if r.status == "failed" and k not in hub_miss}
    assert {r.error.code for r in refused.values()} == {"model_not_allowed"}
    texts = {
        r.error.message.replace(repr(names[k] or tiny.draft), "NAME") for k, r in refused.items()
    }
    texts = {t.replace("draft model", "model") for t in texts}
    assert len(texts) == 1, texts  # nothing about what exists on the worker
