from __future__ import annotations

import subprocess
import sys

import pytest

from kvpool.clock import VirtualClock
from kvpool.errors import ConfigError, KvpoolError, RemoteProtocolError
from kvpool.units import format_size, parse_size


@pytest.mark.parametrize(
    ("text", "expected"),
    [("16MB", 16 << 20), ("4gb", 4 << 30), ("8GiB", 8 << 30), ("512", 512), (" 1.5 KiB ", 1536), (7, 7)],
)
def test_parse_size_accepts_mooncake_forms(text: str | int, expected: int) -> None:
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", ["50%", "-1", "12XB", "", True, -5])
def test_parse_size_rejects_with_config_error(text: object) -> None:
    with pytest.raises(ConfigError):
        parse_size(text)  # type: ignore[arg-type]


def test_format_size() -> None:
    assert format_size(4096) == "4 KiB"
    assert format_size(3 << 19) == "1.5 MiB"
    assert format_size(10) == "10 B"


def test_virtual_clock_moves_only_when_told() -> None:
    clock = VirtualClock(5.0)
    assert clock.now() == 5.0
    clock.sleep(2.5)
    assert clock.now() == 7.5
    with pytest.raises(ValueError):
        clock.advance(-1)


def test_error_hierarchy_is_rooted() -> None:
    assert issubclass(RemoteProtocolError, KvpoolError)
    assert issubclass(ConfigError, ValueError)


def test_cli_help_runs_as_a_process() -> None:
    out = subprocess.run([sys.executable, "-m", "kvpool", "--help"], capture_output=True, text=True, check=True)
    assert "kvpool" in out.stdout
