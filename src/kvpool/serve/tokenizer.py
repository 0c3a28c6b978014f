"""The model's tokenizer and chat template, read from its folder (`tokenizer.json`,
`tokenizer_config.json`, `chat_template.jinja`) with `tokenizers` and a sandboxed jinja2
environment. A folder without a chat template gets plain `role: content` lines, with a
warning that says so."""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kvpool.engine.chat_template import read_chat_template
from kvpool.errors import ConfigError

log = logging.getLogger(__name__)

_FALLBACK_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}")
"""Used when the model folder has no chat template: plain `role: content` lines."""


def _token_text(value: Any) -> str | None:
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


class ModelTokenizer:
    """Encode prompts, render chat messages, decode output ids. Raises ConfigError when the
    folder has no `tokenizer.json`."""

    def __init__(self, model_dir: str | Path) -> None:
        from tokenizers import Tokenizer

        folder = Path(model_dir)
        path = folder / "tokenizer.json"
        if not path.is_file():
            raise ConfigError(f"{path} not found: the proxy needs the model's tokenizer.json")
        self._tok = Tokenizer.from_file(str(path))
        cfg_path = folder / "tokenizer_config.json"
        cfg = json.loads(cfg_path.read_text()) if cfg_path.is_file() else {}
        self.bos_token = _token_text(cfg.get("bos_token"))
        self.eos_token = _token_text(cfg.get("eos_token"))
        template, self.chat_template_source = read_chat_template(folder)
        if template is None:
            log.warning("%s has no chat template (chat_template.jinja or tokenizer_config.json); "
                        "chats are rendered as plain 'role: content' lines", folder)
        self.chat_template: str = template or _FALLBACK_TEMPLATE
        self._template = _compile(self.chat_template)

    @property
    def vocab_size(self) -> int:
        return int(self._tok.get_vocab_size())

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=add_special_tokens).ids)

    def decode(self, token_ids: Sequence[int]) -> str:
        return str(self._tok.decode(list(token_ids), skip_special_tokens=True))

    def render_chat(self, messages: Sequence[dict[str, Any]]) -> str:
        """The prompt text for `messages` with the generation prompt appended."""
        return str(self._template.render(messages=list(messages), add_generation_prompt=True,
                                         bos_token=self.bos_token or "",
                                         eos_token=self.eos_token or ""))

    def encode_chat(self, messages: Sequence[dict[str, Any]]) -> list[int]:
        # The template writes its own special tokens (BOS), as transformers' apply_chat_template.
        return self.encode(self.render_chat(messages), add_special_tokens=False)


def _compile(source: str) -> Any:
    from jinja2.exceptions import TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise TemplateError(message)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = raise_exception
    env.filters["tojson"] = lambda v, indent=None: json.dumps(v, ensure_ascii=False, indent=indent)
    return env.from_string(source)
