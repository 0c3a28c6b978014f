"""The vLLM face's block names: vLLM's hashes for kvpool's blocks, and pool keys that the
master's pool events read back to the same hashes the face's own events carry."""

from __future__ import annotations

from kvpool.engine.blocks import block_key, prefix_block_hashes, salted_root
from kvpool.engine.worker.vllm_names import VllmBlockNames
from kvpool.kvevents.hashing import BlockHasher, to_event_hash
from kvpool.kvevents.pool import mooncake_block_digest

ROOT = 0x1234_5678
PROMPT = [16 + (i * 7919) % 496 for i in range(70)]  # 4 full blocks of 16, and 6 tokens


def names(capacity: int = 1000, algo: str = "sha256") -> VllmBlockNames:
    return VllmBlockNames(16, ROOT, algo, "0", "emu", capacity)  # type: ignore[arg-type]


def ours(prompt: list[int]) -> list[int]:
    return prefix_block_hashes(prompt, 16, salted_root(ROOT, None))


def test_each_full_block_is_named_as_vllm_names_it_and_keyed_as_its_store_connector() -> None:
    for algo in ("sha256", "sha256_cbor"):
        n = names(algo=algo)
        n.learn(PROMPT, None)
        hasher = BlockHasher(algo, 16, "0")  # type: ignore[arg-type]
        theirs = hasher.block_hashes(PROMPT)
        assert len(theirs) == 4
        for i, h in enumerate(ours(PROMPT)):
            name = n.name(h)
            assert name is not None
            assert (name.event_hash, name.parent) == (theirs[i], theirs[i - 1] if i else None)
            assert name.tokens == PROMPT[i * 16:(i + 1) * 16]
            for layer in (0, 5, None):
                key = n.pool_key(h, layer)
                digest = mooncake_block_digest(key)
                assert digest is not None and to_event_hash(digest) == theirs[i], key
            assert n.pool_key(h, 0) != n.pool_key(h, 1)  # one object per layer
            assert n.pool_key(h, 0).startswith(
                f"emu@kvpool_layer:0@kvpool_weights:{ROOT:016x}@tp_rank:0@")


def test_other_weights_under_the_same_served_name_never_share_a_key() -> None:
    """vLLM's connector keys a block by the served name and the tokens; two checkpoints in
    folders of the same name are served under one name, so the face adds the weights."""
    a, b = names(), VllmBlockNames(16, ROOT + 1, "sha256", "0", "emu", 1000)
    a.learn(PROMPT, None)
    b.learn(PROMPT, None)
    h_a = ours(PROMPT)[0]
    h_b = prefix_block_hashes(PROMPT, 16, salted_root(ROOT + 1, None))[0]
    for layer in (0, None):
        assert a.pool_key(h_a, layer) != b.pool_key(h_b, layer)
        assert mooncake_block_digest(a.pool_key(h_a, layer)) == \
            mooncake_block_digest(b.pool_key(h_b, layer))     # the same block to a router


def test_unnamed_blocks_keep_kvpools_own_key() -> None:
    n = names()
    n.learn(PROMPT, "a-salt")  # a salted prompt is not named
    h = ours(PROMPT)[0]
    assert n.name(h) is None
    assert n.pool_key(h, 3) == block_key(h, 3)
    assert mooncake_block_digest(n.pool_key(h, 3)) is None


def test_the_most_recently_learned_names_are_kept() -> None:
    n = names(capacity=6)
    other = [p + 1 for p in PROMPT]
    n.learn(PROMPT, None)
    n.learn(other, None)  # 8 blocks learned, 6 kept: the first prompt's first two go
    first = ours(PROMPT)
    assert [n.name(h) is not None for h in first] == [False, False, True, True]
    n.learn(PROMPT, None)  # learned again: its blocks are the newest now
    assert all(n.name(h) is not None for h in first)
    assert sum(n.name(h) is not None for h in ours(other)) == 2
