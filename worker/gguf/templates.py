"""Chat templates for imported models: the file's own, a family's on request, or none.

A base model's GGUF has no template (Gemma 3 270M's has none): the import says so and
the worker then renders a plain ``role: content`` transcript. A family's template is used
only when asked for (``--chat-template gemma``): it is the instruction-tuned model's
format, which a base model has not been trained on.
"""

from __future__ import annotations

from pathlib import Path

# Gemma 3's instruction format for text (the official template without image handling):
# a system message is folded into the first user turn; the assistant's role is "model".
GEMMA = (
    "{{ bos_token }}"
    "{%- if messages[0]['role'] == 'system' -%}"
    "{%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}"
    "{%- set loop_messages = messages[1:] -%}"
    "{%- else -%}"
    "{%- set first_user_prefix = '' -%}"
    "{%- set loop_messages = messages -%}"
    "{%- endif -%}"
    "{%- for message in loop_messages -%}"
    "{%- set role = 'model' if message['role'] == 'assistant' else message['role'] -%}"
    "{{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else '') }}"
    "{{ message['content'] | trim }}{{ '<end_of_turn>\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<start_of_turn>model\n' }}{%- endif -%}"
)
FAMILY = {"gemma": GEMMA}


def choose(option: str | None, from_file: str | None) -> tuple[str | None, str]:
    """(template, where it came from) for the ``--chat-template`` option."""
    if option is None:
        return (from_file, "file") if from_file else (None, "none")
    if option == "none":
        return None, "none"
    if option in FAMILY:
        return FAMILY[option], option
    path = Path(option)
    if path.is_file():
        return path.read_text(), str(path)
    known = ", ".join(sorted(FAMILY))
    raise ValueError(f"chat template {option!r} is neither a family ({known}), 'none', nor a file")
