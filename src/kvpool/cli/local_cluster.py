"""The store-only cluster `kvpool up --store-only` starts (a master and its store nodes), as
its demo sees it."""

from __future__ import annotations

import subprocess
from dataclasses import dataclass, field

import httpx


@dataclass
class LocalCluster:
    host: str
    rpc_port: int
    admin_port: int
    metadata_port: int
    master: subprocess.Popen[bytes]
    nodes: list[subprocess.Popen[bytes]] = field(default_factory=list)
    token: str | None = None

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
