"""A ChatML template with tools in Qwen2.5's layout (tools listed in the system turn inside
<tools></tools>, calls as <tool_call> JSON blocks, results as <tool_response> in a user turn),
for tiny checkpoints that test tool calling offline; and a helper that gives a checkpoint
directory this template."""

from __future__ import annotations

import shutil
from pathlib import Path

QWEN2_5_TOOLS_TEMPLATE = (
    "{% set system = messages[0].content if messages and messages[0].role == 'system' "
    "else 'You are a helpful assistant.' %}"
    "{% if tools %}"
    "<|im_start|>system\n{{ system }}\n\n# Tools\n\n"
    "You may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>"
    "{% for tool in tools %}{{ '\\n' }}{{ tool | tojson }}{% endfor %}{{ '\\n' }}</tools>\n\n"
    "For each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n<tool_call>\n"
    "{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n"
    "{% else %}"
    "<|im_start|>system\n{{ system }}<|im_end|>\n"
    "{% endif %}"
    "{% for m in messages %}"
    "{% if m.role == 'system' and loop.first %}"
    "{% elif m.role == 'tool' %}"
    "{% if loop.first or messages[loop.index0 - 1].role != 'tool' %}<|im_start|>user"
    "{% endif %}"
    "{{ '\\n' }}<tool_response>\n{{ m.content }}\n</tool_response>"
    "{% if loop.last or messages[loop.index0 + 1].role != 'tool' %}<|im_end|>\n{% endif %}"
    "{% elif m.role == 'assistant' and m.tool_calls %}"
    "<|im_start|>assistant{% if m.content %}{{ '\\n' }}{{ m.content }}{% endif %}"
    "{% for call in m.tool_calls %}"
    "{% set f = call.function if call.function is defined else call %}"
    "{{ '\\n' }}<tool_call>\n{\"name\": \"{{ f.name }}\", "
    "\"arguments\": {{ f.arguments | tojson }}}"
    "\n</tool_call>"
    "{% endfor %}<|im_end|>\n"
    "{% else %}"
    "<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def with_chat_template(src: str | Path, dst: str | Path,
                       template: str = QWEN2_5_TOOLS_TEMPLATE) -> Path:
    """A copy of checkpoint `src` at `dst` whose tokenizer has `template`."""
    from transformers import AutoTokenizer
    dst = Path(dst)
    shutil.copytree(src, dst, dirs_exist_ok=True)
    tok = AutoTokenizer.from_pretrained(dst)
    tok.chat_template = template
    tok.save_pretrained(dst)
    return dst
