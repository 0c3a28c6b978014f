"""`kvpool store-node drain ADDR --master HOST:PORT`: move a store node's objects to the
other nodes before it leaves (`--dry-run`: only say what would move; `--cancel`: end a
drain, so the node takes placements again).

Exit codes: 0 when everything that had somewhere to go moved (the node then holds nothing,
takes no new placements and can be stopped); 1 when some objects could not be placed (they
stay on the node, which takes placements again); 2 when the drain could not start (no such
node or no such drain, the master unreachable or refusing our token).
"""

from __future__ import annotations

import argparse
import signal
import sys

from kvpool.errors import KvpoolError, RpcFailed
from kvpool.store.client.config import ClientConfig
from kvpool.store.client.drain import DrainReport, NodeDrainer
from kvpool.store.wire.codes import ErrorCode
from kvpool.store.wire.drain import DrainPlan
from kvpool.units import format_size

STAGING_BYTES = 64 << 20
REASONS = {
    "NO_AVAILABLE_HANDLE": "no node that stays has room",
    "TRANSFER_FAIL": "no replica could be read",
    "CHECKSUM_MISMATCH": "no replica holds bytes matching the object's checksum",
    "LEASE_EXPIRED": "the copy outlived the object's read lease",
}


def add_drain_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("action", nargs="?", choices=("drain",),
                   help="drain ADDR: move the objects of the node whose transfer-engine "
                        "endpoint is ADDR (host:port, as /segments shows) to other nodes")
    p.add_argument("address", nargs="?", metavar="ADDR",
                   help="drain: the node's transfer-engine endpoint host:port")
    p.add_argument("--dry-run", action="store_true", help="drain: only report what would move")
    p.add_argument("--cancel", action="store_true",
                   help="drain: end a drain (one whose command died): the node takes "
                        "placements again")
    p.add_argument("--batch-keys", type=int, default=256, help="drain: objects per batch")


def run_drain(args: argparse.Namespace) -> int:
    if not args.address:
        print("kvpool store-node drain: give the node's ADDR (host:port)", file=sys.stderr)
        return 2
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    config = ClientConfig(master=args.master, local_hostname=args.host,
                          metadata=args.metadata, protocol=args.protocol,
                          local_buffer_size=STAGING_BYTES, verify_checksums=True,
                          token=args.token or None)
    try:
        with NodeDrainer(config) as drainer:
            if args.cancel:
                return _cancel(drainer, args.address)
            return _drain(drainer, args.address, args.dry_run, max(1, args.batch_keys))
    except KeyboardInterrupt:
        print("kvpool store-node drain: interrupted; what moved stays moved, and the node "
              "takes placements again", file=sys.stderr)
        return 130
    except KvpoolError as exc:
        detail = exc.code.name if isinstance(exc, RpcFailed) else str(exc)
        print(f"kvpool store-node drain: the master at {args.master} did not answer ({detail})",
              file=sys.stderr)
        return 2


def _drain(drainer: NodeDrainer, address: str, dry_run: bool, batch_keys: int) -> int:
    plan = drainer.begin(address, dry_run)
    if plan.code == ErrorCode.SEGMENT_NOT_FOUND:
        print(f"kvpool store-node drain: no mounted segment has endpoint {address} (see "
              "the master's /segments, or the 'ready' line of `kvpool store-node`)",
              file=sys.stderr)
        return 2
    print(_plan_line(address, plan, dry_run), flush=True)
    if dry_run:
        return 0
    try:
        report = drainer.run(address, plan, batch_keys, _progress)
    except BaseException:  # interrupted: placements resume; what moved stays moved
        drainer.cancel(address)
        raise
    if not report.ok:
        drainer.cancel(address)
    print(_summary(address, report), flush=True)
    return 0 if report.ok else 1


def _cancel(drainer: NodeDrainer, address: str) -> int:
    code = drainer.cancel(address)
    if code == ErrorCode.OK:
        print(f"drain of {address} cancelled: the node takes placements again", flush=True)
        return 0
    if code == ErrorCode.SEGMENT_NOT_FOUND:
        print(f"kvpool store-node drain: {address} is not being drained", file=sys.stderr)
    else:
        print(f"kvpool store-node drain: the master did not answer ({code.name})",
              file=sys.stderr)
    return 2


def _plan_line(address: str, plan: DrainPlan, dry_run: bool) -> str:
    head = "would drain" if dry_run else "draining"
    room = "" if plan.free_bytes >= plan.num_bytes else \
        f" (less than the {format_size(plan.num_bytes)} to move: some objects will not fit)"
    return (f"{head} {address} ({len(plan.segment_ids)} segment(s)): {plan.num_objects} "
            f"objects, {format_size(plan.num_bytes)}; {plan.num_other_replica} also have a "
            f"replica elsewhere; {format_size(plan.free_bytes)} free on the other "
            f"nodes{room}; {plan.num_pending} puts in flight there")


def _progress(r: DrainReport) -> None:
    total = max(r.plan.num_objects, r.moved + r.dropped + len(r.unplaced))
    print(f"moved {r.moved}/{total} objects, {format_size(r.moved_bytes)}/"
          f"{format_size(r.plan.num_bytes)}; dropped {r.dropped} extra replicas; "
          f"{len(r.unplaced)} not placed", flush=True)


def _summary(address: str, r: DrainReport) -> str:
    secs = max(r.elapsed_s, 1e-6)
    rate = (f"{r.moved / secs:.0f} objects/s, {r.moved_bytes / secs / 1e6:.1f} MB/s"
            if r.moved else "nothing copied")
    body = (f"moved {r.moved} objects ({format_size(r.moved_bytes)}) in {r.elapsed_s:.1f}s "
            f"({rate}); {r.dropped} already had another replica (drained copy dropped); "
            f"{r.changed} removed or replaced meanwhile; {len(r.unplaced)} could not be placed")
    if r.ok:
        return (f"drain of {address} complete: {body}. The node holds no object and takes no "
                "new placements: stop it.")
    why = ", ".join(f"{n} {name} ({REASONS.get(name, 'see the logs')})"
                    for name, n in r.reasons().most_common())
    if not r.complete:
        why = why or "the drain ended before the node was empty (the node left, or the " \
                     "master restarted)"
    return (f"drain of {address} INCOMPLETE: {body}: {why}. Those objects stay on the node, "
            f"which takes placements again.")
