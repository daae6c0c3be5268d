"""Several hosts on one machine: network namespaces joined by veth pairs, and servers run inside them.

The machine itself (the root namespace) is the database and Redis host, and the client. Each
other host is a namespace; every link is a veth pair of its own with a /30 on it, so no
bridge, routing or forwarding is involved: each pair of hosts that talks shares a link.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Mapping, Sequence
from pathlib import Path

from tests.support.nginx import DeployedGunicorn
from tests.support.programs import program
from tests.support.servers import RedisServer, Service


def ip(*args: str) -> None:
    """Run `ip args...`; raise with its output when it fails."""
    done = subprocess.run([program("ip"), *args], capture_output=True, text=True, timeout=30)
    if done.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {done.stderr.strip()}")


class Hosts(Service):
    """Namespaces named `names`, and links between pairs of them ("" is the machine itself).

    address(a, b) is a's address on its link to b. stop() deletes every namespace (which takes
    its end of each link, and so the pair) even when start() failed half-way.
    """

    def __init__(self, names: Sequence[str], links: Sequence[tuple[str, str]]) -> None:
        # Unique per test process: namespaces, interface names (15 characters at most), subnet.
        tag = os.getpid() % 100_000
        self.netns = {name: f"ps{tag}-{name}" for name in names}
        self.links = list(links)
        self.second_octet = 100 + tag % 100
        self.made: list[str] = []

    def address(self, host: str, peer: str) -> str:
        """The address of `host` on its link to `peer`."""
        for number, pair in enumerate(self.links):
            if (host, peer) == pair:
                return f"10.{self.second_octet}.{number}.1"
            if (peer, host) == pair:
                return f"10.{self.second_octet}.{number}.2"
        raise KeyError((host, peer))

    def start(self) -> None:
        """Make the namespaces (with loopback up) and the links, each end addressed and up."""
        for name in self.netns.values():
            ip("netns", "add", name)
            self.made.append(name)
            ip("-n", name, "link", "set", "lo", "up")
        tag = os.getpid() % 100_000
        for number, (left, right) in enumerate(self.links):
            ends = [(left, f"pv{tag}x{number}a"), (right, f"pv{tag}x{number}b")]
            ip("link", "add", ends[0][1], "type", "veth", "peer", "name", ends[1][1])
            for index, (host, device) in enumerate(ends):
                address = f"10.{self.second_octet}.{number}.{index + 1}/30"
                if host:
                    ip("link", "set", device, "netns", self.netns[host])
                    ip("-n", self.netns[host], "addr", "add", address, "dev", device)
                    ip("-n", self.netns[host], "link", "set", device, "up")
                else:
                    ip("addr", "add", address, "dev", device)
                    ip("link", "set", device, "up")

    def stop(self) -> None:
        """Delete every namespace made, and any link end left on the machine; idempotent."""
        tag = os.getpid() % 100_000
        for number, _pair in enumerate(self.links):
            for side in "ab":
                subprocess.run(
                    [program("ip"), "link", "del", f"pv{tag}x{number}{side}"],
                    capture_output=True,
                    timeout=30,
                )
        while self.made:
            subprocess.run(
                [program("ip"), "netns", "del", self.made.pop()], capture_output=True, timeout=30
            )


class HostGunicorn(DeployedGunicorn):
    """The shipped gunicorn config on another host: in namespace `netns`, bound to `addresses`.

    The first address is where nginx reaches it, the second where the test (the machine) does.
    """

    def __init__(
        self,
        environ: Mapping[str, str],
        log_path: Path,
        netns: str,
        addresses: Sequence[str],
        *,
        workers: int = 2,
        threads: int = 4,
    ) -> None:
        super().__init__(environ, log_path, workers=workers, threads=threads)
        self.netns = netns
        self.environ["BIND"] = ",".join(f"{address}:{self.port}" for address in addresses)
        self.address = f"{addresses[0]}:{self.port}"
        self.health_host = addresses[-1]
        self.url = f"http://{self.health_host}:{self.port}"


class SharedRedis(RedisServer):
    """A redis-server on loopback and on `also_bind` (the machine's end of each host's link)."""

    def __init__(self, workdir: Path, also_bind: Sequence[str]) -> None:
        super().__init__(workdir)
        self.also_bind = list(also_bind)

    def command(self) -> list[str]:
        """RedisServer's command line, listening on the links too (no password: a test network)."""
        command = super().command()
        at = command.index("--bind")
        return [
            *command[: at + 2],
            *self.also_bind,
            *command[at + 2 :],
            "--protected-mode",
            "no",
        ]

    def url_at(self, host: str, db: int = 0) -> str:
        """The redis:// URL of database `db` at `host`."""
        return f"redis://{host}:{self.port}/{db}"
