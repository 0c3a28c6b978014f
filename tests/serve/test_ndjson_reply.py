"""ReplyReader: an HTTP/1.1 NDJSON reply read from bytes, whole and a byte at a time, under
random splits, and refused when it is not HTTP/1.1."""

from __future__ import annotations

import random

import pytest

from kvpool.serve.ndjson_reply import ReplyError, ReplyReader

LINES = [b'{"type":"token","token_id":%d}' % i for i in range(40)] + [b'{"type":"finish"}']
BODY = b"".join(line + b"\n" for line in LINES)


def chunked(body: bytes, sizes: list[int], trailers: bytes = b"") -> bytes:
    out, at = [b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\nX-A: b:c\r\n\r\n"], 0
    for n in sizes:
        part = body[at:at + n]
        if part:
            out.append(b"%x;ext=1\r\n%s\r\n" % (len(part), part))
        at += n
    if at < len(body):
        out.append(b"%X\r\n%s\r\n" % (len(body) - at, body[at:]))
    out.append(b"0\r\n" + trailers + b"\r\n")
    return b"".join(out)


def read(raw: bytes, cuts: list[int]) -> tuple[ReplyReader, list[bytes]]:
    r, got, at = ReplyReader(), [], 0
    for cut in [*sorted(cuts), len(raw)]:
        r.feed(raw[at:cut])
        got += r.lines()
        at = cut
    return r, got


def test_a_chunked_reply_whole_and_a_byte_at_a_time() -> None:
    raw = chunked(BODY, [7, 100, 1, 33], trailers=b"X-T: 1\r\n")
    for cuts in ([], list(range(1, len(raw)))):
        r, got = read(raw, cuts)
        assert got == LINES and r.done and r.keep_alive
        assert r.status == 200 and r.headers["x-a"] == "b:c"


def test_random_splits_of_random_chunkings_give_the_same_lines() -> None:
    rng = random.Random(7)
    for _ in range(200):
        sizes = [rng.randint(1, 90) for _ in range(rng.randint(0, 30))]
        raw = chunked(BODY, sizes)
        r, got = read(raw, rng.sample(range(1, len(raw)), rng.randint(0, 40)))
        assert got == LINES and r.done


def test_a_content_length_body_and_one_ended_by_the_connection() -> None:
    r, got = read(b"HTTP/1.1 409 Conflict\r\nContent-Length: 11\r\n\r\n{\"e\": \"x\"}\n", [20, 40])
    assert (r.status, got, r.done, r.keep_alive) == (409, [b'{"e": "x"}'], True, True)
    r, got = read(b"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\na\nb", [])
    assert got == [b"a"] and not r.done
    r.end_of_input()
    assert r.lines() == [b"b"] and r.done and not r.keep_alive  # the last line without \n
    r = ReplyReader()
    r.feed(b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nab")
    assert r.body() == b"ab"
    with pytest.raises(ReplyError, match="closed before the reply ended"):
        r.end_of_input()


@pytest.mark.parametrize(("raw", "match"), [
    (b"HTTP/2 200\r\n\r\n", "not an HTTP/1.1 reply: Expected dot"),
    (b"ICY 200 OK\r\n\r\n", "Expected HTTP/"),
    (b"HTTP/1.1 200 OK\r\nno colon\r\n\r\n", "Invalid header token"),
    (b"HTTP/1.1 200 OK\r\nContent-Length: -1\r\n\r\n", "Invalid character in Content-Length"),
    (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n", "Invalid character in chunk size"),
    (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n0x5\r\n", "Invalid character in chunk size"),
    (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nabc\r\n", "Expected LF after chunk data"),
    (b"HTTP/1.1 200 OK\r\nContent-Length: 1\r\n\r\nab", "data after the end"),
    (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\nX", "data after the end"),
    (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n" + b"1" * 2000, "Chunk size overflow"),
    (b"HTTP/1.1 200 OK\r\n" + b"X: y\r\n" * 20000, "head over"),
])
def test_what_is_not_http_is_refused(raw: bytes, match: str) -> None:
    with pytest.raises(ReplyError, match=match):
        ReplyReader().feed(raw)


def test_a_reply_cut_short_and_data_after_the_end() -> None:
    r = ReplyReader()
    r.feed(chunked(BODY, [50])[:120])
    with pytest.raises(ReplyError, match="closed before the reply ended"):
        r.end_of_input()
    r = ReplyReader()
    r.feed(b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n")
    assert r.done and r.lines() == []
    r.feed(b"")
    with pytest.raises(ReplyError, match="data after the end"):
        r.feed(b"x")


def test_a_worker_reply_with_many_chunks_a_read_and_data_after_its_end_in_the_same_read() -> None:
    """A reader behind its worker gets several chunks in one read: every line comes out in
    order; bytes after the terminating chunk in that read are refused, the lines before them
    kept."""
    head = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
    chunks = b"".join(b"%x\r\n%s\r\n" % (len(line) + 1, line + b"\n") for line in LINES)
    r = ReplyReader()
    r.feed(head + chunks[:len(chunks) // 2])
    first = r.lines()
    r.feed(chunks[len(chunks) // 2:])
    assert first + r.lines() == LINES and not r.done
    with pytest.raises(ReplyError, match="data after the end"):
        r.feed(b"0\r\n\r\nHTTP/1.1 200 OK\r\n\r\n")
    assert r.done and r.lines() == []


@pytest.mark.parametrize("raw", [
    # both lengths at once, or two different ones: a request-smuggling shape, refused
    b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\nContent-Length: 5\r\n\r\n",
    b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\nContent-Length: 6\r\n\r\n",
])
def test_ambiguous_lengths_are_refused(raw: bytes) -> None:
    with pytest.raises(ReplyError, match="not an HTTP/1.1 reply"):
        ReplyReader().feed(raw)


@pytest.mark.parametrize(("raw", "keep"), [
    (b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nx\n", True),
    (b"HTTP/1.0 200 OK\r\nContent-Length: 2\r\n\r\nx\n", False),  # 1.0: closes unless asked
    (b"HTTP/1.1 200 OK\r\nConnection: Close, foo\r\nContent-Length: 2\r\n\r\nx\n", False),
    # a trailer is not the head: it cannot take back the head's `Connection: close`
    (b"HTTP/1.1 200 OK\r\nConnection: close\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nx\n\r\n"
     b"0\r\nConnection: keep-alive\r\n\r\n", False),
    # an interim reply (103) before the final one is skipped
    (b"HTTP/1.1 103 Early Hints\r\nLink: x\r\n\r\nHTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nx\n",
     True),
])
def test_whether_the_connection_may_carry_the_next_request(raw: bytes, keep: bool) -> None:
    """A connection goes back to the pool only where the server keeps it open (llhttp's
    verdict at the reply's end), whole or a byte at a time."""
    for cuts in ([], list(range(1, len(raw)))):
        r, got = read(raw, cuts)
        assert (r.status, r.done, got, r.keep_alive) == (200, True, [b"x"], keep)
        assert "link" not in r.headers


def test_a_status_below_100_and_an_upgrade_are_refused() -> None:
    with pytest.raises(ReplyError, match="status 0"):
        ReplyReader().feed(b"HTTP/1.1 000 X\r\n\r\n")
    with pytest.raises(ReplyError, match="an upgrade"):
        ReplyReader().feed(b"HTTP/1.1 101 Switching\r\nUpgrade: x\r\nConnection: upgrade\r\n\r\n")


def test_a_finished_reply_leaves_no_reference_cycle() -> None:
    """The parser (which holds the reader's callbacks) is let go once the reply is done, so the
    reader goes with its last reference, not at the collector's next run."""
    import gc
    import weakref

    gc.disable()
    try:
        reader = ReplyReader()
        reader.feed(b"HTTP/1.1 200 OK\r\nContent-Length: 3\r\n\r\n{}\n")
        assert reader.done and reader.keep_alive and reader.lines() == [b"{}"]
        gone = weakref.ref(reader)
        del reader
        assert gone() is None
    finally:
        gc.enable()
