from __future__ import annotations

from kvpool.store.wire.validate import valid_key, valid_keys, valid_size, valid_sizes

KEYS = ["k", "a" * 256, "a" * 257, "", "a b", "a\tb", "a\nb", "é", "日本", "x\x00",
        "a\u2028b", "\ud800", 7, None, "ok-key_1/2"]


def test_valid_keys_agrees_with_valid_key_for_every_pair_and_batch() -> None:
    for a in KEYS:
        assert valid_keys([a]) == valid_key(a), a
        for b in KEYS:
            assert valid_keys([a, b]) == (valid_key(a) and valid_key(b)), (a, b)
    assert valid_keys([])
    assert valid_keys(["a" * 4000, "b"])                      # long keys: the slow path
    assert not valid_keys(["a" * 4097])


def test_valid_sizes_agrees_with_valid_size() -> None:
    sizes = [1, 10, 0, -1, 11, True, 2.0, None, "3"]
    for a in sizes:
        for b in sizes:
            assert valid_sizes([a, b], 10) == (valid_size(a, 10) and valid_size(b, 10)), (a, b)
    assert valid_sizes([], 10)
