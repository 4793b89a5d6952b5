"""Chat messages → one prompt: the tokenizer's own ``chat_template`` (Jinja, as transformers
renders it) when tokenizer_config.json has one, else trtbuild's documented default:

    <|system|>\\n{content}\\n<|user|>\\n{content}\\n<|assistant|>\\n

(one block per message, then the assistant's turn). The bundled model was trained on code,
not chats: the default exists so every engine dir serves the chat endpoint.
"""
from __future__ import annotations

import json
from pathlib import Path

DEFAULT_TEMPLATE = ("{% for m in messages %}<|{{ m.role }}|>\n{{ m.content }}\n{% endfor %}"
                    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")


def chat_template(engine_dir: Path) -> str:
    config = Path(engine_dir) / "tokenizer_config.json"
    if config.is_file():
        try:
            template = json.loads(config.read_text(encoding="utf-8")).get("chat_template")
        except (UnicodeDecodeError, json.JSONDecodeError):
            template = None
        if isinstance(template, str) and template:
            return template
    return DEFAULT_TEMPLATE


def render(template: str, messages: list[dict]) -> str:
    """Sandboxed Jinja: a template from an engine dir is untrusted input."""
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    environment = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    return environment.from_string(template).render(messages=messages, add_generation_prompt=True,
                                                    bos_token="", eos_token="")
