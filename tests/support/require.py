"""What a test needs from its machine, and what happens when it is missing.

Contract:
- `missing(reason)`: something that `scripts/setup.sh` and `.ci/run` install or provide (the
  real Mooncake wheel, transformers, gguf, `ip` and network namespaces, root, a tmpfs mount,
  etcd, the lm-eval and aiperf environments, vLLM's CPU build named by $KVPOOL_VLLM_PYTHON) is
  absent. On a developer's machine the test is
  skipped with `reason`; under `KVPOOL_CI=1` (set by `.ci/run`) it FAILS, so CI cannot go green
  by skipping what it was meant to test.
- `require_module(name, reason)`: `pytest.importorskip` with the same rule; usable at module
  level.
- `outside_ci(reason)` / `skip_outside_ci(reason)`: a skip whose cause CI does not provide (a
  GPU, a port or a limit this host happens to have); it stays a skip under the
  switch and its reason says so.
- Under the switch, the root conftest fails any other skip (`skip_allowed_in_ci`): a new
  ad-hoc `pytest.skip`, or a `skipif` marker whose reason is plain (a Linux feature such as
  MAP_POPULATE, which CI has), cannot skip quietly either.
"""

from __future__ import annotations

import importlib
import os
from types import ModuleType
from typing import NoReturn

import pytest

CI_SWITCH = "KVPOOL_CI"
OUTSIDE_CI = "not provided by CI: "
"""Prefix of every skip reason that CI cannot provide; `skip_allowed_in_ci` allows exactly these."""


def in_ci() -> bool:
    """True under `.ci/run` (KVPOOL_CI=1): CI-provided dependencies must be present."""
    return os.environ.get(CI_SWITCH, "") == "1"


def missing(reason: str) -> NoReturn:
    """A CI-provided dependency is absent: skip here, fail under KVPOOL_CI=1."""
    __tracebackhide__ = True
    if in_ci():
        pytest.fail(f"{CI_SWITCH}=1 and a dependency CI provides is missing: {reason}",
                    pytrace=False)
    raise pytest.skip.Exception(reason, allow_module_level=True)


def require_module(name: str, reason: str = "") -> ModuleType:
    """Import `name`, or `missing(...)` with why (works at module level too)."""
    __tracebackhide__ = True
    try:
        return importlib.import_module(name)
    except ImportError as exc:
        error = str(exc)
    missing(f"cannot import {name} ({error}){'; ' + reason if reason else ''}")


def outside_ci(reason: str) -> str:
    """A skip reason for a cause CI does not provide (for `skipif(..., reason=...)`)."""
    return OUTSIDE_CI + reason


def skip_outside_ci(reason: str) -> NoReturn:
    """Skip, also under KVPOOL_CI=1: CI cannot provide this (a GPU, a port this host holds...)."""
    __tracebackhide__ = True
    raise pytest.skip.Exception(outside_ci(reason), allow_module_level=True)


def skip_allowed_in_ci(reason: str) -> bool:
    """Whether a skip with this reason is one CI may report (see `outside_ci`)."""
    return OUTSIDE_CI in reason
