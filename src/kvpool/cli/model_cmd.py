"""`kvpool model make-tiny DIR`: write a small random checkpoint in the Hugging Face layout;
`kvpool model import FILE.gguf DIR`: a GGUF file as a Hugging Face folder
(kvpool.engine.gguf_checkpoint)."""

from __future__ import annotations

import argparse


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("model", help="model checkpoints (make-tiny, import)")
    sub = parser.add_subparsers(dest="model_command", metavar="ACTION")
    imp = sub.add_parser("import", help="write a GGUF file (llama) as a Hugging Face folder")
    imp.add_argument("gguf", help="the .gguf file")
    imp.add_argument("dir", help="output folder (created)")
    imp.set_defaults(func=import_cmd)
    p = sub.add_parser("make-tiny", help="write a small random Llama/Qwen2 checkpoint")
    p.add_argument("dir", help="output folder (created)")
    p.add_argument("--arch", choices=("llama", "qwen2"), default="llama")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--vocab", type=int, default=512)
    p.add_argument("--tie-embeddings", action="store_true")
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=make_tiny_cmd)


def import_cmd(args: argparse.Namespace) -> int:
    import sys

    from kvpool.cli.progress import progress_bar
    from kvpool.engine.gguf_checkpoint import import_gguf
    from kvpool.errors import KvpoolError

    try:
        with progress_bar("importing", "tensor") as progress:
            folder = import_gguf(args.gguf, args.dir, progress)
        print(folder)
    except KvpoolError as exc:
        print(f"kvpool model import: {exc}", file=sys.stderr)
        return 1
    return 0


def make_tiny_cmd(args: argparse.Namespace) -> int:
    from kvpool.engine.tiny import TinySpec, make_tiny
    spec = TinySpec(arch=args.arch, num_layers=args.layers, hidden_size=args.hidden,
                    num_heads=args.heads, num_kv_heads=args.kv_heads, vocab_size=args.vocab,
                    tie_word_embeddings=args.tie_embeddings, seed=args.seed)
    print(make_tiny(args.dir, spec))
    return 0
