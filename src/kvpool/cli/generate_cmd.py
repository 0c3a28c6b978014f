"""`kvpool generate --prefill URL --decode URL "prompt"`: one request through a prefill and a
decode worker (or `--both URL` for a colocated worker), printed as it streams. With only
`--model DIR`, the engine runs in this process (no workers, no pool)."""

from __future__ import annotations

import argparse
import sys
import uuid
from typing import TYPE_CHECKING, Any

from kvpool.token import env_token

if TYPE_CHECKING:
    from kvpool.engine.config import SamplingParams


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("generate", help="drive a prefill and a decode worker")
    p.add_argument("prompt")
    p.add_argument("--prefill", help="prefill worker URL, http://H:P")
    p.add_argument("--decode", help="decode worker URL")
    p.add_argument("--both", help="a colocated worker's URL (instead of --prefill/--decode)")
    p.add_argument("--kv-transfer", choices=("pool", "push"), default="pool")
    p.add_argument("--model", help="checkpoint folder for the tokenizer (default: the worker's); "
                                   "alone, run the engine in this process")
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--token", default=env_token())
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """One line and exit 1 for what the model or workers refuse (a folder without a chat
    template asked for --chat, a bad checkpoint), not a traceback."""
    from kvpool.errors import KvpoolError
    try:
        return _run(args)
    except KvpoolError as exc:
        hint = ("; drop --chat to send the prompt as it is"
                if args.chat and "chat_template" in str(exc) else "")
        print(f"kvpool generate: {exc}{hint}", file=sys.stderr)
        return 1


def _run(args: argparse.Namespace) -> int:
    import httpx

    from kvpool.engine.checkpoint import load_tokenizer
    from kvpool.engine.config import SamplingParams
    from kvpool.errors import WorkerCallError
    decode_url = args.both or args.decode
    if decode_url is None and args.prefill is None and args.model:
        return _in_process(args)
    if decode_url is None or (args.both is None and args.prefill is None):
        print("give --prefill and --decode, or --both, or --model alone", file=sys.stderr)
        return 2
    headers = {"Authorization": f"Bearer {args.token}"} if args.token else {}
    try:
        model = args.model or _model_of(decode_url, headers)
    except (httpx.HTTPError, WorkerCallError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    tok = load_tokenizer(model)
    text = tok.render_chat([{"role": "user", "content": args.prompt}]) if args.chat else args.prompt
    try:
        sampling = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                                  seed=args.seed, stop_token_ids=tuple(tok.eos_token_ids))
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    try:
        _drive(args, decode_url, tok, tok.encode(text), sampling)
    except (WorkerCallError, httpx.HTTPError) as exc:
        print(f"\nerror: {exc}", file=sys.stderr)
        return 1
    return 0


def _drive(args: argparse.Namespace, decode_url: str, tok: Any, ids: list[int],
           sampling: SamplingParams) -> None:
    """The prefill leg (unless colocated) and the decode leg, the text printed as it comes."""
    from kvpool.engine.worker.client import prefill, stream
    from kvpool.engine.worker.messages import (
        GenerateRequest,
        KVTransfer,
        PrefillRequest,
        TokenLine,
    )
    rid = uuid.uuid4().hex
    first = None
    if args.both is None:
        transfer = KVTransfer(mode=args.kv_transfer, decode_url=decode_url)
        info = prefill(args.prefill, PrefillRequest(
            request_id=rid, prompt_token_ids=ids, sampling=sampling, kv_transfer=transfer),
            args.token)
        first = info.first_token_id
        print(f"[prefill: {info.num_prompt_tokens} tokens, {info.num_cached_tokens} "
              f"cached, {info.num_pool_tokens} from the pool, {info.prefill_s:.3f}s]",
              file=sys.stderr)
    out: list[int] = []
    printed = ""
    req = GenerateRequest(request_id=rid, prompt_token_ids=ids, sampling=sampling,
                          first_token_id=first,
                          kv_source=args.kv_transfer if first is not None else "none")
    for msg in stream(decode_url, req, args.token):
        if isinstance(msg, TokenLine):
            out.append(msg.token_id)
            text_now = tok.decode(out)
            print(text_now[len(printed):], end="", flush=True)
            printed = text_now
        else:
            print(f"\n[{msg.finish_reason}, {msg.num_output_tokens} tokens]", file=sys.stderr)


def _model_of(url: str, headers: dict[str, str]) -> str:
    import httpx

    from kvpool.engine.worker.messages import InfoReply, reply_from
    from kvpool.errors import WorkerCallError
    reply = httpx.get(f"{url}/info", headers=headers, timeout=10)
    if reply.status_code != 200:
        raise WorkerCallError(url, "/info", f"{reply.status_code} {reply.text}",
                              reply.status_code)
    return reply_from(url, "/info", InfoReply, reply.content).model


def _in_process(args: argparse.Namespace) -> int:
    from kvpool.engine.checkpoint import load_tokenizer
    from kvpool.engine.config import SamplingParams
    from kvpool.engine.llm_engine import LLMEngine
    tok = load_tokenizer(args.model)
    text = tok.render_chat([{"role": "user", "content": args.prompt}]) if args.chat else args.prompt
    engine = LLMEngine.from_dir(args.model)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                            seed=args.seed, stop_token_ids=tok.eos_token_ids)
    out = engine.generate([tok.encode(text)], params)[0]
    print(tok.decode(out))
    print(f"[{len(out)} tokens]", file=sys.stderr)
    return 0
