"""A malformed model on the command line, in real processes: `kvpool model import BAD.gguf DIR`
and `kvpool up --model BADDIR` (a config of 3,000,000 layers, which used to build for minutes)
each print one line and exit 1 within seconds, with no traceback and nothing started."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvpool.engine.tiny import TinySpec, make_tiny
from tests.engine.malformed import GGUF_CASES, edited_config
from tests.support.require import require_module

gguf = require_module("gguf", "the engine extra (scripts/setup.sh)")

from tests.engine.gguf_factory import write_gguf  # noqa: E402


def test_bad_model_files_get_one_line_and_exit_1(tmp_path: Path) -> None:
    tiny_llama = make_tiny(tmp_path / "tiny", TinySpec(seed=1))
    bad_gguf = tmp_path / "bad.gguf"
    mutate, _ = GGUF_CASES["gguf: absurd tensor count"]
    bad_gguf.write_bytes(mutate(write_gguf(tiny_llama, tmp_path / "good.gguf").read_bytes()))
    bad_dir = edited_config(tiny_llama, tmp_path / "layers", num_hidden_layers=3_000_000)
    runs = {
        "kvpool model import": ["model", "import", str(bad_gguf), str(tmp_path / "out")],
        "kvpool up": ["up", "--model", str(bad_dir), "--no-token", "--port", "1"],
    }
    started = time.monotonic()
    procs = {name: subprocess.Popen([sys.executable, "-m", "kvpool", *argv], text=True,
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE)
             for name, argv in runs.items()}
    outputs = {name: p.communicate(timeout=60) for name, p in procs.items()}
    assert time.monotonic() - started < 30  # interpreter start-ups on a busy host; was minutes
    for name, (out, err) in outputs.items():
        assert procs[name].returncode == 1, (name, err)
        assert "Traceback" not in err + out  # stdout: at most kvpool up's stage lines
        assert all(line.startswith(f"{name}: ") for line in out.splitlines()), out
        assert len(err.splitlines()) == 1 and err.startswith(f"{name}: "), err
    assert "the header states a tensor count of 1099511627776" in outputs["kvpool model import"][1]
    assert "num_hidden_layers must be in 1..1024, got 3000000" in outputs["kvpool up"][1]
    assert not (tmp_path / "out").exists()


def test_import_draws_a_progress_bar_on_stderr(tmp_path: Path,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    """One bar counting the tensors and the write, on stderr; stdout is the folder alone."""
    from kvpool.cli.main import main

    good = write_gguf(make_tiny(tmp_path / "tiny", TinySpec(seed=1)), tmp_path / "good.gguf")
    assert main(["model", "import", str(good), str(tmp_path / "hf")]) == 0
    out, err = capsys.readouterr()
    assert out == f"{tmp_path / 'hf'}\n"
    last = err.replace("\r", "\n").strip().splitlines()[-1]
    assert last.startswith("importing: 100%") and " 22/22 " in last, err
