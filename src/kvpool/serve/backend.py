"""The one seam between the proxy and the engines it drives: `EngineBackend`.

The poller, the dispatcher and the app call an engine only through this protocol, in the worker
API's typed messages (kvpool.engine.worker.messages); a backend translates them to its engine's
own calls. The conductor sees none of it: it reads the `ClusterView` the live cluster builds
from what the backend reports (`InfoReply` on join, `LoadReply` on each poll).

    kvpool  kvpool's own prefill/decode workers (serve/worker_client.py)
    vllm    unmodified vLLM OpenAI servers (serve/vllm/backend.py)

serve/backends.py builds the one a ProxyConfig names.

Every call raises `WorkerCallError` naming the instance and the call when it fails (a 4xx
status when the request is at fault, none or a 5xx when the instance is), except `abort`,
which is best-effort and never raises. `InvalidArgument` from `info` means the instance
answers but cannot serve this cluster (another model, another block size): it is not
admitted.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from kvpool.conductor import PrefixLookup
from kvpool.engine.config import SamplingParams
from kvpool.engine.worker.messages import (
    FinishLine,
    Frame,
    GenerateRequest,
    InfoReply,
    LoadReply,
    PlainFrame,
    PrefillReply,
    PrefillRequest,
)
from kvpool.serve.ndjson_reply import ReplyReader
from kvpool.serve.worker_stream import LineRelay, StreamPool


@dataclass(frozen=True, slots=True)
class BackendFeatures:
    """What a backend's engines can do; the dispatcher and the app ask here, never by name."""

    migration: bool
    """A decode leg that fails mid-stream can go on elsewhere (`resume_output_ids`)."""
    push: bool
    """The prefill leg can push the KV into the decode instance (--kv-transfer push)."""
    logprobs: bool
    """Output tokens' logprobs."""
    prompt_logprobs: bool
    """Prompt tokens' logprobs (and echo with logprobs)."""
    first_token_from_prefill: bool
    """The prefill leg's token is the request's first output token, and the decode leg
    continues after it (kvpool). False: the decode leg makes every output token itself, the
    first one included, from the KV the prefill leg left (vLLM's P/D protocol), so the client's
    first token is the decode leg's."""
    reports_pool_tokens: bool = True
    """The engine says how many reused prompt tokens came from the pool. False (vLLM: one
    `cached_tokens` for its own cache and its connector's): the proxy attributes to the
    instance's own cache what its events said it held when the request was placed, and the
    rest to the pool."""


class EnginePrefixes(PrefixLookup, Protocol):
    """A backend's own view of its prefill instances' cached prefixes (instance ids as in the
    cluster view), and the note of where each request went."""

    def routed(self, instance_id: int, block_hashes: Sequence[int]) -> None: ...


class FrameRelay(Protocol):
    """A decode leg's reader of plain frames in the connection's read callback, for the
    frames that come while the leg's task waits (kvpool's lean client; the task reads the
    rest: the finish line, anything else, and all frames while `ready` is False)."""

    def ready(self) -> bool:
        """Whether a frame may be taken now."""

    def take(self, frame: PlainFrame) -> bool:
        """One frame (those of one read merged), taken instead of the task's reading it; False
        when it is not taken after all (the task reads it, and the rest of the stream)."""


FramePrefix = Callable[[list[bytes]], tuple[int, PlainFrame | None]]
"""How many of a read's lines, from the first, a relay may take, and their tokens as one frame
(None: no tokens among them)."""


def read_relay(relay: FrameRelay, prefix: FramePrefix, on_lines: Callable[[], None],
               on_taken: Callable[[PlainFrame], None] | None = None) -> LineRelay:
    """A stream's relay in the read callback, for a backend's lean reader: the lines a read
    begins with that `prefix` admits go to `relay` as one frame, while it is ready
    (`on_taken` told of each frame it took). The first line `prefix` does not admit (a finish,
    an error, a line it cannot read), or a frame the relay does not take, and everything
    after it go to the reader, and so does the rest of the stream: what follows is the
    reader's to judge."""
    stopped = False

    def take(reply: ReplyReader) -> bool:
        nonlocal stopped
        if stopped or not relay.ready():
            return False
        lines = reply.lines()
        count, frame = prefix(lines)
        if frame is not None:
            if relay.take(frame):
                if on_taken is not None:
                    on_taken(frame)
                on_lines()
            else:
                count = 0
        if count < len(lines):
            stopped = True
            reply.put_back(lines[count:])
        return not stopped and not reply.done

    return take


class EngineBackend(Protocol):
    """How the proxy drives one kind of engine; `url` names an instance everywhere."""

    name: str
    features: BackendFeatures
    streams: StreamPool
    """The kept-alive connections of its calls on the hot paths (serve/worker_stream.py)."""

    async def prove(self, url: str, timeout_s: float) -> None:
        """Make sure the instance at `url` may be sent requests (kvpool: it proves it holds the
        cluster token; a no-op where there is nothing to prove). Until it has, `proven` is
        False and no other call goes out."""

    def proven(self, url: str) -> bool: ...

    async def info(self, url: str, timeout_s: float) -> InfoReply:
        """The instance's facts for joining: role, model identity, block size, capacity.
        WorkerCallError while it does not answer as this backend's engine; InvalidArgument when
        it answers but serves something else."""

    async def load(self, url: str, path: str, timeout_s: float) -> LoadReply:
        """The instance's load and cache report. `path`: kvpool's `/load` with the cursor of
        the block events already read (`?epoch=&since=`); backends that report no block
        events over HTTP ignore it."""

    def block_hashes(self, prompt_ids: Sequence[int], cache_salt: str | None,
                     reference: InfoReply) -> list[int]:
        """The request's full-block hashes as this backend's engines name their cached blocks
        (what the conductor's prefix index holds); [] where they cannot be known."""

    def prefixes(self, prefill_urls: Sequence[str]) -> EnginePrefixes | None:
        """Where the conductor reads the prefill instances' cached prefixes (`prefill_urls`
        in the cluster view's order), or None: the view's own index, fed by `load`."""

    async def prefill(self, url: str, req: PrefillRequest) -> PrefillReply:
        """The prefill leg; its reply's `kv_transfer_params` (if any) go to the decode leg."""

    async def handoff(self, url: str, request_id: str,
                      block_hashes: Sequence[int]) -> float | None:
        """Hold the decode leg until what the prefill leg on `url` left for it is in place
        (vllm: the blocks of `block_hashes`, the chain `block_hashes` gave the request, landing
        in the pool, which its store connector writes after the reply). The seconds held, or None where there is nothing to wait for (kvpool: the
        prefill's reply promises the KV is in place)."""

    def generate(self, url: str, req: GenerateRequest,
                 relay: FrameRelay | None = None) -> AsyncGenerator[Frame | FinishLine]:
        """The decode (or colocated) leg's frames (each the tokens one engine step made, or
        several steps' with a stream interval), then one finish line. A malformed line, an
        error line or a broken stream raises. `relay`: where the backend may hand plain
        frames in its read callback instead (a backend without one ignores it)."""

    async def abort(self, url: str, request_id: str) -> None:
        """Stop `request_id` on the instance; best-effort, never raises."""

    def unsupported(self, sampling: SamplingParams) -> str | None:
        """The request parameter this backend cannot serve (a 400 names it), or None."""

    def refused_instance(self, url: str) -> str | None:
        """Why `url` cannot join as an instance after start (`/workers/register`; a 400 says
        it), or None."""

    def engine_gauges(self) -> dict[str, dict[str, float]]:
        """Backend-specific gauges for the proxy's /metrics: name -> {instance url: value}
        (rendered as kvpool_proxy_engine_NAME{worker=URL})."""

    async def aclose(self) -> None: ...
