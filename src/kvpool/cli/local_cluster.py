"""The store-only cluster `kvpool up --store-only` starts (a master and its store nodes), as
its demo sees it."""

from __future__ import annotations

import subprocess
from dataclasses import dataclass, field

import httpx

from kvpool.launch.children import Command
from kvpool.launch.ready import ReadyPipe
from kvpool.launch.table import ChildTable


@dataclass
class LocalCluster(ChildTable):
    host: str
    rpc_port: int
    admin_port: int
    metadata_port: int
    token: str | None = None
    procs: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)
    commands: dict[str, Command] = field(default_factory=dict)
    ready: dict[str, ReadyPipe] = field(default_factory=dict)

    @property
    def master(self) -> subprocess.Popen[bytes]:
        return self.procs["master"]

    @property
    def nodes(self) -> list[subprocess.Popen[bytes]]:
        return [p for name, p in self.procs.items() if name.startswith("store-node-")]

    @property
    def master_address(self) -> str:
        return f"{self.host}:{self.rpc_port}"

    @property
    def metadata_url(self) -> str:
        return f"http://{self.host}:{self.metadata_port}/metadata"

    def admin(self, path: str) -> httpx.Response:
        headers = {"authorization": f"Bearer {self.token}"} if self.token else None
        return httpx.get(f"http://{self.host}:{self.admin_port}{path}", timeout=10,
                         headers=headers)
