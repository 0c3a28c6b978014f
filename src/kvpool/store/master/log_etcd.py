"""The journal of HA masters kept in etcd itself, so masters share nothing but etcd.

Keys (under /kvpool/<cluster_id>/master/state/):

    head                    {"gen": G, "chunks": N}: the current snapshot generation
    snap/<G>/<i>            the snapshot's records, in chunks of at most CHUNK_BYTES
    log/<G>/<seq>           records appended since, each value whole records

Every write is a transaction that holds only while the term key (written by the election,
store/master/election.py) still has the version this master won: once a later term is handed
out, a deposed leader's appends fail and it acknowledges nothing more. A value is atomic in
etcd, so there are no torn tails; each value still carries the records' own checksums, and a
damaged record is skipped and counted (replay.py).

An append that fails (etcd unreachable, a timeout) raises JournalWriteError, and the journal
takes back what it published; whether etcd applied some of its values is unknown, so the
next append deletes every key of the failed ones in the same transaction that writes it
(the journal writes their surviving records again).

`rotate` writes generation G+1 (chunks, then the head), deletes generation G and compacts
etcd's history up to that point (etcd keeps every revision until it is compacted, so a log of
puts would otherwise grow its database without bound).
"""

from __future__ import annotations

import base64
import json
from collections.abc import Iterator
from typing import Any

from kvpool.errors import ConfigError, JournalWriteError, KvpoolError, StoreError
from kvpool.log import get_logger
from kvpool.store.master.records import DurableState, encode_record
from kvpool.store.master.replay import ReplayReport, replay_frames
from kvpool.store.wire.leader import Etcd, b64, parse_endpoints, unb64

log = get_logger("store.persist")
CHUNK_BYTES = 1 << 20
"""Below etcd's default request limit (1.5 MiB) with room for the transaction around it."""
PAGE = 512


def _enc(data: bytes) -> str:
    return base64.b64encode(data).decode()


def _prefix_end(prefix: str) -> str:
    return prefix[:-1] + chr(ord(prefix[-1]) + 1)


def chunked(records: list[bytes], limit: int = CHUNK_BYTES) -> Iterator[bytes]:
    """`records` joined into values of at most `limit` bytes (one larger record stays whole)."""
    group: list[bytes] = []
    size = 0
    for rec in records:
        if group and size + len(rec) > limit:
            yield b"".join(group)
            group, size = [], 0
        group.append(rec)
        size += len(rec)
    if group:
        yield b"".join(group)


class EtcdLogStore:
    """The journal's storage in etcd (see the module docstring)."""

    durable_on_append = True

    def __init__(self, endpoints: str, cluster_id: str, term: int) -> None:
        if term < 1:
            raise ConfigError("a journal in etcd belongs to an elected master (term >= 1)")
        self.etcd = Etcd(parse_endpoints(endpoints))
        self.prefix = f"/kvpool/{cluster_id}/master/state/"
        self.term_key = f"/kvpool/{cluster_id}/master/term"
        self.term = term
        self._gen = 0
        self._seq = 0
        self._open = True
        self._unsure_from = 0
        """First log seq of the failed appends not yet deleted (0: none)."""
        self.report = ReplayReport()

    def where(self) -> str:
        return f"etcd {self.prefix}"

    # -- reading ------------------------------------------------------------------------

    def _range(self, prefix: str) -> Iterator[tuple[str, bytes]]:
        """Every (key, value) under `prefix`, in key order, a page at a time."""
        start, end = prefix, _prefix_end(prefix)
        while True:
            reply = self.etcd.post("/kv/range", {"key": b64(start), "range_end": b64(end),
                                                 "limit": PAGE})
            kvs = reply.get("kvs") or []
            for kv in kvs:
                yield unb64(kv["key"]), base64.b64decode(kv.get("value", ""))
            if not reply.get("more") or not kvs:
                return
            start = unb64(kvs[-1]["key"]) + "\0"

    def load(self) -> DurableState:
        state = DurableState()
        self.report = report = ReplayReport()
        head = self.etcd.get(self.prefix + "head")
        if head is not None:
            meta = json.loads(unb64(head["value"]))
            self._gen = int(meta["gen"])
            chunks = [v for _, v in self._range(self._key("snap", self._gen))]
            if len(chunks) < int(meta["chunks"]):
                raise StoreError(f"{self.where()}: snapshot {self._gen} has {len(chunks)} of "
                                 f"{meta['chunks']} chunks; refusing to start on a partial "
                                 "state")
            replay_frames(state, b"".join(chunks[:int(meta["chunks"])]), self.where(),
                          report, last=False)
            for key, value in self._range(self._key("log", self._gen)):
                replay_frames(state, value, key, report, last=False)
        state.drop_orphans()
        return state

    def _key(self, kind: str, gen: int, index: int | None = None) -> str:
        base = f"{self.prefix}{kind}/{gen:010d}/"
        return base if index is None else f"{base}{index:012d}"

    # -- writing ------------------------------------------------------------------------

    def _txn(self, ops: list[dict[str, Any]]) -> dict[str, Any] | None:
        """Run `ops` if this master's term is still the latest; the reply, or None."""
        guard = {"key": b64(self.term_key), "target": "VERSION", "result": "EQUAL",
                 "version": self.term}
        reply = self.etcd.post("/kv/txn", {"compare": [guard], "success": ops, "failure": []})
        return reply if reply.get("succeeded") else None

    def _put(self, key: str, value: bytes) -> dict[str, Any]:
        return {"request_put": {"key": b64(key), "value": _enc(value)}}

    def _delete_prefix(self, prefix: str) -> dict[str, Any]:
        return {"request_delete_range": {"key": b64(prefix),
                                         "range_end": b64(_prefix_end(prefix))}}

    def rotate(self, records: list[bytes], term: int) -> None:
        old, new = self._gen, self._gen + 1
        chunks = list(chunked([encode_record(["H", 0, term, len(records)]), *records]))
        steps = [[self._delete_prefix(self._key("snap", new)),
                  self._delete_prefix(self._key("log", new))]]
        steps += [[self._put(self._key("snap", new, i), c)] for i, c in enumerate(chunks)]
        head = json.dumps({"gen": new, "chunks": len(chunks)}).encode()
        steps.append([self._put(self.prefix + "head", head)])
        steps.append([self._delete_prefix(self._key("snap", old)),
                      self._delete_prefix(self._key("log", old))])
        reply = None
        for ops in steps:
            reply = self._txn(ops)
            if reply is None:
                raise StoreError(f"{self.where()}: a later term than {self.term} owns the "
                                 "journal; this master must stop writing")
        self._gen, self._seq, self._unsure_from = new, 0, 0
        self._compact_history(reply)

    def _compact_history(self, reply: dict[str, Any] | None) -> None:
        revision = int(((reply or {}).get("header") or {}).get("revision", 0))
        if revision <= 0:
            return
        try:
            self.etcd.post("/kv/compaction", {"revision": revision, "physical": False})
        except Exception as exc:  # noqa: BLE001 - compaction is housekeeping
            log.warning("etcd history compaction at %d failed: %s", revision, exc)

    def append(self, records: list[bytes]) -> bool:
        if not self._open:
            return False
        first = self._seq + 1
        try:
            for value in chunked(records):
                self._seq += 1
                ops = self._forget_unsure() + [self._put(self._key("log", self._gen,
                                                                   self._seq), value)]
                if self._txn(ops) is None:
                    log.error("journal append refused: term %d is no longer the latest",
                              self.term)
                    self._open = False
                    return False
                self._unsure_from = 0
        except KvpoolError as exc:
            self._unsure_from = self._unsure_from or first
            raise JournalWriteError(f"{self.where()}: append failed ({exc})") from exc
        return True

    def _forget_unsure(self) -> list[dict[str, Any]]:
        """Ops deleting the values of failed appends (log seqs from `_unsure_from` up to
        the one being written, which is never among them)."""
        if not self._unsure_from:
            return []
        return [{"request_delete_range": {
            "key": b64(self._key("log", self._gen, self._unsure_from)),
            "range_end": b64(self._key("log", self._gen, self._seq))}}]

    def sync(self) -> None:
        """Nothing to do: etcd acknowledged each append once its quorum had it on disk."""

    def close(self) -> None:
        self._open = False
