"""Several hosts on one machine: network namespaces joined by veth pairs, and servers run inside them.

The machine itself (the root namespace) is the database and Redis host, and the client. Each
other host is a namespace; every link is a veth pair of its own with a /30 on it, so no
bridge, routing or forwarding is involved: each pair of hosts that talks shares a link.
"""

from __future__ import annotations

import os
import signal
import subprocess
from collections.abc import Mapping, Sequence
from pathlib import Path

import psycopg

from tests.support.nginx import DeployedGunicorn
from tests.support.patroni import PG_BIN, as_account, give_to_account
from tests.support.programs import program
from tests.support.redis_servers import RedisServer
from tests.support.servers import ServerProcess, Service


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


def cut(hosts: Hosts, host: str, peer: str) -> None:
    """Cut `host` off its link to `peer`: `host`'s end goes down, so `peer` sees silence, no RST.

    `peer`'s end keeps its address and route (it only loses carrier): what it sends is dropped,
    as when a host vanishes behind a switch. `host` must be a namespace.
    """
    number = hosts.links.index((host, peer) if (host, peer) in hosts.links else (peer, host))
    side = "a" if hosts.links[number][0] == host else "b"
    tag = os.getpid() % 100_000
    ip("-n", hosts.netns[host], "link", "set", f"pv{tag}x{number}{side}", "down")


class HostPostgres(ServerProcess):
    """A PostgreSQL 15 of its own (initdb in `workdir`) in namespace `netns`, listening on `address`.

    Trusts every client on the test's links (10.0.0.0/8): a throwaway server on a test network.
    """

    name = "postgres"
    ready = "accept connections"
    stop_signal = signal.SIGINT  # fast shutdown

    def __init__(self, workdir: Path, netns: str, address: str) -> None:
        super().__init__(workdir / "postgres.log", start_timeout=60.0, stop_timeout=30.0)
        self.workdir = workdir
        self.netns = netns
        self.address = address

    def url(self, dbname: str = "postgres") -> str:
        """The libpq URL of database `dbname`, across the link."""
        return f"postgresql://postgres@{self.address}:{self.port}/{dbname}"

    def start(self) -> None:
        """initdb, then the postmaster in the namespace; wait until it accepts connections."""
        data = self.workdir / "data"
        give_to_account(self.workdir)
        done = subprocess.run(
            as_account(
                [str(PG_BIN / "initdb"), "-D", str(data), "-U", "postgres", "--auth=trust", "-N"]
            ),
            capture_output=True,
            text=True,
            timeout=120,
        )
        if done.returncode != 0:
            raise RuntimeError(f"initdb: {done.stdout}{done.stderr}")
        with (data / "pg_hba.conf").open("a", encoding="utf-8") as hba:
            hba.write("host all all 10.0.0.0/8 trust\n")
        settings = [f"listen_addresses={self.address}", "unix_socket_directories=", "fsync=off"]
        options = [item for setting in settings for item in ("-c", setting)]
        self.launch(
            as_account([str(PG_BIN / "postgres"), "-D", str(data), "-p", str(self.port), *options])
        )

    def answers(self) -> bool:
        """Whether a connection across the link succeeds."""
        try:
            with psycopg.connect(self.url(), connect_timeout=1):
                return True
        except psycopg.Error:
            return False


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
