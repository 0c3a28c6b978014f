"""Handlers of the disk-tier requests (SsdMountMsg, NodeTasksMsg, NodeReportMsg,
SsdRegisterMsg)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from kvpool.errors import InvalidArgument
from kvpool.store.master.core import MasterCore
from kvpool.store.wire import messages as m
from kvpool.store.wire.codes import ErrorCode
from kvpool.store.wire.validate import mount_problem

MAX_OUTCOMES = 4096


def tier_handlers(core: MasterCore) -> dict[type[m.Msg], Callable[[Any], Any]]:
    tiering = core.tiering

    def ssd_mount(r: m.SsdMountMsg) -> m.MountReply:
        if mount_problem(r.endpoint, 0, r.size) is not None:
            return m.MountReply(int(ErrorCode.INVALID_PARAMS), "")
        code, segment_id = tiering.attach(r.client_id, r.endpoint, r.size, r.promote_after)
        return m.MountReply(int(code), segment_id)

    def report(client_id: str, segment_id: str, outcomes: list[tuple[int, int]]) -> int:
        if len(outcomes) > MAX_OUTCOMES:
            raise InvalidArgument(f"at most {MAX_OUTCOMES} outcomes per report")
        return int(tiering.report(client_id, segment_id, outcomes))

    def node_tasks(r: m.NodeTasksMsg) -> m.NodeTasksReply:
        if r.outcomes:
            report(r.client_id, r.segment_id, r.outcomes)
        code, due = tiering.next_tasks(r.client_id, r.segment_id)
        return m.NodeTasksReply(int(code), [t.wire() for t in due])

    def node_report(r: m.NodeReportMsg) -> int:
        return report(r.client_id, r.segment_id, r.outcomes)

    def ssd_register(r: m.SsdRegisterMsg) -> list[int]:
        return [int(c) for c in tiering.register(r.client_id, r.segment_id, r.keys, r.sizes,
                                                 r.checksums, r.gens)]

    return {m.SsdMountMsg: ssd_mount, m.NodeTasksMsg: node_tasks,
            m.NodeReportMsg: node_report, m.SsdRegisterMsg: ssd_register}
