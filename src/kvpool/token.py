"""The cluster's shared secret as the environment gives it: `$KVPOOL_TOKEN` (empty = none).
Every command and library default reads it here."""

from __future__ import annotations

import os

TOKEN_ENV = "KVPOOL_TOKEN"


def env_token() -> str | None:
    """`$KVPOOL_TOKEN`, or None when it is unset or empty."""
    return os.environ.get(TOKEN_ENV) or None
