"""Where a model folder keeps its chat template, in the order transformers prefers them:
`chat_template.jinja` (transformers 5 writes it there), else `tokenizer_config.json`'s
`chat_template` (a string, or a list of named templates: "default" first). A GGUF import
writes both (kvpool.engine.gguf_checkpoint). `compile_template` compiles one in a sandboxed
jinja2 environment; a template that does not parse is a CheckpointError naming its file."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from kvpool.engine.model_files import read_json_object
from kvpool.errors import CheckpointError


def read_chat_template(model_dir: str | Path) -> tuple[str | None, str]:
    """(template or None, where it came from: a file name, or "none")."""
    folder = Path(model_dir)
    jinja = folder / "chat_template.jinja"
    if jinja.is_file():
        try:
            return jinja.read_text(encoding="utf-8"), jinja.name
        except (OSError, UnicodeDecodeError) as exc:
            raise CheckpointError(f"{jinja}: not a readable UTF-8 text file ({exc})") from None
    cfg_path = folder / "tokenizer_config.json"
    cfg = read_json_object(cfg_path)
    template = _named(cfg.get("chat_template"))
    return (template, cfg_path.name) if template else (None, "none")


def _named(template: Any) -> str | None:
    if isinstance(template, list):  # [{"name": "default", "template": ...}, ...]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default") or next(iter(named.values()), None)
    return template if isinstance(template, str) and template else None


def compile_template(source: str, origin: str = "chat template") -> Any:
    """`source` compiled in a sandboxed jinja2 environment with the helpers chat templates use
    (`raise_exception`, `tojson`); CheckpointError naming `origin` when it does not parse."""
    from jinja2.exceptions import TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise TemplateError(message)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = raise_exception
    env.filters["tojson"] = lambda v, indent=None: json.dumps(v, ensure_ascii=False, indent=indent)
    try:
        return env.from_string(source)
    except TemplateError as exc:
        raise CheckpointError(f"{origin}: the chat template does not parse ({exc}); fix or "
                              f"remove it") from None
