"""The KV namespace: checkpoints on disk that differ in their weights' contents, or engines that
differ in dtype or KV layout, get different chain roots; the same checkpoint gets the same
root; the weights' digests are cached beside them and taken again when a file changes."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from kvpool.engine import weights_digest
from kvpool.engine.config import EngineConfig
from kvpool.engine.identity import checkpoint_digest, identity_for_dir
from kvpool.engine.tiny import TinySpec, make_tiny
from kvpool.engine.weights_digest import CACHE_NAME, file_digests, hash_file
from kvpool.errors import CheckpointError


@pytest.fixture(scope="module")
def seeds(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Same shape, different weights (seeds 0 and 7), and a second copy of seed 0."""
    base = tmp_path_factory.mktemp("seeds")
    return {"a": make_tiny(base / "seed0", TinySpec(seed=0)),
            "a_copy": make_tiny(base / "seed0-copy", TinySpec(seed=0)),
            "b": make_tiny(base / "seed7", TinySpec(seed=7))}


@pytest.fixture
def counted(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The names of the files hashed from now on."""
    calls: list[str] = []

    def counting(path: Path) -> str:
        calls.append(path.name)
        return hash_file(path)

    monkeypatch.setattr(weights_digest, "hash_file", counting)
    return calls


def root(folder: Path, **engine: object) -> int:
    return identity_for_dir(folder, EngineConfig(**engine)).root  # type: ignore[arg-type]


def test_same_shape_other_weights_is_another_root(seeds: dict[str, Path]) -> None:
    a, b = seeds["a"], seeds["b"]
    assert (a / "config.json").read_bytes() == (b / "config.json").read_bytes()
    assert (a / "model.safetensors").stat().st_size == (b / "model.safetensors").stat().st_size
    assert root(a) != root(b)
    assert checkpoint_digest(a).config == checkpoint_digest(b).config
    assert checkpoint_digest(a).weights != checkpoint_digest(b).weights


def test_same_checkpoint_is_the_same_root(seeds: dict[str, Path]) -> None:
    assert root(seeds["a"]) == root(seeds["a"]) == root(seeds["a_copy"])


def test_dtype_and_block_size_are_other_roots(seeds: dict[str, Path]) -> None:
    a = seeds["a"]
    roots = {root(a), root(a, dtype="bfloat16"), root(a, dtype="float16"), root(a, block_size=8)}
    assert len(roots) == 4
    assert root(a, num_blocks=7, max_num_seqs=3) == root(a)  # capacity is not part of it


def test_layout_and_format_are_in_the_identity(seeds: dict[str, Path]) -> None:
    ident = identity_for_dir(seeds["a"], EngineConfig(block_size=8, dtype="bfloat16"))
    d = ident.to_dict()
    assert d["dtype"] == "bfloat16" and d["kv_format"] == "paged/1"
    assert d["kv"] == {"block_size": 8, "num_layers": 2, "num_kv_heads": 2, "head_dim": 16}


def test_a_second_start_reads_the_cached_digest(tmp_path: Path, counted: list[str]) -> None:
    folder = make_tiny(tmp_path / "m", TinySpec(seed=3))
    first = root(folder)
    assert counted == ["model.safetensors"]
    cache = json.loads((folder / CACHE_NAME).read_text())
    st = (folder / "model.safetensors").stat()
    entry = cache["files"]["model.safetensors"]
    assert (entry["size"], entry["mtime_ns"]) == (st.st_size, st.st_mtime_ns)
    assert entry["blake2b"] == hash_file(folder / "model.safetensors")
    counted.clear()
    assert root(folder) == first and counted == []


def test_a_rewritten_file_of_the_same_size_is_hashed_again(tmp_path: Path,
                                                           counted: list[str]) -> None:
    folder = make_tiny(tmp_path / "m", TinySpec(seed=3))
    weights = folder / "model.safetensors"
    first = root(folder)
    st = weights.stat()
    other = make_tiny(tmp_path / "other", TinySpec(seed=4)) / "model.safetensors"
    weights.write_bytes(other.read_bytes())  # another seed: the same size
    os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))
    assert weights.stat().st_size == st.st_size
    counted.clear()
    assert root(folder) != first and counted == ["model.safetensors"]
    counted.clear()
    assert root(folder) != first and counted == []


def test_a_folder_that_refuses_the_cache_still_gets_digests(tmp_path: Path, counted: list[str],
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    folder = make_tiny(tmp_path / "m", TinySpec(seed=3))
    want = root(folder)
    (folder / CACHE_NAME).unlink()

    def read_only(src: object, dst: object) -> None:
        raise OSError(30, "Read-only file system")

    monkeypatch.setattr(weights_digest.os, "replace", read_only)
    counted.clear()
    assert root(folder) == want and root(folder) == want
    assert counted == ["model.safetensors"] * 2  # nothing kept: hashed each time
    assert sorted(p.name for p in folder.iterdir() if p.name.startswith(".")) == []


def test_a_broken_cache_is_ignored(tmp_path: Path, counted: list[str]) -> None:
    folder = make_tiny(tmp_path / "m", TinySpec(seed=3))
    want = root(folder)
    (folder / CACHE_NAME).write_text("{not json")
    counted.clear()
    assert root(folder) == want and counted == ["model.safetensors"]
    assert json.loads((folder / CACHE_NAME).read_text())["version"] == 1


def test_gguf_files_are_hashed_by_contents_and_keep_their_neighbours(tmp_path: Path) -> None:
    a, b = tmp_path / "a.gguf", tmp_path / "b.gguf"
    a.write_bytes(b"GGUF" + bytes(100))
    b.write_bytes(b"GGUF" + bytes(99) + b"\x01")  # same size, other contents
    da, db = checkpoint_digest(a), checkpoint_digest(b)
    assert da.weights != db.weights and da.config == db.config == ""
    cached = json.loads((tmp_path / CACHE_NAME).read_text())["files"]
    assert sorted(cached) == ["a.gguf", "b.gguf"]
    assert file_digests(tmp_path, ["a.gguf"]) == {"a.gguf": cached["a.gguf"]["blake2b"]}


def test_a_folder_without_config_is_a_checkpoint_error(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="config.json not found"):
        identity_for_dir(tmp_path, EngineConfig())


def test_the_emulated_engine_has_a_namespace_of_its_own(seeds: dict[str, Path]) -> None:
    from kvpool.engine.emulated.engine import EmulatedEngine, emulated_identity
    from kvpool.engine.emulated.profile import load_profile

    profile = load_profile("llama70b-8xa800")

    def emulated_root(folder: Path, **engine: object) -> int:
        cfg = EngineConfig(**engine)  # type: ignore[arg-type]
        return EmulatedEngine.from_dir(folder, profile, cfg).root_hash

    a = seeds["a"]
    roots = {emulated_root(a), emulated_root(seeds["b"]), emulated_root(a, dtype="bfloat16"),
             emulated_root(a, block_size=8), root(a)}
    assert len(roots) == 5 and emulated_root(seeds["a_copy"]) == emulated_root(a)
    ident = emulated_identity(a, profile, EngineConfig(), 64)
    assert ident.kv_format == "emulated/1" and ident.kv.num_layers == profile.kv_layers
    assert json.loads(ident.extra)["row_bytes"] == 64
