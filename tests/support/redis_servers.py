"""The Redis family of the system tests: redis-server, a replica, Sentinel and a cluster node, each
a ServerProcess of the test's own on loopback, and redis-cli's answers read as fields."""

from __future__ import annotations

import signal
import socket
import subprocess
from pathlib import Path

from tests.support.programs import program
from tests.support.servers import (
    LOOPBACK,
    ServerProcess,
    free_port,
)


def loopback_redis_url(port: int, db: int = 0) -> str:
    """The redis:// URL of database `db` of a server on this loopback port."""
    return f"redis://{LOOPBACK}:{port}/{db}"


class RedisServer(ServerProcess):
    """A `redis-server` of the test's own on a free loopback port (no persistence), as a context manager.

    stop() kills it like a crash; start() again brings up an empty one on the same port.
    """

    name = "redis-server"
    ready = "answer PING"
    # A crash: clients see their connections reset.
    stop_signal = signal.SIGKILL
    # A restart appends to the log of the server before.
    log_mode = "ab"
    poll_interval = 0.05

    def __init__(
        self, workdir: Path, *, start_timeout: float = 10.0, stop_timeout: float = 10.0
    ) -> None:
        super().__init__(
            workdir / "redis.log", start_timeout=start_timeout, stop_timeout=stop_timeout
        )
        self.workdir = workdir

    def url(self, db: int = 0) -> str:
        """The redis:// URL of database `db` on this server."""
        return loopback_redis_url(self.port, db)

    def command(self) -> list[str]:
        """The command line: loopback only, no RDB or AOF files, in the foreground."""
        return [
            program("redis-server"),
            "--port",
            str(self.port),
            "--bind",
            LOOPBACK,
            "--save",
            "",
            "--appendonly",
            "no",
            "--daemonize",
            "no",
            "--dir",
            str(self.workdir),
        ]

    def start(self) -> None:
        """Start redis-server and wait (bounded) until it answers PING; raise with its log otherwise."""
        assert self.process is None, "redis-server is running already"
        self.launch(self.command(), cwd=self.workdir)

    def answers(self) -> bool:
        """Whether it answers PING right now."""
        return self.ping()

    def ping(self) -> bool:
        """Whether the server answers PING with PONG right now."""
        try:
            with socket.create_connection((LOOPBACK, self.port), timeout=1) as sock:
                sock.sendall(b"PING\r\n")
                return sock.recv(64).startswith(b"+PONG")
        except OSError:
            return False


def redis_command(port: int, *command: str, timeout: float = 2.0) -> str:
    """`redis-cli -p port command...` against a loopback server; its output (empty on failure)."""
    try:
        done = subprocess.run(
            [program("redis-cli"), "-h", LOOPBACK, "-p", str(port), *command],
            capture_output=True,
            text=True,
            timeout=timeout,
        )
    except subprocess.TimeoutExpired:
        return ""
    return done.stdout if done.returncode == 0 else ""


def redis_fields(text: str) -> dict[str, str]:
    """The `name:value` lines of INFO, or the name/value line pairs of SENTINEL MASTER, as a dict."""
    if ":" in text.split("\n", 1)[0] or text.startswith("#"):
        pairs = (line.split(":", 1) for line in text.splitlines() if ":" in line)
        return {name: value.strip() for name, value in pairs}
    lines = text.splitlines()
    return dict(zip(lines[::2], lines[1::2], strict=False))


class RedisReplica(RedisServer):
    """A `redis-server` replicating the master on `master_port`, as a context manager."""

    name = "redis-server (replica)"

    def __init__(self, workdir: Path, master_port: int, **timeouts: float) -> None:
        super().__init__(workdir, **timeouts)
        self.master_port = master_port

    def command(self) -> list[str]:
        """RedisServer's command line, plus replicaof the master."""
        return [*super().command(), "--replicaof", LOOPBACK, str(self.master_port)]


class RedisSentinel(RedisServer):
    """A `redis-sentinel` watching the master on `master_port` as `service` (quorum 2), as a context manager.

    Fast timings for tests: a master that does not answer for `down_after_ms` is down.
    """

    name = "redis-sentinel"

    def __init__(
        self,
        workdir: Path,
        master_port: int,
        *,
        service: str = "petstore",
        down_after_ms: int = 1000,
        **timeouts: float,
    ) -> None:
        super().__init__(workdir, **timeouts)
        self.log_path = workdir / "sentinel.log"
        self.master_port = master_port
        self.service = service
        self.down_after_ms = down_after_ms

    def command(self) -> list[str]:
        """redis-sentinel with a config file of its own (Sentinel rewrites it)."""
        conf = self.workdir / "sentinel.conf"
        conf.write_text(
            f"port {self.port}\n"
            f"bind {LOOPBACK}\n"
            "daemonize no\n"
            f"dir {self.workdir}\n"
            f"sentinel monitor {self.service} {LOOPBACK} {self.master_port} 2\n"
            f"sentinel down-after-milliseconds {self.service} {self.down_after_ms}\n"
            f"sentinel failover-timeout {self.service} 10000\n"
            f"sentinel parallel-syncs {self.service} 1\n",
            encoding="utf-8",
        )
        return [program("redis-sentinel"), str(conf)]

    def start(self) -> None:
        """Start it and wait (bounded) until it answers PING."""
        assert self.process is None, "redis-sentinel is running already"
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.launch(self.command(), cwd=self.workdir)

    def master(self) -> dict[str, str]:
        """What this sentinel knows of the master (SENTINEL MASTER), empty when it does not answer."""
        return redis_fields(redis_command(self.port, "SENTINEL", "MASTER", self.service))

    def master_port_now(self) -> int | None:
        """The port of the master this sentinel names right now."""
        lines = redis_command(
            self.port, "SENTINEL", "GET-MASTER-ADDR-BY-NAME", self.service
        ).split()
        return int(lines[1]) if len(lines) == 2 else None


class RedisClusterNode(RedisServer):
    """A `redis-server --cluster-enabled yes` on a free loopback port, as a context manager.

    Its cluster bus is on port + 10000, so the port is chosen until that one is free too.
    """

    name = "redis-server (cluster node)"

    def __init__(self, workdir: Path, **timeouts: float) -> None:
        super().__init__(workdir, **timeouts)
        while not self.bus_port_free():
            self.port = free_port()

    def bus_port_free(self) -> bool:
        """Whether port + 10000 is free on loopback."""
        if self.port + 10000 > 65535:
            return False
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                sock.bind((LOOPBACK, self.port + 10000))
            except OSError:
                return False
        return True

    def command(self) -> list[str]:
        """RedisServer's command line, in cluster mode with its node file in the workdir."""
        return [
            *super().command(),
            "--cluster-enabled",
            "yes",
            "--cluster-config-file",
            str(self.workdir / "nodes.conf"),
            "--cluster-node-timeout",
            "2000",
        ]
