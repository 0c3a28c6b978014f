"""Malformed model folders and GGUF files, each made from a good tiny model by one change, with
the words its refusal must contain (the field or the fault). Shared by the loader tests and the
command-line tests."""

from __future__ import annotations

import json
import shutil
import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any

from safetensors.torch import load_file, save_file


def edited_config(src: Path, dst: Path, **changes: Any) -> Path:
    shutil.copytree(src, dst)
    config = json.loads((dst / "config.json").read_text())
    config.update(changes)
    (dst / "config.json").write_text(json.dumps(config))
    return dst


def sharded(src: Path, dst: Path, entry: str) -> Path:
    """The folder with an index whose first tensor's file is `entry` (the rest stay in
    model.safetensors)."""
    shutil.copytree(src, dst)
    names = sorted(load_file(str(dst / "model.safetensors")))
    index = {"weight_map": {n: ("model.safetensors" if i else entry) for i, n in enumerate(names)}}
    (dst / "model.safetensors.index.json").write_text(json.dumps(index))
    return dst


def symlinked(src: Path, dst: Path) -> Path:
    """An index entry `sub/x.safetensors` where `sub` is a link to a folder outside."""
    outside = dst.parent / f"{dst.name}-outside"
    outside.mkdir()
    weights = load_file(str(src / "model.safetensors"))
    save_file(weights, str(outside / "x.safetensors"))
    folder = sharded(src, dst, "sub/x.safetensors")
    (folder / "sub").symlink_to(outside, target_is_directory=True)
    return folder


def garbage_tokenizer(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    (dst / "tokenizer.json").write_bytes(b'{"version": "1.0", "model": {"type": "BPE", "vocab": 7')
    return dst


FOLDER_CASES: dict[str, tuple[Callable[[Path, Path], Path], str]] = {
    "zero attention heads": (lambda s, d: edited_config(s, d, num_attention_heads=0),
                             "num_attention_heads must be in 1..1024, got 0"),
    "negative vocabulary": (lambda s, d: edited_config(s, d, vocab_size=-5),
                            "vocab_size must be in 1..4194304, got -5"),
    "3,000,000 layers": (lambda s, d: edited_config(s, d, num_hidden_layers=3_000_000),
                         "num_hidden_layers must be in 1..1024, got 3000000"),
    "hidden not a multiple of heads": (lambda s, d: edited_config(s, d, num_attention_heads=5),
                                       r"hidden_size \(64\) must be a multiple of "
                                       r"num_attention_heads \(5\)"),
    "heads not a multiple of kv heads": (lambda s, d: edited_config(s, d, num_key_value_heads=3),
                                         r"num_attention_heads \(4\) must be a multiple of "
                                         r"num_key_value_heads \(3\)"),
    "huge rope factor": (lambda s, d: edited_config(s, d, rope_scaling={
        "rope_type": "linear", "factor": 1e300}), "rope_scaling factor must be in"),
    "string head count": (lambda s, d: edited_config(s, d, num_attention_heads="four"),
                          "num_attention_heads must be a number, got 'four'"),
    "index: absolute path": (lambda s, d: sharded(s, d, "/etc/passwd"),
                             "'/etc/passwd', outside the model folder"),
    "index: ..": (lambda s, d: sharded(s, d, "../other/model.safetensors"),
                  r"'\.\./other/model.safetensors', outside the model folder"),
    "index: symlink escape": (symlinked, "a symbolic link out of it"),
    "garbage tokenizer.json": (garbage_tokenizer,
                               "tokenizer.json: not a tokenizer.json the tokenizers library"),
}


def tensor_info_at(data: bytes, name: str) -> int:
    """The byte just after the name of tensor `name` in a GGUF file's tensor infos."""
    raw = name.encode()
    pos = data.rindex(struct.pack("<Q", len(raw)) + raw)
    return pos + 8 + len(raw)


def _patched(data: bytes, at: int, fmt: str, value: int) -> bytes:
    return data[:at] + struct.pack(fmt, value) + data[at + struct.calcsize(fmt):]


def _embd_field(data: bytes, skip: int, fmt: str, value: int) -> bytes:
    """token_embd (2 dims): u32 n_dims, u64 x2 dims, u32 type, u64 offset after its name."""
    return _patched(data, tensor_info_at(data, "token_embd.weight") + skip, fmt, value)


GGUF_CASES: dict[str, tuple[Callable[[bytes], bytes], str]] = {
    "gguf: truncated in the header": (lambda b: b[:100], "truncated at byte"),
    "gguf: truncated in the tensors": (lambda b: b[: len(b) // 2], "lies outside the file"),
    "gguf: bad magic": (lambda b: b"GGUX" + b[4:], "not a GGUF file"),
    "gguf: bad version": (lambda b: _patched(b, 4, "<I", 99), "GGUF version 99 is not supported"),
    "gguf: absurd tensor count": (lambda b: _patched(b, 8, "<Q", 1 << 40),
                                  "tensor count of 1099511627776"),
    "gguf: absurd metadata length": (lambda b: _patched(b, 24, "<Q", 1 << 40),
                                     "states a length of 1099511627776"),
    "gguf: tensor outside the file": (lambda b: _embd_field(b, 4 + 16 + 4, "<Q", 1 << 40),
                                      "'token_embd.weight' lies outside the file"),
    "gguf: unsupported type": (lambda b: _embd_field(b, 4 + 16, "<I", 9),
                               "'token_embd.weight' has ggml type 9"),
}
