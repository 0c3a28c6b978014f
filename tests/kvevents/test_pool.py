"""Store keys -> vLLM block hashes, and the translator's per-medium reference counts."""

from __future__ import annotations

import pytest

from kvpool.errors import ConfigError
from kvpool.kvevents.events import AllBlocksCleared, BlockRemoved, BlockStored
from kvpool.kvevents.pool import PoolEventsConfig, PoolEventTranslator, mooncake_block_digest

DIGEST = bytes(range(32))


def mooncake_key(digest: bytes = DIGEST, tp: int = 0, prefix: str = "") -> str:
    """A key as vLLM 0.32's MooncakeStoreConnector builds it (PoolKey.to_string)."""
    return f"{prefix}/models/Qwen3-0.6B@tp_rank:{tp}@pcp0@dcp0@pp_rank:0@group:0@{digest.hex()}"


def test_connector_keys_name_their_block_hash() -> None:
    assert mooncake_block_digest(mooncake_key()) == DIGEST
    assert mooncake_block_digest(mooncake_key(prefix="tenant-a@")) == DIGEST
    ns = f"m@store_tp:2@store_pp:1@store_format:v2@tp_rank:1@pcp0@dcp0@pp_rank:0@group:1@{DIGEST.hex()}"
    assert mooncake_block_digest(ns) == DIGEST


@pytest.mark.parametrize("key", ["plain-key", f"x@{DIGEST.hex()}", mooncake_key()[:-1],
                                 mooncake_key().upper(), mooncake_key()[:-2] + "zz"])
def test_other_keys_name_none(key: str) -> None:
    assert mooncake_block_digest(key) is None


def test_one_event_per_block_and_medium_however_many_rank_keys() -> None:
    events: list[object] = []
    t = PoolEventTranslator(events.append, block_size=128)
    as_int = int.from_bytes(DIGEST[-8:], "big")
    t.stored(mooncake_key(tp=0), "cpu")
    t.stored(mooncake_key(tp=1), "cpu")
    t.stored(mooncake_key(tp=1), "disk")
    t.stored("not-a-block", "cpu")
    assert events == [
        BlockStored(block_hashes=[as_int], token_ids=[], block_size=128, medium="cpu"),
        BlockStored(block_hashes=[as_int], token_ids=[], block_size=128, medium="disk")]
    assert t.num_unmapped_keys == 1 and t.num_blocks("cpu") == 1
    t.removed(mooncake_key(tp=0), "cpu")
    t.removed("not-a-block", "cpu")
    assert len(events) == 2
    t.removed(mooncake_key(tp=1), "cpu")
    t.removed(mooncake_key(tp=1), "cpu")  # already gone: nothing more
    assert events[2:] == [BlockRemoved(block_hashes=[as_int], medium="cpu")]
    t.cleared()
    assert events[3:] == [AllBlocksCleared()] and t.num_blocks("disk") == 0


def test_bytes_hashes_and_config_bounds() -> None:
    events: list[object] = []
    PoolEventTranslator(events.append, int_hashes=False).stored(mooncake_key(), "cpu")
    assert events[0].block_hashes == [DIGEST]  # type: ignore[attr-defined]
    with pytest.raises(ConfigError, match="tcp://"):
        PoolEventsConfig("127.0.0.1:5557")
    with pytest.raises(ConfigError, match="block_size"):
        PoolEventsConfig("tcp://127.0.0.1:5557", block_size=-1)
