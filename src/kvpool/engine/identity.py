"""The KV namespace of an engine: a digest of everything that decides its KV bytes, used as the
root of every block-hash chain (`blocks.prefix_block_hashes`).

Two engines may read each other's blocks from the pool only if they would have written the
same bytes under the same key. Those bytes follow from

    the checkpoint   config.json and the weights' contents (not their names and sizes: two
                     random checkpoints of one shape share those)
    the dtype        float32, bfloat16 or float16 KV
    the KV layout    block size, layers, KV heads, head dim
    the KV format    how kvpool lays the bytes out (KV_FORMAT_VERSION; the emulated engine's
                     bytes are a format of their own, with its profile in `extra`)

    root = blocks.model_hash(canonical JSON of ModelIdentity)

The weights are hashed once per file and the digest kept beside them (`weights_digest`), so a
restart reads a small JSON file instead of the checkpoint. No torch here: the emulated engine
imports this too.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from kvpool.engine.blocks import model_hash
from kvpool.engine.config import EngineConfig, ModelConfig
from kvpool.engine.weights_digest import file_digests
from kvpool.errors import CheckpointError

KV_FORMAT_VERSION = 1
"""Version of the torch engine's KV bytes for given weights, dtype and layout; raise it when a
change to the model code (RoPE, attention, the cache's layout) changes them."""


def _digest(data: bytes) -> str:
    return hashlib.blake2b(data, digest_size=32, person=b"kvpool-ckpt").hexdigest()


@dataclass(frozen=True)
class CheckpointDigest:
    """What a checkpoint on disk holds, as digests."""

    config: str
    """blake2b of config.json's canonical JSON ("" for a GGUF file: its metadata is in it)."""
    weights: str
    """blake2b over each weight file's name and content digest, in name order."""


@dataclass(frozen=True)
class KVShape:
    """The layout of one block's KV."""

    block_size: int
    num_layers: int
    num_kv_heads: int
    """0 where the KV is not a tensor of heads (the emulated engine: see `extra`)."""
    head_dim: int


@dataclass(frozen=True)
class ModelIdentity:
    """Everything that decides an engine's KV bytes; `root` is its chains' root hash."""

    checkpoint: CheckpointDigest
    dtype: str
    kv: KVShape
    kv_format: str = f"paged/{KV_FORMAT_VERSION}"
    extra: str = ""
    """Canonical JSON of an engine's further facts (the emulated engine's profile)."""

    @property
    def root(self) -> int:
        return model_hash(json.dumps(self.to_dict(), sort_keys=True))

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def checkpoint_digest(path: str | Path) -> CheckpointDigest:
    """The digest of a model folder (config.json and its *.safetensors) or of a .gguf file.
    Raises CheckpointError when there is neither."""
    p = Path(path)
    if p.is_file() and p.suffix == ".gguf":
        return CheckpointDigest("", _weights_digest(p.parent, [p.name]))
    config = p / "config.json"
    if not config.is_file():
        raise CheckpointError(f"{config} not found: a model folder needs config.json")
    canonical = json.dumps(json.loads(config.read_text()), sort_keys=True).encode()
    names = sorted(f.name for f in p.glob("*.safetensors"))
    return CheckpointDigest(_digest(canonical), _weights_digest(p, names))


def _weights_digest(folder: Path, names: list[str]) -> str:
    try:
        digests = file_digests(folder, names)
    except OSError as exc:
        raise CheckpointError(f"cannot read the weights in {folder}: {exc}") from exc
    return _digest(json.dumps(sorted(digests.items())).encode())


def torch_identity(checkpoint: CheckpointDigest, model: ModelConfig,
                   engine: EngineConfig) -> ModelIdentity:
    """The identity of the torch engine over `model` with `engine`'s dtype and block size."""
    kv = KVShape(engine.block_size, model.num_layers, model.num_kv_heads, model.head_dim)
    return ModelIdentity(checkpoint, engine.dtype, kv)


def identity_for_dir(model_dir: str | Path, engine: EngineConfig) -> ModelIdentity:
    """The torch engine's identity over a model folder (hashes its weights unless cached)."""
    config = Path(model_dir) / "config.json"
    if not config.is_file():
        raise CheckpointError(f"{config} not found: a model folder needs config.json")
    try:
        model = ModelConfig.from_hf(json.loads(config.read_text()))
    except (KeyError, ValueError) as exc:  # ConfigError is a ValueError
        raise CheckpointError(f"{config}: {exc}") from exc
    return torch_identity(checkpoint_digest(model_dir), model, engine)
