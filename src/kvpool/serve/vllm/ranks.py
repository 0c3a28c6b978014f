"""A vLLM server's data-parallel ranks as instances of their own (sans-I/O).

A server started with `--data-parallel-size N` runs N engine cores behind one API server: each
with its own scheduler and its own KV cache, and vLLM's own balancer sends each request to one
of them by load, not by what it holds. The conductor routes by what each engine holds, so it
names each rank an instance and pins each request to its rank (vLLM's `X-data-parallel-rank`
header):

    http://h:8000#dp1    rank 1 of the server at http://h:8000
    http://h:8000#dp0    rank 0 (or the bare URL, when a rank of the same server is named)
    http://h:8000        the server, its balancer choosing (no rank named beside it)

Each rank's load is its own engine's series in the server's /metrics (label `engine`), and its
KV events come from its own publisher, which vLLM binds or connects at the configured
endpoint's port plus the rank (kvevents/subscriber.py reads those ports; a rank's events
carry the server's topic).
"""

from __future__ import annotations

import re
from collections.abc import Iterable

from kvpool.errors import ConfigError

RANK_HEADER = "X-data-parallel-rank"
MAX_RANK = 255
"""The highest rank a name may take (the proxy binds a KV-event port per rank up to it)."""
_FRAGMENT = re.compile(r"dp(0|[1-9][0-9]{0,2})")


def split_rank(url: str) -> tuple[str, int | None]:
    """(the server's URL, the rank named, or None); ConfigError for another fragment, a
    rank past MAX_RANK, or a slash before `#` (an instance has one name: its events, replay
    and rotation all go by it)."""
    base, sep, fragment = url.partition("#")
    if not sep:
        return url, None
    m = _FRAGMENT.fullmatch(fragment)
    if m is None or int(m.group(1)) > MAX_RANK:
        raise ConfigError(f"{url!r}: a vLLM instance's URL may end in #dpN (its "
                          f"data-parallel rank N, 0..{MAX_RANK}), nothing else after #")
    if base.endswith("/"):
        raise ConfigError(f"{url!r}: write a rank's URL without a slash before #dp")
    return base, int(m.group(1))


class Ranks:
    """The ranks among the configured instance URLs."""

    def __init__(self, urls: Iterable[str]) -> None:
        self._rank: dict[str, int] = {}
        self._ranked: set[str] = set()
        ranked = self._ranked
        bare: set[str] = set()
        for url in urls:
            base, rank = split_rank(url)
            if rank is None:
                bare.add(url)
            else:
                self._rank[url] = rank
                ranked.add(base)
        for url in bare & ranked:  # the bare URL beside a rank: rank 0
            self._rank[url] = 0
        if any(f"{url}#dp0" in self._rank for url in bare & ranked):
            raise ConfigError("a server's rank 0 is named twice (its URL and URL#dp0)")
        self.max_rank = max(self._rank.values(), default=0)

    def target(self, url: str) -> tuple[str, dict[str, str]]:
        """Where a call for instance `url` goes, and the headers that pin it to its rank."""
        rank = self._rank.get(url)
        if rank is None:
            return url, {}
        return split_rank(url)[0], {RANK_HEADER: str(rank)}

    def engine(self, url: str) -> str | None:
        """The `engine` label of the instance's series in /metrics (None: every engine)."""
        rank = self._rank.get(url)
        return None if rank is None else str(rank)

    def named(self, url: str) -> bool:
        return url in self._rank

    def refused(self, url: str) -> str | None:
        """Why `url` cannot be added after start: a rank (the proxy bound its ranks' event
        sockets at start), or the bare URL of a server whose ranks are named (rank 0's events
        are filed under a name given at start, and calls to the bare URL are not pinned)."""
        if "#" in url:
            return "a server's data-parallel ranks are named at start (URL#dpN), not registered"
        if (base := url.rstrip("/")) in self._ranked:
            return (f"{base} runs data-parallel ranks named as instances at start; name its "
                    f"rank 0 there too ({base}#dp0)")
        return None
