"""One HTTP/1.1 reply whose body is NDJSON, read from bytes (sans-I/O: no sockets): the status
and headers, then the body's complete lines as they come, chunked or not.

    reader = ReplyReader()
    reader.feed(data)            # any split of the bytes, a byte at a time included
    reader.status, reader.headers  once the head is in (status 0 before)
    reader.lines()               complete body lines since the last call, without b"\\n"
    reader.done                  the body has ended (terminating chunk, Content-Length reached)
    reader.body()                the whole body so far (an error reply's JSON)
    reader.keep_alive            the connection may carry the next request once done

    chunked:  SIZE(hex)[;ext] CRLF  DATA CRLF ... 0 CRLF [trailers CRLF] CRLF

Bytes that are not HTTP/1.1 (a bad status line, a bad chunk size, a chunk without its CRLF,
data after the end) raise `ReplyError`, the remote peer's fault; nothing read is lost from
what `lines()` already returned.
"""

from __future__ import annotations

_HEX = b"0123456789abcdefABCDEF"
MAX_HEAD_BYTES = 64 * 1024
"""A reply head larger than this is refused (a worker's is a few hundred bytes)."""


class ReplyError(ValueError):
    """The peer sent something that is not the HTTP/1.1 reply expected."""


class ReplyReader:
    def __init__(self) -> None:
        self.status = 0
        self.headers: dict[str, str] = {}
        self.done = False
        self._buf = bytearray()
        self._body = bytearray()
        self._chunked = False
        self._left = -1
        """Body bytes still to come: of the current chunk (chunked) or of the body; -1:
        (chunked) a size line is next; (not chunked, no length) until the connection ends."""
        self._trailers = False

    @property
    def keep_alive(self) -> bool:
        delimited = self._chunked or "content-length" in self.headers
        return self.done and delimited and self.headers.get("connection", "").lower() != "close"

    def feed(self, data: bytes) -> None:
        if self.done:
            if data:
                raise ReplyError(f"data after the end of the reply: {bytes(data[:60])!r}")
            return
        self._buf += data
        if not self.status and not self._parse_head():
            return
        if self._chunked:
            self._parse_chunks()
        else:
            self._take_plain()

    def end_of_input(self) -> None:
        """The connection ended: the body ends here if nothing delimits it; ReplyError if the
        reply was cut short."""
        if self.done:
            return
        if self.status and not self._chunked and self._left < 0:
            self.done = True
            return
        raise ReplyError("the connection closed before the reply ended")

    def lines(self) -> list[bytes]:
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

    def _parse_head(self) -> bool:
        end = self._buf.find(b"\r\n\r\n")
        if end < 0:
            if len(self._buf) > MAX_HEAD_BYTES:
                raise ReplyError(f"a reply head over {MAX_HEAD_BYTES} bytes")
            return False
        lines = bytes(self._buf[:end]).decode("latin-1").split("\r\n")
        del self._buf[:end + 4]
        parts = lines[0].split(" ", 2)
        if len(parts) < 2 or not parts[0].startswith("HTTP/1.") or not parts[1].isdigit():
            raise ReplyError(f"not an HTTP/1.x status line: {lines[0][:100]!r}")
        for line in lines[1:]:
            name, sep, value = line.partition(":")
            if not sep:
                raise ReplyError(f"not a header line: {line[:100]!r}")
            self.headers[name.strip().lower()] = value.strip()
        self.status = int(parts[1])
        self._chunked = "chunked" in self.headers.get("transfer-encoding", "").lower()
        if not self._chunked and "content-length" in self.headers:
            length = self.headers["content-length"]
            if not length.isdigit():
                raise ReplyError(f"a bad Content-Length: {length[:40]!r}")
            self._left = int(length)
        return True

    def _take_plain(self) -> None:
        take = len(self._buf) if self._left < 0 else min(self._left, len(self._buf))
        self._body += self._buf[:take]
        del self._buf[:take]
        if self._left >= 0:
            self._left -= take
            if self._left == 0:
                self.done = True
        if self._buf:
            raise ReplyError(f"data after the end of the reply: {bytes(self._buf[:60])!r}")

    def _parse_chunks(self) -> None:
        while not self.done:
            if self._left > 0:
                take = min(self._left, len(self._buf))
                self._body += self._buf[:take]
                del self._buf[:take]
                self._left -= take
                if self._left:
                    return
                self._left = -2  # the CRLF after the data is next
            line_end = self._buf.find(b"\r\n")
            if line_end < 0:
                if len(self._buf) > 1024:
                    raise ReplyError("a chunk size line over 1024 bytes")
                return
            line = bytes(self._buf[:line_end])
            del self._buf[:line_end + 2]
            self._on_line(line)
        if self._buf:
            raise ReplyError(f"data after the end of the reply: {bytes(self._buf[:60])!r}")

    def _on_line(self, line: bytes) -> None:
        """A CRLF-terminated line between chunks: the CRLF after data, a size, a trailer."""
        if self._left == -2:
            if line:
                raise ReplyError(f"a chunk's data runs past its size: {line[:60]!r}")
            self._left = -1
        elif self._trailers:
            self.done = not line
        else:
            digits = line.split(b";", 1)[0].strip()
            if not digits or digits.strip(_HEX) or len(digits) > 16:
                raise ReplyError(f"a bad chunk size line: {line[:60]!r}")
            size = int(digits, 16)
            self._left = size if size else -1
            self._trailers = size == 0
