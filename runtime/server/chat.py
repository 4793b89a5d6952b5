"""Chat messages → one prompt: the tokenizer's own chat template (Jinja, as transformers renders
it; from chat_template.jinja or tokenizer_config.json, whichever the build copied) when the engine
dir has one, else trtbuild's documented default:

    <|system|>\\n{content}\\n<|user|>\\n{content}\\n<|assistant|>\\n

(one block per message, then the assistant's turn). The bundled model was trained on code,
not chats: the default exists so every engine dir serves the chat endpoint.
"""
from __future__ import annotations

from ..engine_dir import EngineDir

DEFAULT_TEMPLATE = ("{% for m in messages %}<|{{ m.role }}|>\n{{ m.content }}\n{% endfor %}"
                    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")


def chat_template(engine_dir: EngineDir) -> "ChatTemplate":
    """The engine dir's template, compiled, with the special tokens it may print."""
    return ChatTemplate(engine_dir.chat_template() or DEFAULT_TEMPLATE,
                        bos_token=engine_dir.special_token("bos_token"),
                        eos_token=engine_dir.special_token("eos_token"))


class TemplateRefused(ValueError):
    """The template itself refused the messages (its ``raise_exception``): the client's error."""


class TemplateFault(RuntimeError):
    """The engine dir's template does not compile or fails to render: the server's error."""


class ChatTemplate:
    """Compiled once, in sandboxed Jinja (a template from an engine dir is untrusted input)."""

    def __init__(self, source: str, bos_token: str = "", eos_token: str = ""):
        self.special = {"bos_token": bos_token, "eos_token": eos_token}
        from jinja2 import meta
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        environment = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        environment.globals["raise_exception"] = _refuse
        try:
            self.template, self.fault = environment.from_string(source), None
            # A template that reads ``tools`` renders them its own way (Hugging Face's tool-use templates).
            self.takes_tools = "tools" in meta.find_undeclared_variables(environment.parse(source))
        except Exception as exc:  # noqa: BLE001  (any compile error is the template's)
            self.template, self.fault, self.takes_tools = None, f"{type(exc).__name__}: {exc}", False

    def render(self, messages: list[dict], tools: list[dict] | None = None) -> str:
        """The prompt; ``tools`` (OpenAI function tools) go to a template that takes them."""
        if self.template is None:
            raise TemplateFault(f"the engine dir's chat template does not compile ({self.fault})")
        extra = {"tools": tools} if tools and self.takes_tools else {}
        try:
            return self.template.render(messages=messages, add_generation_prompt=True, **self.special, **extra)
        except TemplateRefused:
            raise
        except Exception as exc:  # noqa: BLE001  (undefined names, sandbox violations, type errors …)
            raise TemplateFault(f"the engine dir's chat template failed: {type(exc).__name__}: {exc}") from None


def _refuse(message: str):
    raise TemplateRefused(str(message))
