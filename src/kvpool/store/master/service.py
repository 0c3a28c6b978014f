"""Dispatch of decoded requests to the master core, and the wire shape of results.

Still sans-I/O: bytes in, bytes out. The RPC server feeds it frames; tests feed it frames
directly, byte by byte. Requests arrive as the typed messages of wire/messages.py; each has
one handler here, registered in `MasterService._handlers` by message class.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Callable
from typing import Any

from kvpool.errors import ConfigError, InvalidArgument, RemoteProtocolError
from kvpool.log import get_logger
from kvpool.store.config import ReplicateConfig
from kvpool.store.master.core import MasterCore
from kvpool.store.master.damage import drop_damaged
from kvpool.store.master.reserve import Reservations
from kvpool.store.master.tier_service import tier_handlers
from kvpool.store.wire import messages as m
from kvpool.store.wire.codes import ErrorCode, Tier
from kvpool.store.wire.protocol import encode_reply, peek_req_id
from kvpool.store.wire.validate import TIER_VALUES, mount_problem, valid_key

E = ErrorCode
INTERNAL_ERROR = int(E.INTERNAL_ERROR)
_ARGUMENT_ERRORS = (InvalidArgument, ConfigError)
"""Raised on purpose for arguments the decoder cannot judge; any other exception is a bug."""
log = get_logger("store.service")
MAX_PREFERRED = 64
MAX_PATTERN = 1024
_KEYED = (m.PutStartMsg, m.PutEndMsg, m.PutRevokeMsg, m.GetReplicasMsg, m.ExistsMsg,
          m.SsdRegisterMsg, m.RemoveMsg, m.ReplicateEndMsg, m.PutCommitMsg, m.DropDamagedMsg)
MAX_RESERVE = 16
"""Reservations one PUT_COMMIT may ask for."""


class MasterService:
    """Turns request frames into reply frames; `on_result(op_name, status, seconds)` observes
    each one (metrics)."""

    def __init__(self, core: MasterCore,
                 on_result: Callable[[str, int, float], None] | None = None) -> None:
        self.core = core
        self.key_errors: collections.Counter[tuple[str, str]] = collections.Counter()
        """Per-key outcomes other than OK, by (op, code name)."""
        self._t0 = 0.0
        self._on_result = on_result
        self._handlers: dict[type[m.Msg], Callable[[Any], Any]] = {
            m.PingMsg: lambda r: "pong",
            m.HeartbeatMsg: lambda r: core.heartbeat(r.client_id),
            m.MountMsg: self._mount,
            m.UnmountMsg: lambda r: core.unmount_segment(r.client_id, r.segment_id),
            m.PutStartMsg: self._put_start,
            m.PutEndMsg: lambda r: self._count(r, core.put_end(r.client_id, r.keys,
                                                               r.checksums)),
            m.PutRevokeMsg: lambda r: self._count(r, core.put_revoke(r.client_id, r.keys)),
            m.GetReplicasMsg: self._get_replicas,
            m.ExistsMsg: lambda r: core.exists(r.keys),
            m.RemoveMsg: lambda r: self._count(r, core.remove(r.keys, r.force)),
            m.RemoveAllMsg: lambda r: core.remove_all(r.force),
            m.RemoveRegexMsg: lambda r: core.remove_regex(r.pattern, r.force),
            m.SegmentsMsg: self._segments,
            **tier_handlers(core),
            m.DrainBeginMsg: lambda r: core.drain.begin(r.address, r.dry_run),
            m.ReplicateStartMsg: lambda r: core.drain.start(r.client_id, r.address,
                                                            r.max_keys, r.max_bytes),
            m.ReplicateEndMsg: lambda r: self._count(r, core.drain.end(r.client_id, r.keys,
                                                                       r.codes)),
            m.DrainEndMsg: lambda r: core.drain.cancel(r.address),
            m.PutCommitMsg: self._put_commit,
            m.DropDamagedMsg: lambda r: self._count(r, drop_damaged(
                core, r.keys, r.segment_ids, r.addrs, r.checksums)),
        }
        self.reservations = Reservations(core)

    def handle(self, frame: bytes) -> bytes:
        """One reply frame for one request frame; never raises. Bad arguments are answered
        with INVALID_PARAMS, a failure of the master itself (a bug) with INTERNAL_ERROR and
        a log line with the traceback."""
        self._t0 = time.perf_counter()
        try:
            req = m.decode_msg(frame)
        except RemoteProtocolError as exc:
            self._observe("malformed", int(E.INVALID_PARAMS))
            return encode_reply(peek_req_id(frame), int(E.INVALID_PARAMS), str(exc))
        problem = self._request_problem(req)
        if problem is not None:
            status, result = int(E.INVALID_PARAMS), problem
        else:
            status, result = self._run(req)
        reply = self._encode(req, status, result)
        self._observe(req.op.name, status if reply is not None else INTERNAL_ERROR)
        return reply if reply is not None else encode_reply(
            req.req_id, INTERNAL_ERROR, f"{req.op.name}: internal error: the reply could "
            "not be encoded (see the master's log)")

    def _run(self, req: m.Msg) -> tuple[int, Any]:
        """(status, result) of one valid request."""
        try:
            return 0, self._handlers[type(req)](req)
        except _ARGUMENT_ERRORS as exc:  # raised on purpose for a value the checks let by
            return int(E.INVALID_PARAMS), f"{req.op.name}: {exc}"
        except Exception:
            log.exception("internal error serving %s for client %r", req.op.name,
                          req.client_id)
            return INTERNAL_ERROR, f"{req.op.name}: internal error in the master (see its log)"

    @staticmethod
    def _encode(req: m.Msg, status: int, result: Any) -> bytes | None:
        try:
            return encode_reply(req.req_id, status, result)
        except Exception:
            log.exception("cannot encode the reply to %s for client %r", req.op.name,
                          req.client_id)
            return None

    def _request_problem(self, req: m.Msg) -> str | None:
        """What makes a well-formed request unacceptable as a whole, or None."""
        if not valid_key(req.client_id):
            return "client_id must be 1..4096 bytes without whitespace or control characters"
        if isinstance(req, _KEYED) and len(req.keys) > self.core.config.max_batch:
            return f"batch of {len(req.keys)} keys exceeds {self.core.config.max_batch}"
        if isinstance(req, m.PutCommitMsg) and len(req.reserve_sizes) > MAX_RESERVE:
            return f"more than {MAX_RESERVE} reservations"
        if isinstance(req, m.PutStartMsg) and len(req.preferred) > MAX_PREFERRED:
            return f"more than {MAX_PREFERRED} preferred segments"
        if isinstance(req, m.RemoveRegexMsg) and len(req.pattern) > MAX_PATTERN:
            return f"pattern longer than {MAX_PATTERN} characters"
        if isinstance(req, m.ReplicateStartMsg) and not (
                0 < req.max_keys <= self.core.config.max_batch and 0 < req.max_bytes < 1 << 63):
            return f"max_keys must be in 1..{self.core.config.max_batch}, max_bytes > 0"
        if isinstance(req, m.MountMsg) and req.tier not in TIER_VALUES:
            return f"unknown tier {req.tier}: expected one of {sorted(TIER_VALUES)}"
        return None

    def _count(self, r: m.Msg, codes: list[ErrorCode]) -> list[ErrorCode]:
        """Count per-key failures by op and code (for metrics); returns `codes`."""
        for code in codes:
            if code:
                self.key_errors[(r.op.name, code.name)] += 1
        return codes

    def _observe(self, op: str, status: int) -> None:
        if self._on_result is not None:
            self._on_result(op, status, time.perf_counter() - self._t0)

    def _mount(self, r: m.MountMsg) -> m.MountReply:
        problem = mount_problem(r.endpoint, r.base_addr, r.size, r.fence)
        if problem is not None:  # answered like the core's own refusals: [code, ""]
            log.info("refusing a MOUNT from client %r: %s", r.client_id, problem)
            return m.MountReply(int(E.INVALID_PARAMS), "")
        code, segment_id = self.core.mount_segment(r.client_id, r.endpoint, r.base_addr,
                                                   r.size, Tier(r.tier), r.fence)
        return m.MountReply(int(code), segment_id)

    def _put_start(self, r: m.PutStartMsg) -> list[Any]:
        if not 1 <= r.replica_num <= self.core.config.max_replicas \
                or len(r.keys) != len(r.sizes):
            self._count(r, [E.INVALID_PARAMS] * len(r.keys))
            return [(E.INVALID_PARAMS, ()) for _ in r.keys]
        cfg = ReplicateConfig(r.replica_num, r.hard_pin, r.soft_pin, "", tuple(r.preferred))
        results = self.core.put_start(r.client_id, r.keys, r.sizes, cfg, r.upsert)
        self._count(r, [x.code for x in results])
        return results

    def _get_replicas(self, r: m.GetReplicasMsg) -> m.GetReplicasReply:
        results = self.core.get_replicas(r.keys)
        self._count(r, [x.code for x in results])
        return m.GetReplicasReply(self.core.config.lease_ttl_s, results)

    def _put_commit(self, r: m.PutCommitMsg) -> m.PutCommitReply:
        n = len(r.keys)
        if len(r.tokens) != n or len(r.checksums) != n:
            codes = [E.INVALID_PARAMS] * n
        else:
            commit = self.reservations.commit
            codes = [commit(r.client_id, token, key, checksum, r.upsert)
                     for key, token, checksum in zip(r.keys, r.tokens, r.checksums, strict=True)]
        self._count(r, codes)
        reserved = [self.reservations.reserve(r.client_id, size) for size in r.reserve_sizes]
        return m.PutCommitReply(codes, reserved)

    def _segments(self, r: m.SegmentsMsg) -> list[m.SegmentRow]:
        return [m.SegmentRow(s.segment_id, s.client_id, s.endpoint, s.base_addr,
                             s.capacity_bytes, s.used_bytes, int(s.tier))
                for s in self.core.segment_infos()]
