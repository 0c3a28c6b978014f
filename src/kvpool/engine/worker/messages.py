"""The worker API's messages (docs/worker-api.md): one pydantic model per request and reply,
the one definition that the workers, the proxy and the worker clients all import.

    POST /prefill     PrefillRequest  -> PrefillReply
    POST /generate    GenerateRequest -> NDJSON lines: TokensLine ... FinishLine | ErrorLine
    POST /kv/reserve  ReserveRequest  -> ReserveReply        (503 when there is no room)
    POST /abort       AbortRequest    -> AbortReply
    GET  /info        InfoReply;  GET /load  LoadReply

Sampling parameters travel as the engine's own `SamplingParams` (validated on arrival, so a
bad value is a 400, not a failed request). Requests refuse unknown fields: a misspelt field is
an error, never silently dropped. Replies ignore them (a newer worker may add some). NDJSON
lines carry their `type`.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Annotated, Any, Literal, TypeVar

import msgspec
from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError, model_validator

from kvpool.engine.config import SamplingParams
from kvpool.engine.sequence import TokenLogprob
from kvpool.errors import InvalidArgument, WorkerCallError

RequestId = Annotated[str, Field(min_length=1, max_length=512)]
KVMode = Literal["pool", "push"]
KVSourceName = Literal["pool", "push", "none"]
"""Where a decode leg's prompt KV comes from (none: computed there, colocated)."""
Role = Literal["prefill", "decode", "both"]
MAX_STREAM_INTERVAL = 1024


class _Request(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class _Reply(BaseModel):
    model_config = ConfigDict(extra="ignore", frozen=True)


class KVTransfer(_Request):
    mode: KVMode | None = None
    """None: the worker's default (--kv-transfer)."""
    decode_url: str | None = None
    """The decode worker to push to (push only)."""


class PrefillRequest(_Request):
    request_id: RequestId
    prompt_token_ids: list[int] = Field(min_length=1)
    sampling: SamplingParams = SamplingParams()
    kv_transfer: KVTransfer = KVTransfer()


class PrefillReply(_Reply):
    request_id: str
    first_token_id: int
    first_token_t: float = 0.0
    """The engine's stamp of the step that made the first token."""
    num_prompt_tokens: int
    num_cached_tokens: int = 0
    num_pool_tokens: int = 0
    num_computed_tokens: int = 0
    prefill_s: float = 0.0
    pool_load_s: float = 0.0
    kv_bytes_moved: int = 0
    """Pool reads and writes, or the push."""
    first_logprob: TokenLogprob | None = None
    prompt_logprobs: list[TokenLogprob | None] | None = None
    kv_transfer_params: dict[str, Any] | None = None
    """An engine's own handoff to the decode leg (vLLM's `kv_transfer_params`, relayed as
    is); kvpool workers send none."""


class SseSpec(_Request):
    """Asks the decoding worker for the response's SSE text chunks (kvpool proxy
    --worker-sse): detokenized, stop strings applied, with the response's id, model name and
    choice index, byte for byte as the proxy would make them (serve/protocol.py TextChunks,
    chunk). The proxy relays them; a stop string ends the stream with finish_reason stop."""

    kind: Literal["completion", "chat"]
    id: str = Field(min_length=1, max_length=512)
    model: str = Field(max_length=512)
    index: int = Field(default=0, ge=0)
    stop: list[str] = Field(default_factory=list, max_length=16)


class GenerateRequest(_Request):
    request_id: RequestId
    prompt_token_ids: list[int] = Field(min_length=1)
    sampling: SamplingParams = SamplingParams()
    first_token_id: int | None = None
    """The prefill leg's token (needed unless kv_source is none)."""
    kv_source: KVSourceName = "none"
    resume_output_ids: list[int] = Field(default_factory=list)
    """A request resumed here after its worker failed: the output tokens the client already
    has. They are computed with the prompt (kv_source none; the prompt's blocks still come
    from the pool), count as output (max_tokens, min_tokens, penalties, seeded positions)
    and are not streamed again; tokens that already end the request get the finish line
    alone."""
    kv_transfer_params: dict[str, Any] | None = None
    """The prefill leg's handoff, for engines that have one (vLLM backend); None here."""
    joins_prefilled: bool = False
    """The vLLM face's P/D decode leg (kv_source none: the prompt's blocks come from the pool
    as any request's do): `Sequence.joins_prefilled`."""
    sse: SseSpec | None = None
    """The frames carry the response's SSE bytes too (the text streamed so far is that of
    `resume_output_ids` and `first_token_id`: the proxy sent it already)."""
    stream_interval: int | None = Field(default=None, ge=1, le=MAX_STREAM_INTERVAL)
    """Output tokens per frame: the first frame goes at once, then one every this many
    tokens (and the last with the finish); None: the worker's --stream-interval."""
    merge_steps: bool = False
    """The steps that ended while the worker's event loop was busy elsewhere go as one frame
    (a worker behind its engine writes, and its reader relays, one frame per wake-up instead
    of one per step); False: a frame per step (or per `stream_interval`), whatever the
    timing."""


class TokenLine(_Reply):
    """One output token: a client's view of a `TokensLine` (`TokensLine.split`), and the line a
    worker from before frames sent (`generate_line` reads it as a frame of one)."""

    type: Literal["token"] = "token"
    token_id: int
    t: float = 0.0
    """The engine's stamp of the step that made it (0 for the prefill leg's token)."""
    logprob: TokenLogprob | None = None
    prompt_logprobs: list[TokenLogprob | None] | None = None
    """With the first token of a colocated request that asks for them."""


class TokensLine(_Reply):
    """One frame of a /generate stream: the output tokens of one engine step (several steps'
    with a stream interval over 1), in order. The receiver counts tokens by `token_ids`."""

    type: Literal["tokens"] = "tokens"
    token_ids: list[int] = Field(min_length=1)
    t: list[float]
    """Each token's stamp: the engine's clock when the step that made it ended."""
    logprobs: list[TokenLogprob | None] | None = None
    """Each token's logprob, if the request asks."""
    prompt_logprobs: list[TokenLogprob | None] | None = None
    """With the frame that holds the first token of a colocated request that asks for them."""
    sse: str | None = None
    """With GenerateRequest.sse: the SSE events of this frame's text ("" while it is held)."""
    reuse: list[int] | None = None
    """With a request's first frame: as `PlainFrame.reuse`."""

    @model_validator(mode="after")
    def _aligned(self) -> TokensLine:
        n = len(self.token_ids)
        if len(self.t) != n or (self.logprobs is not None and len(self.logprobs) != n):
            raise ValueError(f"{n} token ids need as many stamps (and logprobs, if any)")
        return self

    @classmethod
    def of(cls, line: TokenLine) -> TokensLine:
        return cls(token_ids=[line.token_id], t=[line.t],
                   logprobs=None if line.logprob is None else [line.logprob],
                   prompt_logprobs=line.prompt_logprobs)

    def split(self) -> list[TokenLine]:
        """One line per token (the prompt's logprobs with the first)."""
        lps = self.logprobs or [None] * len(self.token_ids)
        return [TokenLine(token_id=tok, t=t, logprob=lp,
                          prompt_logprobs=self.prompt_logprobs if i == 0 else None)
                for i, (tok, t, lp) in enumerate(zip(self.token_ids, self.t, lps, strict=True))]


class FinishLine(_Reply):
    type: Literal["finish"] = "finish"
    finish_reason: str
    num_output_tokens: int = 0
    num_cached_tokens: int = 0
    num_pool_tokens: int = 0
    """Prompt tokens this worker did not compute (its cache, the pool)."""
    sse: str | None = None
    """With GenerateRequest.sse: the held text's event, if any, and the finish chunk."""


class ErrorLine(_Reply):
    type: Literal["error"] = "error"
    error: str


GenerateLine = Annotated[TokensLine | TokenLine | FinishLine | ErrorLine,
                         Field(discriminator="type")]
GENERATE_LINE: TypeAdapter[TokensLine | TokenLine | FinishLine | ErrorLine] = \
    TypeAdapter(GenerateLine)


class ReserveRequest(_Request):
    request_id: RequestId
    num_tokens: int = Field(ge=1)


class ReserveReply(_Reply):
    ok: bool
    segment: str
    block_bytes: int
    regions: list[tuple[int, int]]
    """(address, length) of each reserved region in `segment`."""
    ttl_s: float = 0.0
    """Seconds the regions are held from the reservation on: a push must start within them
    (after them the regions may hold another request's KV; 0: not said)."""


class AbortRequest(_Request):
    request_id: str


class AbortReply(_Reply):
    ok: bool


class InfoReply(_Reply):
    role: Role
    model: str = ""
    model_hash: int
    block_size: int = Field(gt=0)
    max_model_len: int
    kv_capacity_tokens: int
    segment: str = ""
    engine: dict[str, Any] = Field(default_factory=dict)
    """The engine's facts (kind; for the emulated one its profile and scales)."""
    sse_text: bool = False
    """It makes a stream's SSE text when asked (GenerateRequest.sse): a decoding worker whose
    model folder has a tokenizer that has not failed to load. False from a worker before
    this field: a proxy then makes the text itself."""


class LoadReply(_Reply):
    num_waiting: int = 0
    num_running: int = 0
    queued_prefill_tokens: int = 0
    running_tokens: int = 0
    free_kv_tokens: int = 0
    kv_capacity_tokens: int = 0
    engine_lost_s: float = 0.0
    block_hashes: list[int] | None = None
    """Every cached block hash (a full report) ..."""
    block_events: list[tuple[int, bool]] | None = None
    """... or what changed since `since`: (hash, stored) in order."""
    epoch: str = ""
    events_to: int = 0


M = TypeVar("M", bound=BaseModel)


def parse(model: type[M], obj: Any, what: str) -> M:
    """`obj` (decoded JSON) as `model`; InvalidArgument naming `what` and the first problem."""
    try:
        return model.model_validate(obj)
    except ValidationError as exc:
        raise InvalidArgument(_malformed(exc, what)) from None


def _malformed(exc: ValidationError, what: str) -> str:
    err = exc.errors()[0]
    where = ".".join(str(p) for p in err["loc"]) or "body"
    return f"malformed {what}: {where}: {err['msg']}"


def reply_from(url: str, call: str, model: type[M], raw: bytes) -> M:
    """A worker's reply body as `model`; WorkerCallError (naming the worker and the call) if
    it is not JSON or not that message. Both worker clients read replies with it. The JSON
    is read by pydantic itself: a /load reply's thousands of block events in half the time
    of `json.loads` and a validation of its objects."""
    try:
        return model.model_validate_json(raw)
    except ValidationError as exc:  # not JSON, or not the message
        raise WorkerCallError(url, call, f"{_malformed(exc, f'{call} reply')} "
                                         f"(reply {raw[:200]!r})") from None


_JSON = msgspec.json.Encoder()


class PlainFrame(msgspec.Struct, tag_field="type", tag="tokens", forbid_unknown_fields=True,
                 omit_defaults=True):
    """A frame of ids and stamps only (with its SSE text where the request asked): the line
    of most engine steps, made by the worker and read by the proxy without pydantic (about a
    tenth of the cost); the same JSON as a `TokensLine` of those fields. A line with any other
    field is a `TokensLine` (`generate_line`). `logprobs` and `prompt_logprobs` are always
    None, so that a reader takes either kind alike."""

    token_ids: list[int]
    t: list[float]
    sse: str | None = None
    logprobs: None = None
    prompt_logprobs: None = None
    reuse: list[int] | None = None
    """With a request's first frame: [prompt tokens reused from the worker's own cache,
    from the pool] (as the finish line says them, for a stream that ends before it)."""


Frame = TokensLine | PlainFrame
"""A /generate frame as the readers take it."""


def ndjson_line(msg: BaseModel | PlainFrame) -> bytes:
    """One /generate line's bytes (a plain frame's, and a `TokensLine` of a plain frame's
    fields, without pydantic: the same JSON either way)."""
    if isinstance(msg, PlainFrame):
        return _JSON.encode(msg) + b"\n"
    if isinstance(msg, TokensLine) and msg.logprobs is None and msg.prompt_logprobs is None:
        return _JSON.encode(PlainFrame(msg.token_ids, msg.t, msg.sse, reuse=msg.reuse)) + b"\n"
    return msg.model_dump_json(exclude_none=True).encode() + b"\n"


class _NotAFrame(msgspec.Struct, tag_field="type", tag="~"):
    """There only so that a plain frame's `type` is required (msgspec reads a lone tagged
    struct without its tag, a union of them with it); what decodes as this is no frame."""


_PLAIN_FRAME = msgspec.json.Decoder(PlainFrame | _NotAFrame)


def _plain_frame(line: str | bytes) -> PlainFrame | None:
    """`line` as a plain frame, or None (any other line, a malformed one included: for
    `generate_line` to read or refuse with its own message)."""
    try:
        frame = _PLAIN_FRAME.decode(line)
    except msgspec.DecodeError:  # a msgspec.ValidationError too
        return None
    if not isinstance(frame, PlainFrame):
        return None
    return frame if frame.token_ids and len(frame.t) == len(frame.token_ids) else None


def read_frames(url: str, lines: Sequence[str | bytes],
                merge: bool = True) -> tuple[list[Frame | FinishLine], int, WorkerCallError | None]:
    """The frames of one read of a /generate stream, up to its finish line: (frames, how many
    of `lines` they took, the error of the line that ended them early). Lines after a finish
    line are not read (the caller's error to report); frames before a malformed or error line
    are returned with its error, so the caller relays them first. With `merge`, consecutive
    plain frames become one (`plain_prefix`): a reader behind the worker relays one frame per
    read, not one per engine step, as vLLM's API server merges the outputs of the steps it
    fell behind."""
    out: list[Frame | FinishLine] = []
    i = 0
    while i < len(lines):
        if merge:
            count, frame = plain_prefix(lines, i)
            if frame is not None:
                out.append(frame)
                i += count
                continue
            plain = None  # plain_prefix found no plain frame here
        else:
            plain = _plain_frame(lines[i])
        if plain is not None:
            out.append(plain)
            i += 1
            continue
        try:
            msg = generate_line(url, lines[i])
        except WorkerCallError as exc:
            return out, i, exc
        out.append(msg)
        i += 1
        if isinstance(msg, FinishLine):
            return out, i, None
    return out, len(lines), None


def plain_prefix(lines: Sequence[str | bytes], start: int = 0) -> tuple[int, PlainFrame | None]:
    """The plain frames `lines` has from `start` on, merged into one: (how many lines they
    are, the frame or None when the line at `start` is no plain frame). Their tokens, stamps
    and SSE text in order; a lone frame as it is."""
    plains: list[PlainFrame] = []
    for line in itertools.islice(lines, start, None):
        plain = _plain_frame(line)
        if plain is None:
            break
        plains.append(plain)
    if len(plains) <= 1:
        return len(plains), plains[0] if plains else None
    texts = [p.sse for p in plains if p.sse]
    return len(plains), PlainFrame([t for p in plains for t in p.token_ids],
                                   [t for p in plains for t in p.t],
                                   "".join(texts) if texts else None,
                                   reuse=next((p.reuse for p in plains if p.reuse), None))


def generate_line(url: str, line: str | bytes) -> TokensLine | FinishLine:
    """One /generate line (a one-token line as a frame of one); WorkerCallError for a
    malformed line or an error line."""
    try:
        msg = GENERATE_LINE.validate_json(line)
    except ValueError:
        raise WorkerCallError(url, "/generate", f"malformed line {line[:200]!r}") from None
    if isinstance(msg, ErrorLine):
        raise WorkerCallError(url, "/generate", msg.error)
    return TokensLine.of(msg) if isinstance(msg, TokenLine) else msg
