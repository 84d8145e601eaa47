"""Chat templates of the demo models: one per way a template can place the system prompt."""

from __future__ import annotations

# ChatML (Qwen style); tools are listed at the end of the system turn.
CHATML = (
    r"{% for message in messages %}"
    r"{{ '<|im_start|>' + message['role'] + '\n' + message['content'] }}"
    r"{% if loop.first and message['role'] == 'system' and tools %}"
    r"{{ '\n\n# Tools\n' }}{% for tool in tools %}{{ tool | tojson }}{{ '\n' }}{% endfor %}"
    r"{% endif %}"
    r"{{ '<|im_end|>\n' }}"
    r"{% endfor %}"
    r"{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
    r"{% if enable_thinking is defined and not enable_thinking %}{{ '<think>\n\n</think>\n\n' }}{% "
    r"endif %}"
    r"{% endif %}"
)

# Mistral style: the system prompt is joined to the first user turn by a space,
# so the rendered string cut before the user text ends in a bare space token.
MISTRAL = (
    r"{{ bos_token }}{% set ns = namespace(system='') %}"
    r"{% for message in messages %}"
    r"{% if message['role'] == 'system' %}{% set ns.system = message['content'] + ' ' %}"
    r"{% elif message['role'] == 'user' %}{{ '[INST] ' + ns.system + message['content'] + ' "
    r"[/INST]' }}{% set ns.system = '' %}"
    r"{% elif message['role'] == 'assistant' %}{{ ' ' + message['content'] + eos_token }}"
    r"{% endif %}"
    r"{% endfor %}"
)

# ChatML with a default system prompt when the conversation brings none.
DEFAULT_SYSTEM = (
    r"{% if messages[0]['role'] != 'system' %}"
    r"{{ '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n' }}"
    r"{% endif %}" + CHATML
)

# Meta's Llama-3 Instruct template, as its tokenizer_config.json ships it: BOS from the
# template, header ids around the role, contents trimmed, <|eot_id|> after each turn. The
# tokenizer's post-processor adds another BOS on a plain encode, as Meta's does.
LLAMA3 = (
    r"{% set loop_messages = messages %}{% for message in loop_messages %}"
    r"{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'+ "
    r"message['content'] | trim + '<|eot_id|>' %}"
    r"{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}{{ content }}{% "
    r"endfor %}"
    r"{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% "
    r"endif %}"
)

TEMPLATES = {
    "chatml": CHATML,
    "mistral": MISTRAL,
    "default-system": DEFAULT_SYSTEM,
    "llama3": LLAMA3,
}
