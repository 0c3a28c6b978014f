"""Where a model folder keeps its chat template, in the order transformers prefers them:
`chat_template.jinja` (transformers 5 writes it there), else `tokenizer_config.json`'s
`chat_template` (a string, or a list of named templates: "default" first). A GGUF import
writes both (kvpool.engine.gguf_checkpoint)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def read_chat_template(model_dir: str | Path) -> tuple[str | None, str]:
    """(template or None, where it came from: a file name, or "none")."""
    folder = Path(model_dir)
    jinja = folder / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text(), jinja.name
    cfg_path = folder / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text()) if cfg_path.is_file() else {}
    template = _named(cfg.get("chat_template"))
    return (template, cfg_path.name) if template else (None, "none")


def _named(template: Any) -> str | None:
    if isinstance(template, list):  # [{"name": "default", "template": ...}, ...]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default") or next(iter(named.values()), None)
    return template if isinstance(template, str) and template else None
