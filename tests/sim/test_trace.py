from __future__ import annotations

from pathlib import Path

import pytest

from kvpool.errors import InvalidArgument
from kvpool.sim.trace import (
    PACKAGED_TRACE,
    checkout_trace_path,
    default_trace_path,
    force_output_len,
    load_trace,
    poisson_arrivals,
    speed_up,
)
from tests.sim.conftest import write_trace


def test_load_sorts_and_rebases(tmp_path: Path) -> None:
    path = write_trace(tmp_path / "t.jsonl", [(5.0, 10, 2, [1]), (3.5, 20, 1, [2])])
    reqs = load_trace(path)
    assert [(r.request_id, r.arrival_s, r.input_len) for r in reqs] == [(1, 0.0, 20), (0, 1.5, 10)]
    assert reqs[0].info().block_hashes == (2,)
    assert [r.arrival_s for r in speed_up(reqs, 2.0)] == [0.0, 0.75]
    assert [r.output_len for r in force_output_len(reqs, 1)] == [1, 1]


def test_poisson_is_seeded(tmp_path: Path) -> None:
    path = write_trace(tmp_path / "t.jsonl", [(0.0, 10, 2, [1])] * 50)
    a = poisson_arrivals(load_trace(path), 5.0, seed=1)
    b = poisson_arrivals(load_trace(path), 5.0, seed=1)
    assert [r.arrival_s for r in a] == [r.arrival_s for r in b]
    assert a[0].arrival_s == 0.0 and a[-1].arrival_s > a[1].arrival_s
    with pytest.raises(InvalidArgument):
        poisson_arrivals(a, 0.0)
    with pytest.raises(InvalidArgument):
        speed_up(a, -1)


def test_bad_files_name_the_line(tmp_path: Path) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": [1]}\n'
                   '{"timestamp": 1, "input_length": "x"}\n')
    with pytest.raises(InvalidArgument, match="bad.jsonl:2"):
        load_trace(bad)
    with pytest.raises(InvalidArgument, match="not found"):
        load_trace(tmp_path / "missing.jsonl")
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(InvalidArgument, match="no records"):
        load_trace(tmp_path / "empty.jsonl")


def test_default_path_and_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    assert default_trace_path() == PACKAGED_TRACE
    assert PACKAGED_TRACE.parts[-3:] == ("kvpool", "data", "conversation_trace.jsonl.gz")
    assert checkout_trace_path().parts[-4:] == ("shared", "data", "traces",
                                                "conversation_trace.jsonl")
    monkeypatch.setenv("KVPOOL_TRACE_DIR", str(tmp_path))
    assert default_trace_path() == tmp_path / "conversation_trace.jsonl"


def test_conversation_trace_statistics() -> None:
    reqs = load_trace()
    assert len(reqs) == 12031
    assert sum(r.input_len for r in reqs) / len(reqs) == pytest.approx(12035.1, abs=0.1)
    assert all(len(r.block_hashes) == -(-r.input_len // 512) for r in reqs)
