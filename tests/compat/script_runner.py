"""Running `mooncake_script.py` in a fresh interpreter against one implementation, and the
results the real Mooncake wheel (0.3.13) gives for it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).with_name("mooncake_script.py")
SRC = Path(__file__).resolve().parents[2] / "src"

MOONCAKE_RESULTS = {
    "bad_puts": [-600, -600], "batch_get_into": [200, -704, 100], "batch_is_exist": [1, 0],
    "batch_mismatch": [[-600, -600], [-600, -600]], "batch_put_from": [0, 0],
    "batch_remove": [[-706, -704], [0]], "batch_replica_desc_keys": ["pp"], "close": [0, 1],
    "get": ["hello", ""], "get_batch": ["1", "", "22"], "get_buffer": [6, 6, "abcdef"],
    "get_buffer_missing": True, "get_into": 4096, "get_into_bytes_equal": True,
    "get_into_missing": -704, "get_into_small": -600, "get_keyword": "TypeError",
    "get_size_missing": -704, "health": 0, "is_exist": [1, 0], "multi_bytes_equal": True,
    "multi_get": [150, 300, -704], "multi_mismatch": [[-600, -600], [-600, -600]],
    "multi_put": [0, 0], "multi_small": [-600], "multi_empty_piece": [[0], 150, [150], True], "put": [0, 0], "put_batch": [0, -600],
    "put_from": 0, "put_parts": [0, "abcdef"], "put_batch_one_empty": [-600, [0, 0, 0]], "put_with_config": 0,
    "regex": [0, 0, 2, 0, -600], "register": [0, 0, -600], "remove_all": 9, "remove_force": 0,
    "remove_leased": -706, "remove_missing": -704, "replica_desc": [1, True, 6, "127.0.0.1"],
    "replica_desc_missing": [], "setup": 0, "te_async": [True, 0], "te_batch_write": 0,
    "te_bytes_equal": True, "te_empty": 0, "te_init": [0, 0], "te_mismatch": -1,
    "te_probe": [0, True], "te_read": 0, "te_register": [0, 0, -7], "te_unregister": [0, -3],
    "te_write": 0, "unregister": [0, -600], "upsert": [0, "xx"],
    "tensor_put": [0, 0], "tensor_get": [True, "torch.float16", [2, 32, 2, 16], True],
    "tensor_batch_put": [0, 0], "tensor_batch_get": [True, True, True], "tensor_register": 0,
    "tensor_get_into": [True, True], "tensor_remove_all": 3,
    "edge_register_empty": [-600, 0], "edge_duplicate_keys_in_batch": [0, 0],
    "edge_duplicate_stored_once": 10,
    "edge_duplicate_upserts": [[0, 0], 20, 0, "first"], "edge_get_into_zero": -600, "edge_zero_replicas": -600,
    "edge_empty_batches": [[], 0, [], [], []], "edge_regex_everything": [0, 4, -704, 0],
    # sessions and ranges, tensor-parallel and from-buffer tensors, stored tensor bytes
    "rg_after_end": [-600],
    "rg_bytes_equal": [True, True, True],
    "rg_edges": [[0, -704], [[[8], [-704]]], [[[-600]]], [[[-600, -600]]],
                 [[[-600]], [[-600]]], [-600, 0], [-600], [-600], [-600], [-600], [-600], [0],
                 [-600], [[[-600], [-600]]], [[[-704]]], [[[0]]]],
    "rg_end": [0, 0],
    "rg_errors": [[-600], [-600], [-600, -600], [-600]],
    "rg_get_into_ranges": [[[10, 10], [5]]],
    "rg_get_into_ranges_bytes": [True, True],
    "rg_leased": -706,
    "rg_no_session": [-600],
    "rg_put": [0, 0],
    "rg_put_end": [[0], [0]],
    "rg_put_invisible": [0, 0],
    "rg_put_ranges": [100, 50],
    "rg_put_start": [0, 0, -705],
    "rg_put_visible": [[1, 0], True],
    "rg_ranges": [30, 30],
    "rg_remove_all": 4,
    "rg_start": [0, 0, -704],
    "tensor_raw_sha": [0, 0, 0, 0, 'c7bc8778db275c4c', 'bade6f82d7602bdb', '9f15304a48f26655',
                       '1813aa5b4e5abbf4'],
    "tf_put": [316, 0, -600, [-600, -600], True],
    "tf_register": 0,
    "tp_batch": [[0, 0],
                 [[[3.0, 4.0, 5.0], [9.0, 10.0, 11.0], [15.0, 16.0, 17.0], [21.0, 22.0, 23.0]],
                  [[4.0, 5.0, 6.0], [10.0, 11.0, 12.0], [16.0, 17.0, 18.0], [22.0, 23.0, 24.0]],
                  None]],
    "tp_exist": [0, 1, 1, 1, 0, 0],
    "tp_get": [[[12.0, 13.0, 14.0, 15.0, 16.0, 17.0], [18.0, 19.0, 20.0, 21.0, 22.0, 23.0]],
               [[4.0, 5.0], [10.0, 11.0], [16.0, 17.0], [22.0, 23.0]],
               [[0.0, 1.0, 2.0, 3.0, 4.0, 5.0], [6.0, 7.0, 8.0, 9.0, 10.0, 11.0],
                [12.0, 13.0, 14.0, 15.0, 16.0, 17.0], [18.0, 19.0, 20.0, 21.0, 22.0, 23.0]],
               True],
    "tp_into": [[[2.0, 3.0], [8.0, 9.0], [14.0, 15.0], [20.0, 21.0]],
                [[[0.0, 1.0, 2.0, 3.0, 4.0, 5.0], [6.0, 7.0, 8.0, 9.0, 10.0, 11.0]], None]],
    "tp_put": [0, 0, -600, 0, 0],
    "tp_raw_sha": ['04e8faa186939dc4', '92d1b867a8fd2939', '7a70da9da0759d66', 'd602672f0868c9bd',
                   '892d7746d3f26898'],
    "tp_remove_all": 26,
    "tp_more": [0, [0], 0, [0], 0, [0], 0, [0],
     [[[3.0, 4.0, 5.0], [9.0, 10.0, 11.0], [15.0, 16.0, 17.0], [21.0, 22.0, 23.0]],
      [[0.0, 1.0, 2.0, 3.0, 4.0, 5.0], [6.0, 7.0, 8.0, 9.0, 10.0, 11.0]],
      [[3.0, 4.0, 5.0], [9.0, 10.0, 11.0], [15.0, 16.0, 17.0], [21.0, 22.0, 23.0]],
      [[4.0, 5.0], [10.0, 11.0], [16.0, 17.0], [22.0, 23.0]],
      [[0.0, 1.0, 2.0, 3.0, 4.0, 5.0], [6.0, 7.0, 8.0, 9.0, 10.0, 11.0],
       [12.0, 13.0, 14.0, 15.0, 16.0, 17.0], [18.0, 19.0, 20.0, 21.0, 22.0, 23.0]],
      [[2.0, 3.0], [8.0, 9.0], [14.0, 15.0], [20.0, 21.0]],
      [[0.0, 2.0, 4.0, 6.0, 8.0, 10.0], [12.0, 14.0, 16.0, 18.0, 20.0, 22.0],
       [24.0, 26.0, 28.0, 30.0, 32.0, 34.0], [36.0, 38.0, 40.0, 42.0, 44.0, 46.0]]]],
    "close_twice": [0, 0],
}
"""What the real wheel printed (recorded once; the differential test checks it live)."""


def run_script(master: str, shim_dir: Path | None, metadata: str = "P2PHANDSHAKE",
               timeout_s: float = 60.0) -> dict[str, object]:
    """Run the script in a new interpreter. With `shim_dir`, kvpool's activated `mooncake`
    package (and kvpool's sources) come first on the path; without, whatever `mooncake` the
    environment has answers."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(MOONCAKE_MASTER=master, MOONCAKE_TE_META_DATA_SERVER=metadata,
               KVPOOL_LOG_LEVEL="ERROR")
    if shim_dir is not None:
        env["PYTHONPATH"] = os.pathsep.join([str(shim_dir), str(SRC)])
    proc = subprocess.run([sys.executable, str(SCRIPT)], env=env, capture_output=True,
                          timeout=timeout_s, cwd=str(shim_dir or SCRIPT.parent))
    lines = [ln for ln in proc.stdout.decode().splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr.decode()[-3000:]
    return dict(json.loads(lines[-1][len("RESULT "):]))
