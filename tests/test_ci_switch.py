"""The CI switch (tests.support.require, tests/conftest.py): under KVPOOL_CI=1 a skip whose cause
CI provides fails; a skip CI cannot provide stays a skip; without the switch all of them skip."""

from __future__ import annotations

import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PROBE = '''
import pytest
from tests.support.require import missing, outside_ci, require_module, skip_outside_ci

def test_adhoc():
    pytest.skip("ad hoc")

def test_missing():
    missing("the wheel")

def test_module():
    require_module("kvpool_no_such_module")

def test_outside():
    skip_outside_ci("a GPU")

@pytest.mark.skipif(True, reason="plain marker")
def test_marker():
    pass

@pytest.mark.skipif(True, reason=outside_ci("no CUDA device"))
def test_outside_marker():
    pass

def test_passes():
    pass
'''


def outcomes(tmp_path: Path, ci: bool) -> dict[str, str]:
    """Run PROBE under the tests' conftest; each test's outcome from the JUnit report."""
    (tmp_path / "test_probe.py").write_text(PROBE)
    report = tmp_path / f"report-{ci}.xml"
    env = {k: v for k, v in os.environ.items() if k != "KVPOOL_CI"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(ROOT / "src"), env.get("PYTHONPATH", "")])
    if ci:
        env["KVPOOL_CI"] = "1"
    subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "tests.conftest",
                    "-p", "no:cacheprovider", "--rootdir", str(tmp_path), "-c", os.devnull,
                    f"--junitxml={report}", str(tmp_path / "test_probe.py")],
                   cwd=tmp_path, env=env, capture_output=True, timeout=60, check=False)
    found = {}
    for case in ET.parse(report).getroot().iter("testcase"):
        kinds = [child.tag for child in case if child.tag in ("skipped", "failure", "error")]
        found[case.attrib["name"]] = kinds[0] if kinds else "passed"
    return found


@pytest.mark.parametrize("ci", [False, True])
def test_a_skip_ci_could_provide_fails_under_the_switch(tmp_path: Path, ci: bool) -> None:
    quiet = "failure" if ci else "skipped"
    assert outcomes(tmp_path, ci) == {
        "test_adhoc": quiet, "test_missing": quiet, "test_module": quiet,
        "test_outside": "skipped", "test_marker": "error" if ci else "skipped",
        "test_outside_marker": "skipped", "test_passes": "passed"}
