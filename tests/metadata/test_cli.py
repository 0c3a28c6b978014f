"""`kvpool metadata` as a real child process: serves, stops cleanly on signals, bad flags."""

from __future__ import annotations

import signal
import subprocess
import sys

import pytest

from kvpool.errors import MetadataError
from kvpool.metadata import connect_metadata
from tests.support.net import free_port, wait_port
from tests.support.procs import python_env


def _start(*args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "kvpool", "metadata", *args],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=python_env(),
    )


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_serves_then_exits_zero_on_signal(sig: signal.Signals) -> None:
    port = free_port()
    proc = _start("--port", str(port), "--max-value-size", "1KB")
    try:
        wait_port(port)
        client = connect_metadata(f"http://127.0.0.1:{port}/metadata")
        assert client is not None
        with client:
            client.put("cli/k", b"v" * 1024)
            assert client.get("cli/k") == b"v" * 1024
            with pytest.raises(MetadataError, match="answered 413"):
                client.put("cli/k", b"v" * 1025)
        proc.send_signal(sig)
        out, err = proc.communicate(timeout=15)
    finally:
        proc.kill()
    assert proc.returncode == 0, err
    assert out == f"kvpool metadata server ready on http://127.0.0.1:{port}/metadata\n"
    assert "Traceback" not in err


def test_busy_port_exits_one_with_a_clear_message(metadata_server: object) -> None:
    port = metadata_server.port  # type: ignore[attr-defined]
    proc = _start("--port", str(port))
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == 1
    assert f"metadata server cannot listen on 127.0.0.1:{port}" in err
    assert "Traceback" not in err and out == ""


def test_bad_size_flag_exits_one() -> None:
    proc = _start("--max-value-size", "lots")
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == 1
    assert "cannot parse size 'lots'" in err
