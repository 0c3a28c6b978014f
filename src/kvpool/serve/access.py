"""One access-log line per OpenAI request, written when its response has ended (a stream's
last event, or a client gone). Logger `kvpool.serve.access`, at INFO even when the process
logs only warnings (`kvpool proxy --no-access-log` turns it off):

    POST /v1/chat/completions 200 prompt=31 output=16 cached=16 ttft=41ms total=380ms
    POST /v1/completions 429 prompt=12 output=0 cached=0 ttft=- total=2ms rejected_ttft
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from kvpool.log import get_logger

log = get_logger("serve.access")


def enable(on: bool) -> None:
    log.setLevel(logging.INFO if on else logging.WARNING)


@dataclass
class Access:
    method: str
    path: str
    start_s: float
    status: int = 200
    prompt_tokens: int = 0
    output_tokens: int = 0
    cached_tokens: int = 0
    ttft_s: float | None = None
    note: str = ""
    """What went wrong, if anything (an error code, `client gone`)."""
    route: str = ""
    """Where the conductor ran it (serve/route.py), once it was placed."""

    def line(self, now_s: float) -> str:
        ttft = "-" if self.ttft_s is None else f"{self.ttft_s * 1e3:.0f}ms"
        tail = "".join(f" {part}" for part in (self.route, self.note) if part)
        return (f"{self.method} {self.path} {self.status} prompt={self.prompt_tokens} "
                f"output={self.output_tokens} cached={self.cached_tokens} ttft={ttft} "
                f"total={(now_s - self.start_s) * 1e3:.0f}ms{tail}")

    def done(self, now_s: float) -> None:
        log.info("%s", self.line(now_s))
