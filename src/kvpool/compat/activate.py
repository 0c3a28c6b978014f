"""Drop-in activation: make `import mooncake.store` / `import mooncake.engine` resolve to kvpool.

`activate(target)` writes a small `mooncake` package into a site-packages directory; each of
its modules re-exports kvpool's compat module of the same name. A marker file names the package
as kvpool's, so `deactivate` removes it and nothing else. Activation refuses to write when the
real Mooncake wheel is installed there (its `mooncake*.dist-info`) or when a `mooncake`
package without the marker is present: kvpool never shadows or overwrites the real one.
"""

from __future__ import annotations

import shutil
import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path

from kvpool import __version__

MARKER = "KVPOOL_MOONCAKE_SHIM"
PACKAGE = "mooncake"
_MODULES = {
    "__init__": '"""kvpool\'s stand-in for Mooncake (written by `kvpool mooncake activate`)."""\n',
    "store": "from kvpool.compat.mooncake.store import *  # noqa: F403\n"
             "from kvpool.compat.mooncake.store import (  # noqa: F401\n"
             "    ACTIVATION, COMPLETE, FAILED, GENERAL, GRADIENT, INITIALIZED, KVCACHE,\n"
             "    METADATA, OPTIMIZER_STATE, PROCESSING, REMOVED, SAMPLE, TENSOR, UNDEFINED,\n"
             "    UNKNOWN, WEIGHT,\n)\n",
    "engine": "from kvpool.compat.mooncake.engine import *  # noqa: F403\n",
    "mooncake_config": "from kvpool.compat.mooncake.config import *  # noqa: F403\n"
                       "from kvpool.compat.mooncake.config import MooncakeConfig  # noqa: F401\n",
}


MASTER_SCRIPT = "mooncake_master"
_MASTER_BODY = """#!{python}
# {marker}: written by `kvpool mooncake activate`; runs `kvpool master` with Mooncake's flags
import sys

from kvpool.cli.main import main

sys.exit(main(["master", *sys.argv[1:]]))
"""


@dataclass(frozen=True)
class ShimStatus:
    target: Path
    shim_active: bool
    """kvpool's `mooncake` package is installed in `target`."""
    real_mooncake: tuple[str, ...]
    """dist-info directories of a real Mooncake wheel found in `target`."""
    foreign_package: bool
    """A `mooncake` package that is not kvpool's is present in `target`."""


def default_target() -> Path:
    """site-packages (purelib) of the running interpreter's environment."""
    return Path(sysconfig.get_paths()["purelib"])


def default_scripts() -> Path:
    """The environment's bin directory, where the real wheel puts `mooncake_master`."""
    return Path(sysconfig.get_paths()["scripts"])


def _ours(script: Path) -> bool:
    try:
        return MARKER in script.read_text(encoding="utf-8", errors="replace")[:400]
    except OSError:
        return False


def _write_master_script(scripts: Path) -> str | None:
    """Write `mooncake_master` into `scripts`; an error message when it cannot."""
    script = scripts / MASTER_SCRIPT
    if script.exists() and not _ours(script):
        return f"{script} exists and is not kvpool's; refusing to overwrite it"
    if not scripts.is_dir():
        return f"{scripts} is not a directory"
    script.write_text(_MASTER_BODY.format(python=sys.executable, marker=MARKER),
                      encoding="utf-8")
    script.chmod(0o755)
    return None


def find_real_mooncake(target: Path) -> tuple[str, ...]:
    """Names of real Mooncake distributions installed in `target`."""
    if not target.is_dir():
        return ()
    return tuple(sorted(p.name for p in target.iterdir()
                        if p.name.lower().startswith("mooncake") and p.name.endswith(".dist-info")))


def status(target: Path) -> ShimStatus:
    package = target / PACKAGE
    shim = (package / MARKER).is_file()
    return ShimStatus(target, shim, find_real_mooncake(target), package.exists() and not shim)


def activate(target: Path, scripts: Path | None = None) -> tuple[bool, str]:
    """(done, message). Idempotent: activating twice rewrites kvpool's own shim. With
    `scripts`, also writes a `mooncake_master` command there that runs `kvpool master`."""
    state = status(target)
    if state.real_mooncake:
        return False, (f"the real Mooncake is installed in {target} ({', '.join(state.real_mooncake)});"
                       " kvpool will not shadow it. Uninstall it first or use another environment.")
    if state.foreign_package:
        return False, f"{target / PACKAGE} exists and is not kvpool's; refusing to overwrite it"
    if not target.is_dir():
        return False, f"{target} is not a directory"
    if scripts is not None:
        problem = _write_master_script(scripts)
        if problem is not None:
            return False, problem
    package = target / PACKAGE
    package.mkdir(exist_ok=True)
    for name, body in _MODULES.items():
        (package / f"{name}.py").write_text(body, encoding="utf-8")
    (package / MARKER).write_text(f"kvpool {__version__}\n", encoding="utf-8")
    return True, f"`import mooncake.store` / `mooncake.engine` now resolve to kvpool ({package})"


def deactivate(target: Path, scripts: Path | None = None) -> tuple[bool, str]:
    """(done, message). Removes only a package (and a `mooncake_master` in `scripts`)
    carrying kvpool's marker."""
    if scripts is not None and _ours(scripts / MASTER_SCRIPT):
        (scripts / MASTER_SCRIPT).unlink()
    state = status(target)
    if state.foreign_package:
        return False, f"{target / PACKAGE} is not kvpool's; leaving it alone"
    if not state.shim_active:
        return True, f"kvpool's Mooncake shim is not active in {target}; nothing to do"
    shutil.rmtree(target / PACKAGE)
    return True, f"removed kvpool's Mooncake shim from {target}"
