"""Two network namespaces joined by one veth pair, for partition tests.

    netns A (master, client, node A)              netns B (node B)
    lo + veth "kvpa" 10.231.7.1/30  <-- veth -->  lo + veth "kvpb" 10.231.7.2/30

The 10.231.7.0/30 addresses exist only inside these two namespaces. `cut()` takes the link
down on A's side (packets to B have no route; B's heartbeats go nowhere), `heal()` brings it
back. Needs root (`ip netns add`); `NetnsPair.create` raises PermissionError otherwise.
"""

from __future__ import annotations

import os
import subprocess
from dataclasses import dataclass

ADDR_A, ADDR_B = "10.231.7.1", "10.231.7.2"


def ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=20)


@dataclass
class NetnsPair:
    a: str
    b: str

    @classmethod
    def create(cls) -> NetnsPair:
        tag = os.getpid() % 100000
        pair = cls(f"kvp-a{tag}", f"kvp-b{tag}")
        try:
            ip("netns", "add", pair.a)
        except (subprocess.CalledProcessError, FileNotFoundError) as exc:
            raise PermissionError(f"ip netns add failed (not root?): {exc}") from exc
        try:
            ip("netns", "add", pair.b)
            ip("-n", pair.a, "link", "add", "kvpa", "type", "veth", "peer", "name", "kvpb",
               "netns", pair.b)
            for ns, dev, addr in ((pair.a, "kvpa", ADDR_A), (pair.b, "kvpb", ADDR_B)):
                ip("-n", ns, "link", "set", "lo", "up")
                ip("-n", ns, "addr", "add", f"{addr}/30", "dev", dev)
                ip("-n", ns, "link", "set", dev, "up")
        except BaseException:
            pair.delete()
            raise
        return pair

    def cmd(self, ns: str, *argv: str) -> list[str]:
        return ["ip", "netns", "exec", ns, *argv]

    def cut(self) -> None:
        ip("-n", self.a, "link", "set", "kvpa", "down")

    def heal(self) -> None:
        ip("-n", self.a, "link", "set", "kvpa", "up")

    def delete(self) -> None:
        for ns in (self.a, self.b):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=20)
