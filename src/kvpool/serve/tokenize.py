"""vLLM's tokenizer endpoints over the proxy's tokenizer (pure: parsed body in, reply out).

    POST /tokenize    {"prompt": str | "messages": [...], "add_special_tokens"?}
                      -> {"count", "max_model_len", "tokens"}
    POST /detokenize  {"tokens": [int]} -> {"prompt": str}
"""

from __future__ import annotations

from typing import Any

from kvpool.serve.errors import model_not_found
from kvpool.serve.protocol import DetokenizeRequest, TokenizeRequest
from kvpool.serve.requests import Proxy, chat_ids, check_token_ids, encode_text


def tokenize(proxy: Proxy, req: TokenizeRequest) -> dict[str, Any]:
    _check_model(proxy, req.model)
    if req.messages is not None:
        ids = chat_ids(req.messages, proxy)
    else:
        ids = encode_text(req.prompt or "", proxy, "prompt", req.add_special_tokens)
    return {"count": len(ids), "max_model_len": proxy.max_model_len, "tokens": ids}


def detokenize(proxy: Proxy, req: DetokenizeRequest) -> dict[str, Any]:
    _check_model(proxy, req.model)
    return {"prompt": proxy.tokenizer.decode(check_token_ids(req.tokens, proxy, "tokens"))}


def _check_model(proxy: Proxy, model: str | None) -> None:
    if model is not None and model != proxy.model_name:
        raise model_not_found(model, proxy.model_name)
