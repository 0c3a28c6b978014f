"""The small files of a model folder read as untrusted input: JSON files (config.json,
generation_config.json, tokenizer_config.json, model.safetensors.index.json) of bounded size,
the weight index's entries confined to the folder, and tokenizer.json parsed by `tokenizers`.
Each failure is one CheckpointError that names the file and what is wrong with it.

Confinement: an index entry is a relative path without `..` whose real path (symlinks
followed) lies inside the model folder. One exception, so that a Hugging Face hub cache
snapshot loads as it is: when the folder is `<repo>/snapshots/<revision>`, the files may be
links into `<repo>` (its `blobs/`), as the hub writes them.
"""

from __future__ import annotations

import json
from pathlib import Path, PurePosixPath
from typing import Any

from kvpool.errors import CheckpointError

MAX_JSON_BYTES = 64 << 20
"""The largest config, index or tokenizer_config JSON file read (real ones are under 1 MiB)."""
MAX_TOKENIZER_BYTES = 1 << 30
INDEX_NAME = "model.safetensors.index.json"


def read_json(path: Path, limit: int = MAX_JSON_BYTES) -> Any:
    """The parsed contents of JSON file `path` (which must exist)."""
    try:
        size = path.stat().st_size
        data = path.read_bytes() if size <= limit else None
    except OSError as exc:
        raise CheckpointError(f"{path}: cannot be read ({exc.strerror or exc})") from None
    if data is None:
        raise CheckpointError(f"{path}: {size} bytes, more than the {limit} a model's JSON "
                              f"file may have; replace the file")
    try:
        return json.loads(data)
    except (ValueError, RecursionError) as exc:  # JSONDecodeError, UnicodeDecodeError
        raise CheckpointError(f"{path}: not a readable JSON file ({_first_line(exc)}); "
                              f"replace the file") from None


def read_json_object(path: Path) -> dict[str, Any]:
    """`read_json` of a file that must hold an object; {} when the file is absent."""
    if not path.is_file():
        return {}
    obj = read_json(path)
    if not isinstance(obj, dict):
        raise CheckpointError(f"{path}: must hold a JSON object, got {type(obj).__name__}")
    return obj


def weight_index(folder: Path) -> dict[str, Path]:
    """Tensor name -> file, from the folder's model.safetensors.index.json (which must exist).
    Every file is confined to the folder (module docstring)."""
    path = folder / INDEX_NAME
    weight_map = read_json_object(path).get("weight_map")
    if not isinstance(weight_map, dict) or not weight_map:
        raise CheckpointError(f"{path}: needs a non-empty \"weight_map\" object (tensor name -> "
                              f"file name)")
    files: dict[str, Path] = {}
    out: dict[str, Path] = {}
    for name, entry in weight_map.items():
        if not isinstance(entry, str):
            raise CheckpointError(f"{path}: tensor {name!r} maps to {entry!r}, not a file name")
        if entry not in files:
            files[entry] = confined(folder, entry, f"{path.name} entry for {name!r}")
        out[name] = files[entry]
    return out


def confined(folder: Path, entry: str, what: str) -> Path:
    """`folder / entry`, refused unless it stays inside `folder` (module docstring)."""
    parts = PurePosixPath(entry.replace("\\", "/")).parts
    if not parts or entry.startswith(("/", "\\")) or ":" in parts[0] or ".." in parts:
        raise CheckpointError(f"{folder}: {what} is {entry!r}, outside the model folder; "
                              f"an index names files inside the folder (no absolute path, no ..)")
    path = folder.joinpath(*parts)
    real, root = path.resolve(), _root(folder)
    if not real.is_relative_to(root):
        raise CheckpointError(f"{folder}: {what} is {entry!r}, which resolves to {real}, outside "
                              f"the model folder (a symbolic link out of it); copy the file in")
    return path


def _root(folder: Path) -> Path:
    real = folder.resolve()
    return real.parent.parent if real.parent.name == "snapshots" else real


def open_tokenizer(path: Path) -> Any:
    """A `tokenizers.Tokenizer` from tokenizer.json `path`; CheckpointError when the file is
    missing, too large or not a tokenizer the library can read."""
    from tokenizers import Tokenizer

    if not path.is_file():
        raise CheckpointError(f"{path} not found: a model folder needs its tokenizer.json")
    size = path.stat().st_size
    if size > MAX_TOKENIZER_BYTES:
        raise CheckpointError(f"{path}: {size} bytes, more than the {MAX_TOKENIZER_BYTES} a "
                              f"tokenizer.json may have")
    try:
        return Tokenizer.from_file(str(path))
    except Exception as exc:  # the library raises bare Exception for every parse error
        raise CheckpointError(f"{path}: not a tokenizer.json the tokenizers library can read "
                              f"({_first_line(exc)}); replace it with the model's own") from None


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0][:200] if text else type(exc).__name__
