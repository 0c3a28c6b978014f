"""Dispatch of decoded requests to the master core, and the wire shape of results.

Still sans-I/O: bytes in, bytes out. The RPC server feeds it frames; tests feed it frames
directly, byte by byte.
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
from kvpool.store.wire.codes import ErrorCode, Tier
from kvpool.store.wire.protocol import (
    Op,
    Request,
    decode_request,
    encode_reply,
    peek_req_id,
)
from kvpool.store.wire.validate import TIER_VALUES, mount_problem, valid_key

E = ErrorCode
INTERNAL_ERROR = int(E.INTERNAL_ERROR)
_ARGUMENT_ERRORS = (InvalidArgument, ConfigError)
"""Raised on purpose for arguments the decoder cannot judge; any other exception is a bug."""
log = get_logger("store.service")
MAX_PREFERRED = 64
MAX_PATTERN = 1024


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
        self._handlers: dict[Op, Callable[[Request], Any]] = {
            Op.PING: lambda r: "pong",
            Op.HEARTBEAT: lambda r: int(core.heartbeat(r.client_id)),
            Op.MOUNT: self._mount,
            Op.UNMOUNT: lambda r: int(core.unmount_segment(r.client_id, r.args[0])),
            Op.PUT_START: self._put_start,
            Op.PUT_END: lambda r: self._count(r, core.put_end(r.client_id, *r.args)),
            Op.PUT_REVOKE: lambda r: self._count(r, core.put_revoke(r.client_id, r.args[0])),
            Op.GET_REPLICAS: self._get_replicas,
            Op.EXISTS: lambda r: core.exists(r.args[0]),
            Op.REMOVE: lambda r: self._count(r, core.remove(r.args[0], r.args[1])),
            Op.REMOVE_ALL: lambda r: core.remove_all(r.args[0]),
            Op.REMOVE_REGEX: lambda r: core.remove_regex(r.args[0], r.args[1]),
            Op.SEGMENTS: self._segments,
            Op.DRAIN_BEGIN: lambda r: core.drain.begin(*r.args),
            Op.REPLICATE_START: lambda r: core.drain.start(r.client_id, *r.args),
            Op.REPLICATE_END: lambda r: self._count(r, core.drain.end(r.client_id, *r.args)),
            Op.DRAIN_END: lambda r: int(core.drain.cancel(r.args[0])),
        }

    def handle(self, frame: bytes) -> bytes:
        """One reply frame for one request frame; never raises. Bad arguments are answered
        with INVALID_PARAMS, a failure of the master itself (a bug) with INTERNAL_ERROR and
        a log line with the traceback."""
        self._t0 = time.perf_counter()
        try:
            req = decode_request(frame)
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

    def _run(self, req: Request) -> tuple[int, Any]:
        """(status, result) of one valid request."""
        try:
            return 0, self._handlers[req.op](req)
        except _ARGUMENT_ERRORS as exc:  # raised on purpose for a value the checks let by
            return int(E.INVALID_PARAMS), f"{req.op.name}: {exc}"
        except Exception:
            log.exception("internal error serving %s for client %r", req.op.name,
                          req.client_id)
            return INTERNAL_ERROR, f"{req.op.name}: internal error in the master (see its log)"

    @staticmethod
    def _encode(req: Request, status: int, result: Any) -> bytes | None:
        try:
            return encode_reply(req.req_id, status, result)
        except Exception:
            log.exception("cannot encode the reply to %s for client %r", req.op.name,
                          req.client_id)
            return None

    def _request_problem(self, req: Request) -> str | None:
        """What makes a well-formed request unacceptable as a whole, or None."""
        if not valid_key(req.client_id):
            return "client_id must be 1..4096 bytes without whitespace or control characters"
        if req.op in _KEYED and len(req.args[0]) > self.core.config.max_batch:
            return f"batch of {len(req.args[0])} keys exceeds {self.core.config.max_batch}"
        if req.op is Op.PUT_START and len(req.args[5]) > MAX_PREFERRED:
            return f"more than {MAX_PREFERRED} preferred segments"
        if req.op is Op.REMOVE_REGEX and len(req.args[0]) > MAX_PATTERN:
            return f"pattern longer than {MAX_PATTERN} characters"
        if req.op is Op.REPLICATE_START and not (
                0 < req.args[1] <= self.core.config.max_batch and 0 < req.args[2] < 1 << 63):
            return f"max_keys must be in 1..{self.core.config.max_batch}, max_bytes > 0"
        if req.op is Op.MOUNT and req.args[3] not in TIER_VALUES:
            return f"unknown tier {req.args[3]}: expected one of {sorted(TIER_VALUES)}"
        return None

    def _count(self, r: Request, codes: list[ErrorCode]) -> list[ErrorCode]:
        """Count per-key failures by op and code (for metrics); returns `codes`."""
        for code in codes:
            if code:
                self.key_errors[(r.op.name, code.name)] += 1
        return codes

    def _observe(self, op: str, status: int) -> None:
        if self._on_result is not None:
            self._on_result(op, status, time.perf_counter() - self._t0)

    def _mount(self, r: Request) -> list[Any]:
        endpoint, base_addr, size, tier, fence = r.args
        problem = mount_problem(endpoint, base_addr, size, fence)
        if problem is not None:  # answered like the core's own refusals: [code, ""]
            log.info("refusing a MOUNT from client %r: %s", r.client_id, problem)
            return [int(E.INVALID_PARAMS), ""]
        code, segment_id = self.core.mount_segment(r.client_id, endpoint, base_addr, size,
                                                   Tier(tier), fence)
        return [int(code), segment_id]

    def _put_start(self, r: Request) -> list[Any]:
        keys, sizes, replica_num, hard, soft, preferred, upsert = r.args
        if not 1 <= replica_num <= self.core.config.max_replicas or len(keys) != len(sizes):
            self._count(r, [E.INVALID_PARAMS] * len(keys))
            return [[int(E.INVALID_PARAMS), []] for _ in keys]
        cfg = ReplicateConfig(replica_num, hard, soft, "", tuple(preferred))
        results = self.core.put_start(r.client_id, keys, sizes, cfg, upsert)
        self._count(r, [x.code for x in results])
        return results

    def _get_replicas(self, r: Request) -> list[Any]:
        results = self.core.get_replicas(r.args[0])
        self._count(r, [x.code for x in results])
        return [self.core.config.lease_ttl_s, results]

    def _segments(self, r: Request) -> list[Any]:
        return [[s.segment_id, s.client_id, s.endpoint, s.base_addr, s.capacity_bytes,
                 s.used_bytes, int(s.tier)] for s in self.core.segment_infos()]


_KEYED = {Op.PUT_START, Op.PUT_END, Op.PUT_REVOKE, Op.GET_REPLICAS, Op.EXISTS, Op.REMOVE,
          Op.REPLICATE_END}
