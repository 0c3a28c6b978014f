"""The master's journal under damage, on a virtual clock with real files: a disk that fills
up (a real tmpfs), flipped bytes in a log, a missing, emptied or cut snapshot. Each checks
that every acknowledged object comes back exact (or the load refuses) and that no put
whose write failed is ever visible."""

from __future__ import annotations

import errno
import random
import time
from pathlib import Path

import pytest

from kvpool.clock import VirtualClock
from kvpool.errors import StateDamaged
from kvpool.store.config import MasterConfig, ReplicateConfig
from kvpool.store.master.core import MasterCore
from kvpool.store.master.log_files import SNAPSHOT
from kvpool.store.master.persist import Journal, PersistConfig, load_state
from kvpool.store.master.records import encode_record, scan_frames
from kvpool.store.master.replay import ReplayReport
from kvpool.store.wire.codes import ErrorCode as E
from tests.support.tmpfs import fill, small_tmpfs

KIB = 1024
Tables = dict[str, tuple[int, int | None, list[tuple[str, int]]]]


def open_core(clock: VirtualClock, state_dir: Path, recover_partial: bool = False
              ) -> MasterCore:
    core = MasterCore(MasterConfig(seed=7), clock)
    core.journal = Journal(PersistConfig(str(state_dir), recover_partial=recover_partial),
                           core)
    return core


def journal(core: MasterCore) -> Journal:
    assert isinstance(core.journal, Journal)
    return core.journal


def mount(core: MasterCore, fence: int = 11) -> str:
    code, sid = core.mount_segment("c0", "127.0.0.1:9000", 0x10000, 8 << 20, fence=fence)
    assert code == E.OK
    assert journal(core).commit()
    return sid


def put(core: MasterCore, key: str, size: int = KIB) -> bool:
    """One put as the service runs it (start, end, then the journal write); whether the
    write succeeded, i.e. whether the put was acknowledged."""
    (res,) = core.put_start("w", [key], [size], ReplicateConfig())
    assert res.code == E.OK
    assert core.put_end("w", [key], [hash(key) & 0xFFFF]) == [E.OK]
    return journal(core).commit()


def fill_up(core: MasterCore, state_dir: Path) -> tuple[Path, list[str]]:
    """Fill the disk, then put until a put fails (the log's last page had room); the
    filler and the keys acknowledged meanwhile."""
    filler = fill(state_dir)
    acked = []
    for i in range(1000):
        if not put(core, f"pad{i}"):
            return filler, acked
        acked.append(f"pad{i}")
    raise AssertionError("the disk never filled up")


def tables(core: MasterCore) -> Tables:
    return {k: (o.size, o.checksum, sorted((r.segment.segment_id, r.offset)
                                           for r in o.replicas))
            for k, o in core.objects.items()}


def reopen(clock: VirtualClock, state_dir: Path) -> MasterCore:
    """The master after a SIGKILL: a new one on the same files, its node mounted again."""
    core = open_core(clock, state_dir)
    mount(core)
    core.check_integrity()
    return core


def test_full_disk_fails_puts_without_publishing_and_loses_nothing_later(
        tmp_path: Path) -> None:
    clock = VirtualClock()
    with small_tmpfs(tmp_path / "small") as state_dir:
        core = open_core(clock, state_dir)
        mount(core)
        filler = fill(state_dir, leave_bytes=8 * KIB)
        acked: list[str] = []
        failed: list[str] = []
        for i in range(400):
            key = f"k{i}"
            (acked if put(core, key) else failed).append(key)
            core.check_integrity()
            if len(failed) >= 20:
                break
        assert acked and len(failed) == 20, (len(acked), len(failed))
        assert all(r.code == E.OBJECT_NOT_FOUND for r in core.get_replicas(failed))
        assert journal(core).write_error is not None
        assert "No space left" in journal(core).write_error
        filler.unlink()
        for i in range(150):
            assert put(core, f"after{i}")
            acked.append(f"after{i}")
        assert journal(core).write_error is None
        expected = tables(core)
        assert sorted(expected) == sorted(acked)
        again = reopen(clock, state_dir)
        assert tables(again) == expected
        report = journal(again).stats().replay
        assert (report.num_corrupt_runs, report.torn_tail_bytes) == (0, 0)


def test_removes_that_fail_to_journal_are_written_with_the_next_request(
        tmp_path: Path) -> None:
    clock = VirtualClock()
    with small_tmpfs(tmp_path / "small") as state_dir:
        core = open_core(clock, state_dir)
        mount(core)
        for i in range(10):
            assert put(core, f"k{i}")
        filler, pads = fill_up(core, state_dir)
        assert core.remove(["k1", "k2"], force=True) == [E.OK, E.OK]
        assert not journal(core).commit()
        assert not put(core, "lost")
        assert journal(core).stats().num_carried_records == 2
        filler.unlink()
        assert put(core, "k10")
        again = reopen(clock, state_dir)
        assert sorted(again.objects) == sorted({f"k{i}" for i in range(11)} - {"k1", "k2"}
                                               | set(pads))


def test_a_failed_upsert_takes_back_the_new_value(tmp_path: Path) -> None:
    clock = VirtualClock()
    with small_tmpfs(tmp_path / "small") as state_dir:
        core = open_core(clock, state_dir)
        mount(core)
        assert put(core, "k")
        filler, pads = fill_up(core, state_dir)
        (res,) = core.put_start("w", ["k"], [2 * KIB], ReplicateConfig(), upsert=True)
        assert core.put_end("w", ["k"], [5]) == [E.OK]
        assert not journal(core).commit()
        assert core.get_replicas(["k"])[0].code == E.OBJECT_NOT_FOUND
        core.check_integrity()
        filler.unlink()
        assert put(core, "other")
        again = reopen(clock, state_dir)
        assert sorted(again.objects) == sorted(["other", *pads])


def _history(clock: VirtualClock, state_dir: Path, num_keys: int) -> Tables:
    core = open_core(clock, state_dir)
    mount(core)
    for i in range(num_keys):
        assert put(core, f"k{i}", KIB + i)
    return tables(core)


def _log_file(state_dir: Path) -> Path:
    (log_file,) = state_dir.glob("log.*")
    return log_file


@pytest.mark.parametrize("seed", range(8))
def test_a_flipped_byte_loses_only_its_own_record(tmp_path: Path, seed: int) -> None:
    clock = VirtualClock()
    expected = _history(clock, tmp_path, 60)
    log_file = _log_file(tmp_path)
    data = bytearray(log_file.read_bytes())
    frames = scan_frames(bytes(data)).records
    rng = random.Random(seed)
    at = rng.randrange(len(data) * 1 // 10, len(data) * 9 // 10)
    data[at] ^= 1 << rng.randrange(8)
    log_file.write_bytes(bytes(data))
    again = reopen(clock, tmp_path)
    got = tables(again)
    lost = set(expected) - set(got)
    assert len(lost) <= 1, lost
    assert {k: expected[k] for k in got} == got  # nothing served differently
    assert len(scan_frames(bytes(data)).records) == len(frames) - 1
    report = journal(again).stats().replay
    assert report.num_corrupt_runs == 1 and report.corrupt_bytes > 0
    assert report.torn_tail_bytes == 0


def test_every_cut_of_the_last_log_is_a_torn_tail(tmp_path: Path) -> None:
    clock = VirtualClock()
    _history(clock, tmp_path, 5)
    log_file = _log_file(tmp_path)
    data = log_file.read_bytes()
    whole = scan_frames(data).records
    for cut in range(len(data) + 1):
        scan = scan_frames(data[:cut])
        assert scan.records == whole[:len(scan.records)]
        assert scan.skipped == []
        report = ReplayReport()
        report.note("log", scan, last=True)
        assert not report.corrupt
        report = ReplayReport()
        report.note("log", scan, last=False)  # the same cut in an earlier log is damage
        assert report.corrupt == (scan.tail_bytes > 0)


def test_damage_in_the_middle_is_skipped_and_counted() -> None:
    records = [encode_record(["R", f"k{i}"]) for i in range(6)]
    data = bytearray(b"".join(records))
    data[len(records[0]) + 2] ^= 0x40  # the length field of record 1
    scan = scan_frames(bytes(data))
    assert scan.records == [["R", f"k{i}"] for i in (0, 2, 3, 4, 5)]
    assert scan.skipped == [(len(records[0]), len(records[1]))]
    assert scan.tail_bytes == 0


@pytest.mark.parametrize("seed", range(20))
def test_random_flips_lose_only_the_records_they_hit(seed: int) -> None:
    rng = random.Random(seed)
    payloads = [["P", f"key-{i}" * rng.randrange(1, 9), rng.randrange(1 << 20),
                 [["s1", rng.randrange(1 << 30)]], rng.randrange(1 << 64), False]
                for i in range(200)]
    frames = [encode_record(p) for p in payloads]
    starts = [sum(len(f) for f in frames[:i]) for i in range(len(frames))]
    data = bytearray(b"".join(frames))
    hit = set()
    for _ in range(rng.randrange(1, 6)):
        at = rng.randrange(len(data))
        data[at] ^= 1 << rng.randrange(8)
        hit.add(max(i for i, start in enumerate(starts) if start <= at))
    scan = scan_frames(bytes(data))
    assert scan.records == [p for i, p in enumerate(payloads) if i not in hit]


def test_a_zeroed_run_is_crossed_quickly() -> None:
    """Zero-filled blocks (what a crash can leave on some filesystems) in the middle of a
    log: skipped as one run, in well under a second for 4 MiB."""
    head, tail = encode_record(["R", "a"]), encode_record(["R", "b"])
    data = head + b"\0" * (4 << 20) + tail
    t0 = time.monotonic()
    scan = scan_frames(data)
    assert time.monotonic() - t0 < 1.0
    assert scan.records == [["R", "a"], ["R", "b"]]
    assert scan.skipped == [(len(head), 4 << 20)]
    assert scan_frames(head + b"\0" * 999).tail_bytes == 999


def _restarted_twice(clock: VirtualClock, state_dir: Path) -> Tables:
    """A history over two runs, so the snapshot holds objects and the log is not the first."""
    expected = _history(clock, state_dir, 20)
    core = reopen(clock, state_dir)
    for i in range(20, 30):
        assert put(core, f"k{i}", KIB + i)
    expected = tables(core)
    (log_file,) = state_dir.glob("log.*")
    assert log_file.name != "log.1"
    return expected


@pytest.mark.parametrize("damage", ["deleted", "emptied", "cut mid-record",
                                    "cut at a record boundary"])
def test_a_damaged_snapshot_refuses_to_load_unless_told(tmp_path: Path, damage: str) -> None:
    clock = VirtualClock()
    _restarted_twice(clock, tmp_path)
    snap = tmp_path / SNAPSHOT
    data = snap.read_bytes()
    if damage == "deleted":
        snap.unlink()
    elif damage == "emptied":
        snap.write_bytes(b"")
    elif damage == "cut mid-record":
        snap.write_bytes(data[:len(data) - 5])
    else:
        snap.write_bytes(data[:len(data) - len(encode_record(scan_frames(data).records[-1]))])
    with pytest.raises(StateDamaged, match="--recover-partial"):
        load_state(tmp_path)
    with pytest.raises(StateDamaged):
        open_core(clock, tmp_path)
    assert snap.exists() == (damage != "deleted")  # a refused start changes no file
    core = open_core(clock, tmp_path, recover_partial=True)
    mount(core)
    assert set(core.objects) <= {f"k{i}" for i in range(30)}
    assert journal(core).stats().replay.problems


def test_a_missing_snapshot_is_fine_for_the_first_log(tmp_path: Path) -> None:
    clock = VirtualClock()
    expected = _history(clock, tmp_path, 10)
    (tmp_path / SNAPSHOT).unlink()  # log.1 follows an empty snapshot: nothing is lost
    assert tables(reopen(clock, tmp_path)) == expected


def test_a_failed_fsync_cuts_the_append_and_takes_the_put_back(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """EIO from fsync (the 'always' policy): the record stays out of the log, the put out
    of the tables; the next put is written whole after the last good record."""
    clock = VirtualClock()
    core = open_core(clock, tmp_path)
    mount(core)
    assert put(core, "a")
    import kvpool.store.master.log_files as log_files
    real_fsync, calls = log_files.os.fsync, []

    def failing_fsync(fd: int) -> None:
        calls.append(fd)
        if len(calls) == 1:
            raise OSError(errno.EIO, "Input/output error")
        real_fsync(fd)

    monkeypatch.setattr(log_files.os, "fsync", failing_fsync)
    assert not put(core, "lost")
    assert core.get_replicas(["lost"])[0].code == E.OBJECT_NOT_FOUND
    assert put(core, "b")
    monkeypatch.undo()
    records = scan_frames(_log_file(tmp_path).read_bytes()).records
    assert [r[1] for r in records if r[0] == "P"] == ["a", "b"]
    assert sorted(reopen(clock, tmp_path).objects) == ["a", "b"]
