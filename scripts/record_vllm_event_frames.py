"""Record KV-event payloads encoded by vLLM's own msgspec classes into tests/data (run by hand).

Runs in a separate virtualenv with msgspec but not vLLM (vLLM's import chain needs torch).
From each unpacked vLLM wheel, the event classes (`EventBatch`, `KVCacheEvent`,
`BlockStored`, `BlockRemoved`, `AllBlocksCleared`) are cut out of
`vllm/distributed/kv_events.py` with `ast` and executed unchanged; a fixed set of batches is
encoded with `msgspec.msgpack.Encoder().encode`, as vLLM's publisher thread does.

    /work/venv-vllm/bin/python scripts/record_vllm_event_frames.py OUT.json \
        map=DIR/x0.32/  array=DIR/x0.11/
"""

from __future__ import annotations

import ast
import json
import sys
from pathlib import Path
from typing import Any, Optional, Union

import msgspec

CLASSES = {"EventBatch", "KVCacheEvent", "BlockStored", "BlockRemoved", "AllBlocksCleared"}


def load_classes(root: Path) -> dict:
    path = root / "vllm/distributed/kv_events.py"
    tree = ast.parse(path.read_text())
    body = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name in CLASSES]
    namespace: dict = {
        "msgspec": msgspec, "Any": Any, "Optional": Optional, "Union": Union,
        "ExternalBlockHash": bytes | int, "__name__": "vllm_kv_events_extract",
    }
    exec(compile(ast.Module(body=body, type_ignores=[]), str(path), "exec"), namespace)
    return namespace


def batches(ns: dict, newer: bool) -> list[tuple[str, Any]]:
    stored_extra = {"lora_name": None} if newer else {}
    cases = [
        ("stored_int_hashes", ns["EventBatch"](ts=1767225600.25, data_parallel_rank=0, events=[
            ns["BlockStored"](block_hashes=[1661466662038290245, 2**64 - 1], parent_block_hash=None,
                              token_ids=list(range(8)), block_size=4, lora_id=None, medium="GPU",
                              **stored_extra)])),
        ("stored_bytes_parent", ns["EventBatch"](ts=2.5, data_parallel_rank=1, events=[
            ns["BlockStored"](block_hashes=[bytes(range(32))], parent_block_hash=b"\x07" * 32,
                              token_ids=[5, 6, 7, 8], block_size=4, lora_id=3, medium="CPU",
                              **stored_extra)])),
        ("removed_and_cleared", ns["EventBatch"](ts=3.0, data_parallel_rank=0, events=[
            ns["BlockRemoved"](block_hashes=[11, 12, 13], medium="GPU"),
            ns["AllBlocksCleared"](),
        ])),
        ("no_rank", ns["EventBatch"](ts=4.0, events=[
            ns["BlockRemoved"](block_hashes=[42], medium=None)])),
    ]
    if newer:
        cases.append(("stored_newer_fields", ns["EventBatch"](ts=5.0, data_parallel_rank=0, events=[
            ns["BlockStored"](block_hashes=[21, 22], parent_block_hash=20, token_ids=[1, 2, 3, 4],
                              block_size=2, lora_id=None, medium="GPU", lora_name="sql",
                              extra_keys=[("sql", "salt-1"), None], group_idx=0,
                              kv_cache_spec_kind="full_attention", session_id="s-1"),
            ns["BlockRemoved"](block_hashes=[21], medium="GPU", group_idx=0)])))
    return cases


def main() -> None:
    target = Path(sys.argv[1])
    out: dict = {"frames": []}
    encoder = msgspec.msgpack.Encoder()
    for arg in sys.argv[2:]:
        form, root = arg.split("=", 1)
        ns = load_classes(Path(root))
        version = (Path(root) / "vllm/_version.py").read_text().split("version = ")[1].split("\n")[0]
        for name, batch in batches(ns, newer=form == "map"):
            out["frames"].append({"form": form, "name": name, "vllm_version": version.strip("'\""),
                                  "payload_hex": encoder.encode(batch).hex()})
    out["produced_by"] = {"msgspec": msgspec.__version__, "how": __doc__.strip().splitlines()[0]}
    target.write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
