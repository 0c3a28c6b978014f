"""nginx as a relay to compare kvpool's proxy against: a minimal configuration that passes every
request on to its upstreams (in turn) over kept-alive connections and relays the reply as it comes
(`proxy_buffering off`: each chunk of a stream is written on as soon as it is read), run as a
child in a folder of its own.

    nginx -p DIR -c DIR/nginx.conf -e DIR/error.log -g 'daemon off;'
      master (the child)  -- worker_processes 1 --> one worker (does the relaying)

`find_nginx()` is None where nginx is not installed (`apt-get install nginx`;
scripts/setup.sh installs it).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from kvpool.bench.proc_cpu import child_pids
from kvpool.errors import KvpoolError
from kvpool.launch.children import die_with_parent, stop
from kvpool.launch.ports import free_port
from kvpool.launch.wait import accepts

INSTALL_HINT = "apt-get install nginx (scripts/setup.sh installs it)"


def find_nginx() -> str | None:
    """The nginx executable (also in /usr/sbin, off a user's PATH), or None."""
    found = shutil.which("nginx")
    if found:
        return found
    return "/usr/sbin/nginx" if os.access("/usr/sbin/nginx", os.X_OK) else None


def nginx_conf(prefix: Path, listen_port: int, upstream_ports: int | Sequence[int],
               host: str = "127.0.0.1") -> str:
    """The configuration: one worker, no access log, every path relayed unbuffered to
    `host:upstream_port` (several: round robin) over HTTP/1.1 kept-alive connections; temp
    files inside `prefix`."""
    ports = [upstream_ports] if isinstance(upstream_ports, int) else list(upstream_ports)
    servers = "\n".join(f"        server {host}:{port};" for port in ports)
    temps = "\n".join(f"    {kind}_temp_path {prefix / kind};"
                      for kind in ("client_body", "proxy", "fastcgi", "uwsgi", "scgi"))
    return f"""worker_processes 1;
pid {prefix / "nginx.pid"};
error_log {prefix / "error.log"} warn;
events {{
    worker_connections 4096;
}}
http {{
    access_log off;
{temps}
    upstream worker {{
{servers}
        keepalive 256;
    }}
    server {{
        listen {host}:{listen_port};
        keepalive_requests 1000000;
        location / {{
            proxy_pass http://worker;
            proxy_http_version 1.1;
            proxy_set_header Connection "";
            proxy_buffering off;
            proxy_request_buffering off;
            proxy_read_timeout 600s;
        }}
    }}
}}
"""


@dataclass(frozen=True)
class RunningNginx:
    port: int
    master_pid: int
    worker_pids: tuple[int, ...]

    @property
    def pids(self) -> list[int]:
        """The master and its workers (the workers relay; the master idles)."""
        return [self.master_pid, *self.worker_pids]


@contextmanager
def running_nginx(exe: str, folder: Path, upstream_ports: int | Sequence[int],
                  host: str = "127.0.0.1") -> Iterator[RunningNginx]:
    """nginx in front of `host:upstream_port(s)`, in `folder`, stopped on exit. KvpoolError with
    its error log if it does not listen within 10 s."""
    folder.mkdir(parents=True, exist_ok=True)
    port = free_port(host)
    conf = folder / "nginx.conf"
    conf.write_text(nginx_conf(folder, port, upstream_ports, host))
    proc = subprocess.Popen([exe, "-p", str(folder), "-c", str(conf), "-e",
                             str(folder / "error.log"), "-g", "daemon off;"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT,
                            preexec_fn=die_with_parent(os.getpid()))
    try:
        workers = _wait_ready(proc, host, port, folder)
        yield RunningNginx(port, proc.pid, tuple(workers))
    finally:
        stop(proc, timeout_s=5.0, sig=15)


def _wait_ready(proc: subprocess.Popen[bytes], host: str, port: int,
                folder: Path) -> list[int]:
    """The worker pids once nginx accepts on `port` and has started its worker."""
    deadline = time.monotonic() + 10.0
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise KvpoolError(f"nginx exited with code {proc.returncode}: {_log_tail(folder)}")
        workers = child_pids(proc.pid)
        if workers and accepts(port, host):
            return workers
        time.sleep(0.05)
    raise KvpoolError(f"nginx did not listen on {host}:{port} within 10 s: {_log_tail(folder)}")


def _log_tail(folder: Path) -> str:
    try:
        return (folder / "error.log").read_text()[-600:].strip() or "(empty error log)"
    except OSError:
        return "(no error log)"
