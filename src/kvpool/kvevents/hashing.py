"""vLLM's prefix-cache block hashes, computed from token ids, as its KV events carry them.

The chain (vLLM `v1/core/kv_cache_utils.py`: `hash_block_tokens`, `init_none_hash`)::

    NONE_HASH = H(seed)                        seed: PYTHONHASHSEED if set on the engine,
                                               else "vllm-none-hash" (vLLM 0.29 on; 0.27 and
                                               before drew a random one: set PYTHONHASHSEED)
    h[0] = H((NONE_HASH, tuple(block 0 tokens), extra_keys[0]))
    h[i] = H((h[i-1],    tuple(block i tokens), extra_keys[i]))     full blocks only

    H = "sha256":      sha256(pickle.dumps(obj, protocol 5))
        "sha256_cbor": sha256(canonical CBOR of obj)

`extra_keys[i]` is None or a tuple of keys, as the engine's version builds them: tagged from
vLLM 0.31 on, e.g. (("cache_salt", "s"),) on the first block and (("lora", name, path),) on
every block of a LoRA request; bare values before, e.g. ("s",) for a salt, ("name",) for a
LoRA. Events carry each digest as an int, its low 64 bits read big-endian (vLLM's default,
VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1), or as the 32 digest bytes when the engine sets that
variable to 0 (`int_hashes=False`).

Must match the engine: `algo` (--prefix-caching-hash-algo), `block_size` (the engine's block
size; 128 on vLLM's CPU build, 16 on GPUs by default) and the seed. Tested equal to hashes
recorded from vLLM 0.32's own functions (tests/data/kvevents/vllm_block_hashes.json).
"""

from __future__ import annotations

import hashlib
import pickle
import struct
import threading
from collections.abc import Callable, Sequence
from typing import Any, Literal

from kvpool.errors import InvalidArgument
from kvpool.kvevents.events import BlockHash
from kvpool.sized_lru import SizedLru

HashAlgo = Literal["sha256", "sha256_cbor"]
DEFAULT_SEED = "vllm-none-hash"
PICKLE_PROTOCOL = 5
"""vLLM pickles with pickle.HIGHEST_PROTOCOL, which is 5 on every Python it supports."""
MASK_64 = (1 << 64) - 1


def to_event_hash(digest: bytes, int_hashes: bool = True) -> BlockHash:
    """A digest in the form events carry it (vLLM `maybe_convert_block_hash`)."""
    return int.from_bytes(digest, "big") & MASK_64 if int_hashes else digest


class BlockHasher:
    """Computes one engine's block hashes; thread-safe. With `memo_bytes` and sha256_cbor,
    the digests of the blocks it hashed lately are looked up by their parent, tokens and keys
    (a conversation's next prompt repeats its last one's blocks): the same digests, for about
    a sixth of the work. sha256 (pickle) costs about what a lookup does, and is not
    remembered."""

    def __init__(
        self,
        algo: HashAlgo = "sha256",
        block_size: int = 16,
        hash_seed: str | None = None,
        int_hashes: bool = True,
        memo_bytes: int = 0,
    ) -> None:
        if algo not in ("sha256", "sha256_cbor"):
            raise InvalidArgument(f"hash algo {algo!r} is not one of sha256, sha256_cbor")
        if block_size < 1:
            raise InvalidArgument(f"block_size must be >= 1, got {block_size}")
        self.algo = algo
        self.block_size = block_size
        self.hash_seed = DEFAULT_SEED if hash_seed is None else hash_seed
        self.int_hashes = int_hashes
        self.none_hash = self._hash(self.hash_seed)
        self.memo: SizedLru[tuple[bytes, tuple[int, ...], Any], bytes] | None = \
            SizedLru(memo_bytes, _memo_cost) if memo_bytes > 0 and algo == "sha256_cbor" \
            else None
        self._memo_lock = threading.Lock()
        self.memo_hits = 0
        self.memo_misses = 0

    def digests(
        self, token_ids: Sequence[int], extra_keys: Sequence[Any] | None = None
    ) -> list[bytes]:
        """The 32-byte hash of each full block of `token_ids`; a partial last block has none.

        `extra_keys`, when given, has one entry (None or a tuple) per full block.
        """
        num_blocks = len(token_ids) // self.block_size
        if extra_keys is not None and len(extra_keys) < num_blocks:
            raise InvalidArgument(f"extra_keys has {len(extra_keys)} entries for {num_blocks} blocks")
        if self.memo is None or extra_keys is not None:
            return self._chain(token_ids, extra_keys, num_blocks, self._hash)
        # (extra keys are not remembered: Python's equality, which a lookup uses, takes 1
        # for True and 1.0, where their CBOR differs)
        with self._memo_lock:
            return self._chain(token_ids, None, num_blocks, self._remembered)

    def _chain(self, token_ids: Sequence[int], extra_keys: Sequence[Any] | None,
               num_blocks: int, hashed: Callable[[Any], bytes]) -> list[bytes]:
        out: list[bytes] = []
        parent = self.none_hash
        for i in range(num_blocks):
            block = tuple(token_ids[i * self.block_size : (i + 1) * self.block_size])
            keys = _as_tuples(extra_keys[i]) if extra_keys is not None else None
            parent = hashed((parent, block, keys))
            out.append(parent)
        return out

    def _remembered(self, key: tuple[bytes, tuple[int, ...], None]) -> bytes:
        """One block's digest through the memo (under its lock). Token ids are ints in every
        caller (a request's are validated as ints, True made 1): a bool, which a lookup takes
        for that int, would find the int's digest where CBOR tells them apart. The digests
        only route requests: a wrong one costs a cache miss."""
        memo = self.memo
        assert memo is not None
        digest = memo.get(key)
        if digest is None:
            digest = self._hash(key)
            memo.put(key, digest)
            self.memo_misses += 1
        else:
            self.memo_hits += 1
        return digest

    def block_hashes(
        self, token_ids: Sequence[int], extra_keys: Sequence[Any] | None = None
    ) -> list[BlockHash]:
        """The hashes of the full blocks, in the form this engine's events carry."""
        return [to_event_hash(d, self.int_hashes) for d in self.digests(token_ids, extra_keys)]

    def _hash(self, obj: Any) -> bytes:
        if self.algo == "sha256":
            return hashlib.sha256(pickle.dumps(obj, protocol=PICKLE_PROTOCOL)).digest()
        return hashlib.sha256(canonical_cbor(obj)).digest()


def _memo_cost(key: tuple[bytes, tuple[int, ...], Any], _: bytes) -> int:
    """About what a remembered block takes: its tokens (a tuple of int objects), the parent
    and the digest (bytes objects), the key's tuple and the entry."""
    return 40 * len(key[1]) + 300


def _as_tuples(value: Any) -> Any:
    """Lists (as JSON gives them) to tuples, as the engine builds its extra keys."""
    if isinstance(value, (list, tuple)):
        return tuple(_as_tuples(v) for v in value)
    return value


def canonical_cbor(obj: Any) -> bytes:
    """RFC 8949 canonical CBOR of the values a block-hash input holds.

    Covers None, bool, int (up to 64 bits), bytes, str and tuples/lists: shortest heads,
    definite lengths. Anything else raises InvalidArgument rather than hash differently.
    """
    out = bytearray()
    _cbor(obj, out)
    return bytes(out)


def _cbor(obj: Any, out: bytearray) -> None:
    if obj is None:
        out.append(0xF6)
    elif isinstance(obj, bool):
        out.append(0xF5 if obj else 0xF4)
    elif isinstance(obj, int):
        if obj >= 0:
            _head(0, obj, out)
        else:
            _head(1, -1 - obj, out)
    elif isinstance(obj, bytes):
        _head(2, len(obj), out)
        out += obj
    elif isinstance(obj, str):
        data = obj.encode("utf-8")
        _head(3, len(data), out)
        out += data
    elif isinstance(obj, (tuple, list)):
        _head(4, len(obj), out)
        if all(type(item) is int for item in obj):  # a block's tokens: one lookup each
            out += b"".join([_INTS.get(item) or _int_bytes(item) for item in obj])
            return
        for item in obj:
            _cbor(item, out)
    else:
        raise InvalidArgument(f"cannot hash a {type(obj).__name__} in a block key: {obj!r}")


_INTS: dict[int, bytes] = {}
"""The encodings of the ints seen (token ids), each made once: a long prompt's blocks are
encoded by a lookup per token instead of the item-by-item walk."""
MAX_CACHED_INTS = 1 << 20
"""A vocabulary's worth and more; past it an int is encoded each time."""


def _int_bytes(value: int) -> bytes:
    out = bytearray()
    _cbor(value, out)
    data = bytes(out)
    if len(_INTS) < MAX_CACHED_INTS:
        _INTS[value] = data
    return data


def _head(major: int, value: int, out: bytearray) -> None:
    if value > MASK_64:
        raise InvalidArgument(f"integer {value} does not fit CBOR's 64-bit head")
    top = major << 5
    if value < 24:
        out.append(top | value)
    elif value < 0x100:
        out += bytes((top | 24, value))
    elif value < 0x10000:
        out += struct.pack(">BH", top | 25, value)
    elif value < 0x100000000:
        out += struct.pack(">BI", top | 26, value)
    else:
        out += struct.pack(">BQ", top | 27, value)
