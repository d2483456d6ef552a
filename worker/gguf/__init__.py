"""GGUF import: llama.cpp / Ollama / LM Studio model files as mlx-lm model directories."""

from worker.gguf.convert import Imported, import_gguf
from worker.gguf.families import UnsupportedModel
from worker.gguf.vocab import VocabError

__all__ = ["Imported", "UnsupportedModel", "VocabError", "import_gguf"]
