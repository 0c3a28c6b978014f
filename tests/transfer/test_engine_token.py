"""The engine's token reaches everything it talks to, not only through $KVPOOL_TOKEN, and
never shows up in a repr."""

from __future__ import annotations

import pytest

from kvpool.errors import MetadataError
from kvpool.metadata.server import MetadataServer
from kvpool.store.client.config import ClientConfig
from kvpool.transfer import TransferConfig, TransferEngine
from kvpool.transfer.segment import segment_key

TOKEN = "engine-secret"


def test_the_engine_publishes_with_its_own_token(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVPOOL_TOKEN", "not-this-one")
    with MetadataServer(port=0, token=TOKEN) as server:
        with TransferEngine(TransferConfig(metadata=server.url, token=TOKEN)) as engine:
            assert server.backend.get(segment_key(engine.segment_name)) is not None
            engine.allocate_managed(4096)      # publishes again
            engine.publish()
        with pytest.raises(MetadataError):     # the environment's token is not used
            TransferEngine(TransferConfig(metadata=server.url, token="wrong")).start()
        monkeypatch.setenv("KVPOOL_TOKEN", TOKEN)
        with pytest.raises(MetadataError):     # nor is it for an engine without a token
            TransferEngine(TransferConfig(metadata=server.url, token=None)).start()


def test_tokens_are_not_in_reprs() -> None:
    assert TOKEN not in repr(ClientConfig(master="127.0.0.1:1", token=TOKEN))
    assert TOKEN not in repr(TransferConfig(token=TOKEN))
