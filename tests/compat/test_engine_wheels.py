"""The engines' own code driving kvpool (slow; fetches pinned wheels from PyPI with
`pip --no-deps` into a scratch folder, never into this environment; skipped with the reason
when they cannot be fetched).

Only LMCache's Mooncake configuration and setup path runs on CPU without its GPU stack:
`MooncakeStoreConfig.from_file` turns a JSON file into the all-strings dict that its
`setup_mooncake_store` hands to `store.setup(dict)`. SGLang's and vLLM's Mooncake modules
import their CUDA kernels and model stacks (triton, torchvision built for their torch), so
their call sequences are replayed in test_engine_replays.py instead."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from kvpool.compat import activate as shim
from tests.compat.test_lifecycle import Master, master  # noqa: F401  (fixture)
from tests.support.procs import python_env
from tests.support.require import missing

pytestmark = pytest.mark.slow

LMCACHE = ["lmcache==0.5.6", "numba==0.68.1", "llvmlite==0.50.0", "cachetools==8.0.2",
           "py-cpuinfo==9.0.0", "psutil==7.2.2", "aiofile==3.12.3", "caio==0.12.10",
           "msgspec==0.23.0", "pyzmq==27.3.0", "cryptography==50.0.2", "cffi==2.1.1",
           "pycparser==3.12"]
"""LMCache and the packages its Mooncake connector module imports (versions that import
together on Python 3.11 with this environment's numpy and torch)."""


def _fetch(target: Path, requirements: list[str]) -> None:
    proc = subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps",
                           "--target", str(target), *requirements],
                          capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        missing(f"cannot fetch {requirements[0]} from PyPI: {proc.stderr.strip()[-300:]}")


_LMCACHE_DRIVER = """
import json, sys
from lmcache.v1.storage_backend.connector.mooncakestore_connector import (
    MooncakeStoreConfig, setup_mooncake_store)
from mooncake.store import MooncakeDistributedStore, ReplicateConfig

config = MooncakeStoreConfig.from_file(sys.argv[1])
store = MooncakeDistributedStore()
setup_mooncake_store(store, config)            # LMCache's own setup path
replica = ReplicateConfig()
replica.replica_num = 1
if config.prefer_local_alloc:
    replica.preferred_segment = store.get_hostname()
print(json.dumps({"module": type(store).__module__, "setup": config.setup_config,
                  "put": store.put_parts("chunk", b"meta", b"data", config=replica),
                  "exists": store.is_exist("chunk"), "get": store.get("chunk").decode(),
                  "close": store.close()}))
"""


def test_lmcache_configures_and_sets_up_kvpool(master: Master,  # noqa: F811
                                              tmp_path_factory: pytest.TempPathFactory) -> None:
    wheels = tmp_path_factory.mktemp("lmcache")
    _fetch(wheels, LMCACHE)
    activated = tmp_path_factory.mktemp("shim")
    assert shim.activate(activated)[0]
    config = tmp_path_factory.mktemp("cfg") / "mooncake.json"
    config.write_text(json.dumps({
        "local_hostname": "127.0.0.1", "metadata_server": "P2PHANDSHAKE",
        "master_server_address": master.address, "global_segment_size": "33554432",
        "mooncake_local_buffer_size": "16777216", "mooncake_prefer_local_alloc": True,
        "transfer_timeout": 1}))
    env = python_env()
    env["PYTHONPATH"] = ":".join([str(activated), str(Path(__file__).parents[2] / "src"),
                                  str(wheels)])
    proc = subprocess.run([sys.executable, "-c", _LMCACHE_DRIVER, str(config)], env=env,
                          capture_output=True, text=True, timeout=300, cwd=str(activated))
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["module"].startswith("kvpool.compat")
    assert result["setup"]["global_segment_size"] == "33554432"  # strings, as LMCache sends
    assert (result["put"], result["exists"], result["get"], result["close"]) == \
        (0, 1, "metadata", 0)
