"""Handlers of the disk-tier requests (SSD_MOUNT, NODE_TASKS, NODE_REPORT, SSD_REGISTER)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from kvpool.errors import InvalidArgument
from kvpool.store.master.core import MasterCore
from kvpool.store.wire.codes import ErrorCode
from kvpool.store.wire.protocol import Op, Request
from kvpool.store.wire.validate import mount_problem

MAX_OUTCOMES = 4096


def tier_handlers(core: MasterCore) -> dict[Op, Callable[[Request], Any]]:
    tiering = core.tiering

    def ssd_mount(r: Request) -> list[Any]:
        endpoint, size, promote_after = r.args
        if mount_problem(endpoint, 0, size) is not None:
            return [int(ErrorCode.INVALID_PARAMS), ""]
        code, segment_id = tiering.attach(r.client_id, endpoint, size, promote_after)
        return [int(code), segment_id]

    def node_tasks(r: Request) -> list[Any]:
        code, due = tiering.next_tasks(r.client_id, r.args[0])
        return [int(code), [t.wire() for t in due]]

    def node_report(r: Request) -> int:
        outcomes = r.args[1]
        if len(outcomes) > MAX_OUTCOMES or not all(
                type(o) is list and len(o) == 2 and type(o[0]) is int and type(o[1]) is int
                for o in outcomes):
            raise InvalidArgument("outcomes must be at most 4096 [task_id, status] pairs")
        return int(tiering.report(r.client_id, r.args[0], [(o[0], o[1]) for o in outcomes]))

    def ssd_register(r: Request) -> list[int]:
        return [int(c) for c in tiering.register(r.client_id, *r.args)]

    return {Op.SSD_MOUNT: ssd_mount, Op.NODE_TASKS: node_tasks,
            Op.NODE_REPORT: node_report, Op.SSD_REGISTER: ssd_register}
