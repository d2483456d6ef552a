"""Chat templates of the families that fold or move the system prompt, as their models
ship them (text parts only, no tools), for tests that must not assume that messages
render one by one.

- Gemma 3: the system message is folded into the first user turn.
- Gemma 2: no system role at all (its template raises); shared instructions go in the
  user message.
- Mistral v0.3 (and v1/v2): the system message is prepended to the *last* user message.
- Mistral Tekken (Nemo): as v0.3, without the space after ``[INST]``.
- Mistral v7 (Small 3): the system message renders on its own, ``[SYSTEM_PROMPT]``.
- ChatML: every message on its own.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from worker.gguf.templates import GEMMA as GEMMA3

GEMMA2 = (
    "{{ bos_token }}"
    "{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}"
    "{% endif %}"
    "{% for message in messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
    "{% endif %}"
    "{% if (message['role'] == 'assistant') %}{% set role = 'model' %}"
    "{% else %}{% set role = message['role'] %}{% endif %}"
    "{{ '<start_of_turn>' + role + '\n' + message['content'] | trim + '<end_of_turn>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{'<start_of_turn>model\n'}}{% endif %}"
)


def _mistral(inst: str) -> str:
    return (
        "{%- if messages[0]['role'] == 'system' %}"
        "{%- set system_message = messages[0]['content'] %}"
        "{%- set loop_messages = messages[1:] %}"
        "{%- else %}{%- set loop_messages = messages %}{%- endif %}"
        "{{- bos_token }}"
        "{%- for message in loop_messages %}"
        "{%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
        "{{- raise_exception('After the optional system message, conversation roles must "
        "alternate user/assistant/user/assistant/...') }}"
        "{%- endif %}"
        "{%- if message['role'] == 'user' %}"
        "{%- if loop.last and system_message is defined %}"
        "{{- '" + inst + "' + system_message + '\\n\\n' + message['content'] + '[/INST]' }}"
        "{%- else %}{{- '" + inst + "' + message['content'] + '[/INST]' }}{%- endif %}"
        "{%- elif message['role'] == 'assistant' %}"
        "{{- '" + inst[len("[INST]") :] + "' + message['content'] + eos_token }}"
        "{%- endif %}"
        "{%- endfor %}"
    )


MISTRAL_V03 = _mistral("[INST] ")
TEKKEN = _mistral("[INST]")
MISTRAL_V7 = (
    "{{- bos_token }}"
    "{%- for message in messages %}"
    "{%- if message['role'] == 'system' %}"
    "{{- '[SYSTEM_PROMPT]' + message['content'] + '[/SYSTEM_PROMPT]' }}"
    "{%- elif message['role'] == 'user' %}{{- '[INST]' + message['content'] + '[/INST]' }}"
    "{%- elif message['role'] == 'assistant' %}{{- message['content'] + eos_token }}"
    "{%- endif %}"
    "{%- endfor %}"
)
CHATML = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + "
    "'<|im_end|>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

#: Family -> (template, whether it takes a system message).
FAMILIES = {
    "gemma3": (GEMMA3, True),
    "gemma2": (GEMMA2, False),
    "mistral-v0.3": (MISTRAL_V03, True),
    "tekken": (TEKKEN, True),
    "mistral-v7": (MISTRAL_V7, True),
    "chatml": (CHATML, True),
}


def with_template(src: str, dst: Path, template: str) -> str:
    """A copy of model ``src`` whose tokenizer renders chats with ``template``."""
    shutil.copytree(src, dst, dirs_exist_ok=True)
    path = dst / "tokenizer_config.json"
    config = json.loads(path.read_text())
    config["chat_template"] = template
    path.write_text(json.dumps(config))
    return str(dst)
