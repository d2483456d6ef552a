"""GGUF import: round trips through llama.cpp's conventions, SentencePiece-exact vocabularies,
and clear refusals. The real Gemma 3 270M file is in ``test_real.py`` (``-m real``)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import gguf
import mlx.core as mx
import numpy as np
import pytest
from click.testing import CliRunner
from mlx_lm import load

from tests.gguf_export import export
from tests.waiting import seconds
from worker.dev.tinymodels import TinySpec, ensure_model
from worker.gguf import UnsupportedModel, import_gguf
from worker.gguf.cli import import_command
from worker.gguf.vocab import BYTE, CONTROL, NORMAL, UNKNOWN, Vocab, build

ROUND_TRIPS = ("llama", "qwen2", "qwen3", "gemma3_text")
TEXTS = [
    "def main(argv):\n    return 0  # héllo wörld 123",
    "The queue worker leases a job, runs it, and writes the result back.",
    "  leading spaces,\ttabs and\n\nblank lines; unicode: 東京 🚀 Straße",
]


@pytest.fixture(scope="module")
def sources(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("gguf-src")
    return {
        arch: ensure_model(
            root / arch, TinySpec(arch=arch, layers=6, tokenizer="bpe32k", vocab=1024, seed=3)
        )
        for arch in ROUND_TRIPS
    }


@pytest.mark.parametrize("arch", ROUND_TRIPS)
def test_a_float_file_imports_to_the_same_model(sources, tmp_path, arch):
    """llama.cpp's conventions undone: permuted Q/K rows (llama), Gemma's norm offset; the
    byte-level vocabulary and the chat template survive: logits and ids are identical."""
    src = sources[arch]
    done = import_gguf(export(src, tmp_path / "m.gguf"), tmp_path / "out")
    assert done.model_type == arch and done.chat_template == "file"
    m1, t1 = load(str(src))
    m2, t2 = load(str(done.path))
    for text in TEXTS:
        assert t2.encode(text) == t1.encode(text)
        assert t2.decode(t1.encode(text)) == t1.decode(t1.encode(text))
    x = mx.array([t1.encode(TEXTS[0] + TEXTS[1])])
    assert mx.abs(m1(x) - m2(x)).max().item() < 1e-5
    msgs = [{"role": "user", "content": "hi"}]
    assert t2.apply_chat_template(msgs, add_generation_prompt=True) == t1.apply_chat_template(
        msgs, add_generation_prompt=True
    )
    tied = "lm_head.weight" not in mx.load(str(src / "model.safetensors"))
    assert json.loads((done.path / "config.json").read_text())["tie_word_embeddings"] == tied


def _q8_0(blocks: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    """Q8_0 read from the GGML layout: 34-byte blocks, an f16 scale then 32 int8 values."""
    b = blocks.reshape(-1, 34)
    scale = b[:, :2].copy().view(np.float16).astype(np.float32)
    return (scale * b[:, 2:].copy().view(np.int8).astype(np.float32)).reshape(shape)


def test_quantized_tensors_dequantize_as_ggml_defines_them(sources, tmp_path):
    src = sources["qwen3"]
    path = export(src, tmp_path / "q.gguf", "Q8_0")
    reader = gguf.GGUFReader(str(path))
    quantized = [t for t in reader.tensors if t.tensor_type == gguf.GGMLQuantizationType.Q8_0]
    assert len(quantized) > 10
    out = import_gguf(path, tmp_path / "out").path
    weights = mx.load(str(out / "model.safetensors"))
    t = next(t for t in quantized if t.name == "blk.2.ffn_down.weight")
    ours = np.array(weights["model.layers.2.mlp.down_proj.weight"])
    shape = tuple(int(n) for n in reversed(t.shape))
    assert np.array_equal(ours, _q8_0(np.asarray(t.data), shape))


def test_requantized_import_loads_quantized(sources, tmp_path):
    out = import_gguf(export(sources["llama"], tmp_path / "m.gguf"), tmp_path / "q4", q_bits=4)
    config = json.loads((out.path / "config.json").read_text())
    assert config["quantization"]["bits"] == 4
    model, tok = load(str(out.path))
    assert model.model.layers[0].self_attn.q_proj.bits == 4
    logits = model(mx.array([tok.encode(TEXTS[1])]))
    assert not mx.isnan(logits).any().item()


def _spm_model(tmp_path: Path) -> Path:
    import sentencepiece as spm

    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n".join(TEXTS * 3 + [Path(__file__).read_text()]))
    prefix = tmp_path / "sp"
    spm.SentencePieceTrainer.train(
        input=str(corpus),
        model_prefix=str(prefix),
        model_type="bpe",
        vocab_size=400,
        byte_fallback=True,
        character_coverage=0.98,
        add_dummy_prefix=False,
        remove_extra_whitespaces=False,
        normalization_rule_name="identity",
        minloglevel=2,
    )
    return Path(f"{prefix}.model")


def test_a_sentencepiece_vocabulary_splits_text_as_sentencepiece_does(tmp_path):
    """A ``llama`` GGUF vocabulary holds pieces and scores, no merges: the importer's BPE
    must tokenize exactly as SentencePiece itself does with those pieces."""
    import sentencepiece as spm

    sp = spm.SentencePieceProcessor(model_file=str(_spm_model(tmp_path)))
    n = sp.get_piece_size()
    kinds = {True: CONTROL, False: NORMAL}
    types = [
        BYTE if sp.is_byte(i) else UNKNOWN if sp.is_unknown(i) else kinds[sp.is_control(i)]
        for i in range(n)
    ]
    vocab = Vocab(
        model="llama",
        tokens=[sp.id_to_piece(i) for i in range(n)],
        types=types,
        scores=[sp.get_score(i) for i in range(n)],
        unk_id=sp.unk_id(),
        bos_id=sp.bos_id(),
        eos_id=sp.eos_id(),
    )
    tok = build(vocab)
    probes = [
        *TEXTS,
        "queue  worker   lease",
        "zxqv 9876543210 ÆØÅ ☃",
        Path(__file__).read_text()[:3000],
    ]
    for text in probes:
        want = sp.encode(text)
        got = tok.encode(text, add_special_tokens=False).ids
        assert got == want, text[:60]
        assert tok.decode(got) == sp.decode(want)
    assert any(vocab.types[i] == BYTE for i in tok.encode("☃").ids)  # byte fallback ran


def _gguf_with(path: Path, arch: str, tensors: dict[str, np.ndarray]) -> Path:
    w = gguf.GGUFWriter(str(path), arch)
    w.add_uint32(f"{arch}.embedding_length", 8)
    w.add_uint32(f"{arch}.attention.head_count", 2)
    w.add_tokenizer_model("gpt2")
    w.add_token_list(["a", "b"])
    for name, a in tensors.items():
        w.add_tensor(name, a)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_hostile_files_are_refused_by_name(tmp_path):
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"GGUF" + bytes(range(256)) * 4)
    with pytest.raises(UnsupportedModel, match="not a readable GGUF file"):
        import_gguf(junk, tmp_path / "a")
    with pytest.raises(FileNotFoundError, match="no such GGUF file"):
        import_gguf(tmp_path / "missing.gguf", tmp_path / "b")
    mamba = _gguf_with(tmp_path / "mamba.gguf", "mamba", {})
    with pytest.raises(UnsupportedModel, match="'mamba' is not supported"):
        import_gguf(mamba, tmp_path / "c")
    odd = _gguf_with(tmp_path / "odd.gguf", "llama", {"blk.0.ssm_a.weight": np.ones(4, np.float32)})
    with pytest.raises(UnsupportedModel, match=r"'blk\.0\.ssm_a\.weight' has no place"):
        import_gguf(odd, tmp_path / "d")
    for out in ("a", "b", "c", "d"):  # nothing half-written is left where a model would be
        assert not (tmp_path / out).exists()


def test_the_command_refuses_bad_options_and_keeps_what_exists(sources, tmp_path):
    path = export(sources["llama"], tmp_path / "m.gguf")
    keep = tmp_path / "taken"
    keep.mkdir()
    (keep / "notes.txt").write_text("mine")
    runner = CliRunner()
    r = runner.invoke(import_command, [str(path), str(keep)])
    assert r.exit_code != 0 and "exists and is not empty" in r.output
    assert (keep / "notes.txt").read_text() == "mine"
    r = runner.invoke(import_command, [str(path), str(tmp_path / "x"), "--q-bits", "7"])
    assert r.exit_code != 0 and "'7' is not one of" in r.output
    r = runner.invoke(import_command, [str(path), str(tmp_path / "x"), "--chat-template", "nope"])
    assert r.exit_code != 0 and "neither a family" in r.output
    r = runner.invoke(import_command, [str(path), str(tmp_path / "ok"), "--chat-template", "gemma"])
    assert r.exit_code == 0, r.output
    assert "chat template: gemma" in r.output
    config = json.loads((tmp_path / "ok" / "tokenizer_config.json").read_text())
    assert "<start_of_turn>" in config["chat_template"]


def test_worker_import_gguf_is_a_worker_subcommand(sources, tmp_path):
    path = export(sources["qwen3"], tmp_path / "m.gguf")
    worker = Path(sys.executable).parent / "worker"
    out = subprocess.run(
        [str(worker), "import-gguf", str(path), str(tmp_path / "m")],
        capture_output=True,
        text=True,
        timeout=seconds(300),
    )
    assert out.returncode == 0, out.stderr
    assert "qwen3" in out.stdout and (tmp_path / "m" / "config.json").exists()
    out = subprocess.run(
        [str(worker), "--help"], capture_output=True, text=True, timeout=seconds(60)
    )
    assert "import-gguf" in out.stdout and "--queue" in out.stdout


def test_a_job_naming_a_gguf_file_is_told_to_import_it(sources, tmp_path):
    from schemas import MlxqError
    from worker.engine.models import ModelCache

    path = export(sources["llama"], tmp_path / "m.gguf")
    with pytest.raises(MlxqError, match="import a GGUF file first: worker import-gguf"):
        ModelCache().get(str(path))


@pytest.mark.parametrize(
    ("pre", "pieces"),
    [
        ("smollm", ["x", "Ġ", "1", "2", "3", "4"]),  # digits one by one, then GPT-2's split
        ("gpt-2", ["x", "Ġ1234"]),
        ("llama-bpe", ["x", "Ġ", "123", "4"]),  # digits in threes
        ("qwen2", ["x", "Ġ", "1", "2", "3", "4"]),
        ("default", ["x", "Ġ", "123", "4"]),  # punctuation, GPT-2, numbers, threes
    ],
)
def test_pre_tokenizers_split_words_as_llama_cpp_names_them(pre, pieces):
    """How each name splits text before BPE (the real vocabulary checks every name
    against llama.cpp's own ids: tests/test_smollm2.py)."""
    vocab = Vocab("gpt2", tokens=["x", "Ġ", "1"], types=[NORMAL] * 3, pre=pre)
    got = [p for p, _ in build(vocab).pre_tokenizer.pre_tokenize_str("x 1234")]
    assert got == pieces


def test_an_unknown_pre_tokenizer_is_refused_naming_the_known_ones():
    from worker.gguf.vocab import VocabError

    with pytest.raises(VocabError, match=r"'mystery' is not one this importer knows.*smollm"):
        build(Vocab("gpt2", tokens=["x"], types=[NORMAL], pre="mystery"))
