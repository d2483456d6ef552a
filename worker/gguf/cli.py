"""``worker import-gguf FILE OUT``: a GGUF file as an mlx-lm model directory."""

from __future__ import annotations

import logging
from pathlib import Path

import click

from worker.gguf.convert import DTYPES, import_gguf
from worker.gguf.families import FAMILIES, UnsupportedModel
from worker.gguf.templates import FAMILY
from worker.gguf.vocab import VocabError


@click.command(name="import-gguf")
@click.argument("file", type=click.Path(dir_okay=False, path_type=Path))
@click.argument("out", type=click.Path(file_okay=False, path_type=Path))
@click.option(
    "--dtype",
    type=click.Choice(sorted(DTYPES)),
    default="float32",
    show_default=True,
    help="Dtype of the dequantized weights.",
)
@click.option(
    "--q-bits",
    type=click.Choice(["2", "3", "4", "5", "6", "8"]),
    default=None,
    help="Re-quantize with mlx-lm to this many bits [default: keep --dtype].",
)
@click.option("--q-group-size", type=click.IntRange(16, 256), default=64, show_default=True)
@click.option(
    "--chat-template",
    default=None,
    metavar="|".join([*sorted(FAMILY), "none", "FILE"]),
    help="The file's own template is kept [default]; a family's template, none, or a Jinja file.",
)
@click.option("--overwrite", is_flag=True, help="Replace OUT if it exists.")
def import_command(
    file: Path,
    out: Path,
    dtype: str,
    q_bits: str | None,
    q_group_size: int,
    chat_template: str | None,
    overwrite: bool,
) -> None:
    """Import a GGUF FILE (llama.cpp, Ollama, LM Studio) into OUT, an mlx-lm model directory
    that --model and job "model" fields accept. Architectures: {archs}."""
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        done = import_gguf(
            file,
            out,
            dtype=dtype,
            q_bits=int(q_bits) if q_bits else None,
            q_group_size=q_group_size,
            chat_template=chat_template,
            overwrite=overwrite,
        )
    except (UnsupportedModel, VocabError, FileExistsError, FileNotFoundError, ValueError) as e:
        raise click.ClickException(f"{file}: {e}") from None
    note = {"none": "none (a base model: jobs get a plain role: content transcript)"}
    click.echo(
        f"{done.path}: {done.model_type}, {done.parameters / 1e6:.1f}M parameters from "
        f"{done.tensors} tensors in {done.seconds:.1f} s; chat template: "
        f"{note.get(done.chat_template, done.chat_template)}"
    )


import_command.help = (import_command.help or "").format(archs=", ".join(sorted(FAMILIES)))
