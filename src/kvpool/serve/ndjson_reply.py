"""One HTTP/1.1 reply whose body is NDJSON, read from bytes (sans-I/O: no sockets): the status
and headers, then the body's complete lines as they come, chunked or not.

    reader = ReplyReader()
    reader.feed(data)            # any split of the bytes, a byte at a time included
    reader.status, reader.headers  once the head is in (status 0 before)
    reader.lines()               complete body lines since the last call, without b"\\n"
    reader.put_back(lines)       the last call's lines from the first not taken: the next
                                 call returns them first
    reader.done                  the body has ended (terminating chunk, Content-Length reached)
    reader.body()                the whole body so far (an error reply's JSON)
    reader.keep_alive            the connection may carry the next request once done (llhttp:
                                 HTTP/1.1 or a 1.0 keep-alive, no `Connection: close`)

    chunked:  SIZE(hex)[;ext] CRLF  DATA CRLF ... 0 CRLF [trailers CRLF] CRLF

The bytes are parsed by llhttp (through `httptools`, the parser uvicorn serves with): a
reader behind its worker gets several chunks a read, and parsing each in Python was about 2 us
a chunk against 0.3. Bytes that are not HTTP/1.1 (a bad status line, a bad chunk size, a chunk
without its CRLF, data after the end) raise `ReplyError`, the remote peer's fault, with
llhttp's reason; nothing read is lost from what `lines()` already returned.
"""

from __future__ import annotations

import httptools

MAX_HEAD_BYTES = 64 * 1024
"""A reply head larger than this is refused (a worker's is a few hundred bytes)."""


class ReplyError(ValueError):
    """The peer sent something that is not the HTTP/1.1 reply expected."""


class ReplyReader:
    def __init__(self) -> None:
        self.status = 0
        self.headers: dict[str, str] = {}
        self.done = False
        self._body = bytearray()
        self._back: list[bytes] = []
        """Lines `lines()` returned and the caller gave back (`put_back`): returned first."""
        self._head_bytes = 0
        """Bytes fed before the head was complete."""
        self._interim = False
        """The head just read was a 1xx reply's: the final reply follows it."""
        self._keep = False
        """llhttp's verdict at the reply's end: the connection may carry another (HTTP/1.1 or
        a 1.0 keep-alive, no `Connection: close` among its tokens, the body delimited). Read
        when the reply completes: llhttp resets it for the next one."""
        self._parser: httptools.HttpResponseParser | None = httptools.HttpResponseParser(self)
        """None once the reply is done (`on_message_complete`)."""

    @property
    def pending_bytes(self) -> int:
        """Body bytes fed that `lines()` has not returned yet."""
        return len(self._body)

    @property
    def keep_alive(self) -> bool:
        return self.done and self._keep

    @property
    def _until_eof(self) -> bool:
        """The body ends with the connection: not chunked (the last transfer coding, as llhttp
        reads it), and another transfer coding or no Content-Length."""
        te = self.headers.get("transfer-encoding")
        if te is not None:
            return te.rsplit(",", 1)[-1].strip().lower() != "chunked"
        return "content-length" not in self.headers

    def feed(self, data: bytes) -> None:
        if self.done:
            if data:
                raise ReplyError(f"data after the end of the reply: {bytes(data[:60])!r}")
            return
        parser = self._parser
        assert parser is not None, "dropped only once the reply is done"
        try:
            parser.feed_data(data)
        except httptools.HttpParserError as exc:
            if self.done:  # the parser went on to read the rest as the next reply
                raise ReplyError(f"data after the end of the reply: {bytes(data[-60:])!r}") \
                    from None
            raise ReplyError(f"not an HTTP/1.1 reply: {_reason(exc)}") from None
        except httptools.HttpParserUpgrade:
            raise ReplyError("not an HTTP/1.1 reply: an upgrade") from None
        if not self.status:
            self._head_bytes += len(data)
            if self._head_bytes > MAX_HEAD_BYTES:
                raise ReplyError(f"a reply head over {MAX_HEAD_BYTES} bytes")

    def end_of_input(self) -> None:
        """The connection ended: the body ends here if nothing delimits it; ReplyError if the
        reply was cut short."""
        if self.done:
            return
        if self.status and self._until_eof:
            self.done = True
            return
        raise ReplyError("the connection closed before the reply ended")

    def lines(self) -> list[bytes]:
        back = self._back
        if back:
            self._back = []
            return back + self._new_lines()
        return self._new_lines()

    def put_back(self, lines: list[bytes]) -> None:
        """Give back the tail of what the last `lines()` returned (the caller took the lines
        before it): the next `lines()` returns them first, in order."""
        self._back = lines + self._back

    def _new_lines(self) -> list[bytes]:
        end = self._body.rfind(b"\n")
        if end < 0:
            if not (self.done and self._body):
                return []
            end = len(self._body)  # a last line without its newline
        block = bytes(self._body[:end])
        del self._body[:end + 1]  # a long stream's lines are not kept
        return [line for line in block.split(b"\n") if line.strip()]

    def body(self) -> bytes:
        """The body read so far, less the lines `lines()` returned."""
        return bytes(self._body)

    # -- the parser's callbacks ------------------------------------------------------------

    def on_header(self, name: bytes, value: bytes) -> None:
        if self.status:  # a chunked body's trailer: not the reply's head
            return
        self.headers[name.decode("latin-1").strip().lower()] = value.decode("latin-1").strip()

    def on_headers_complete(self) -> None:
        assert self._parser is not None  # it is calling
        code = self._parser.get_status_code()
        if code < 100:
            raise ReplyError(f"status {code}")
        if code < 200:  # 1xx (101 is refused as an upgrade): the final reply follows
            self._interim = True
            self.headers = {}
            return
        self.status = code

    def on_body(self, body: bytes) -> None:
        self._body += body

    def on_message_complete(self) -> None:
        if self._interim:
            self._interim = False
            return
        assert self._parser is not None  # it is calling
        self._keep = self._parser.should_keep_alive()
        self.done = True
        self._parser = None  # it holds this reader's callbacks: letting it go leaves no
        # reference cycle per reply for the garbage collector to find (the parser that calls
        # this is held by its own call until it returns)

    def on_message_begin(self) -> None:
        if self.done:
            raise ReplyError("data after the end of the reply")


def _reason(exc: Exception) -> str:
    """llhttp's reason for refusing the bytes (its cause, for a callback's error)."""
    return str(exc.__context__ or exc)
