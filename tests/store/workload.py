"""A client process's mixed workload for the multi-process tests; prints one JSON line."""

from __future__ import annotations

import itertools
import json
import random
import sys
import time

from kvpool.store.client.config import ClientConfig
from kvpool.store.client.store_client import StoreClient
from kvpool.store.config import ReplicateConfig
from kvpool.store.wire.codes import ErrorCode as E
from tests.store.cluster import content


def main(argv: list[str]) -> None:
    master, worker, num_ops, replicas = argv[0], int(argv[1]), int(argv[2]), int(argv[3])
    # With `seconds`, run for that long whatever the op count (a fault must land mid-run).
    seconds = float(argv[4]) if len(argv) > 4 else 0.0
    rng = random.Random(worker)
    acked: dict[str, int] = {}
    stats = {"bad_reads": 0, "lost_own": 0, "ops": 0}
    codes: dict[str, int] = {}
    cfg = ReplicateConfig(replica_num=replicas)
    with StoreClient(ClientConfig(master=master, local_buffer_size=4 << 20,
                                  transfer_timeout_s=3.0)) as store:
        print("ready", flush=True)
        sys.stdin.readline()  # "go": every worker starts at once
        t0 = time.monotonic()
        for n in itertools.count():
            if (time.monotonic() - t0 > seconds) if seconds else n >= num_ops:
                break
            op = rng.random()
            if op < 0.4 or not acked:
                key, size = f"w{worker}-{n}", rng.randint(1, 8192)
                res = store.put(key, content(key, size), cfg)
                if res.ok:
                    acked[key] = size
                codes[f"put:{res.code.name}"] = codes.get(f"put:{res.code.name}", 0) + 1
            elif op < 0.75:
                own = rng.random() < 0.7
                key = rng.choice(list(acked)) if own else \
                    f"w{rng.randrange(8)}-{rng.randrange(max(1, n))}"
                got = store.get(key)
                if got.ok and got.data != content(key, len(got.data)):
                    stats["bad_reads"] += 1
                if got.ok and own and len(got.data) != acked[key]:
                    stats["bad_reads"] += 1
                codes[f"get:{got.code.name}"] = codes.get(f"get:{got.code.name}", 0) + 1
            elif op < 0.85:
                store.exists(rng.choice(list(acked)))
            elif op < 0.95:
                key = rng.choice(list(acked))
                code = store.remove(key)
                if code == E.OK:
                    del acked[key]
                codes[f"remove:{code.name}"] = codes.get(f"remove:{code.name}", 0) + 1
            else:
                keys = [f"w{worker}-{n}-b{i}" for i in range(8)]
                vals = [content(k, 512 + i) for i, k in enumerate(keys)]
                for k, v, r in zip(keys, vals, store.put_batch(keys, vals, cfg), strict=True):
                    if r.ok:
                        acked[k] = len(v)
                for k, g in zip(keys, store.get_batch(keys), strict=True):
                    if g.ok and g.data != content(k, len(g.data)):
                        stats["bad_reads"] += 1
            stats["ops"] += 1
    print(json.dumps({"acked": acked, "stats": stats, "codes": codes}), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
