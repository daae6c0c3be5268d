"""The service's image (`make image`) and containers of it under podman, on the host's network, always removed."""

from __future__ import annotations

import itertools
import os
import subprocess
import time
from collections.abc import Mapping, Sequence

from tests.support.programs import program
from tests.support.servers import LOOPBACK, ROOT, ServerFailed, Service, free_port, poll_until

# What podman needs on this machine (docs/deploying.rst, "In a container"): runc, as crun
# refuses its hybrid cgroups; rlimits no higher than it may set; the host's network, where the
# container reaches PostgreSQL and Redis on loopback and serves on a loopback port.
RUN_FLAGS = [
    "--runtime",
    "runc",
    "--ulimit",
    "nofile=1024:1024",
    "--ulimit",
    "nproc=1024:1024",
    "--network",
    "host",
]
IMAGE = "localhost/petstore"
# The image's user, as deploy/image/build.sh makes it.
UID = 10001
_names = itertools.count()


def podman(
    *args: str, timeout: float = 120.0, stdin: str | None = None
) -> subprocess.CompletedProcess[str]:
    """`podman ARGS`, its output captured; bounded."""
    return subprocess.run(
        [program("podman"), *args],
        input=stdin,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def git_commit(*options: str) -> str:
    """The checkout's commit HEAD, as `git rev-parse` gives it with these options."""
    return subprocess.run(
        ["git", "rev-parse", *options, "HEAD"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
        timeout=30,
    ).stdout.strip()


def commit_image() -> str:
    """The name of the image of the checkout's commit, built by `make image` unless it exists.

    The image is built from the commit (`git archive HEAD`), so its tag names everything in it.
    """
    program("buildah")
    program("debootstrap")
    name = f"{IMAGE}:{git_commit('--short')}"
    if podman("image", "exists", name).returncode != 0:
        built = subprocess.run(
            ["make", "image"], cwd=ROOT, capture_output=True, text=True, timeout=900
        )
        assert built.returncode == 0, f"make image failed:\n{built.stdout}\n{built.stderr}"
    return name


def unique_name(purpose: str) -> str:
    """A container name no other test run on this machine uses."""
    return f"petstore-test-{os.getpid()}-{next(_names)}-{purpose}"


def run_once(
    image: str,
    *command: str,
    environ: Mapping[str, str] | None = None,
    flags: Sequence[str] = (),
    timeout: float = 120.0,
) -> subprocess.CompletedProcess[str]:
    """`podman run` of `command` in `image` with these settings, to its end; the container removed."""
    name = unique_name("once")
    settings = [f"--env={key}={value}" for key, value in (environ or {}).items()]
    try:
        return podman(
            "run",
            "--rm",
            "--name",
            name,
            *RUN_FLAGS,
            *settings,
            *flags,
            image,
            *command,
            timeout=timeout,
        )
    finally:
        podman("rm", "--force", "--ignore", "--time", "0", name)


class Container(Service):
    """The image's own command (gunicorn) in a detached container on a free loopback port.

    start() waits (bounded) until /healthz answers; stop() is `podman stop` (the image's stop
    signal, SIGTERM, then SIGKILL after `stop_timeout`), and the container is removed however
    the test ends; `exit_code` is what the container ended with.
    """

    def __init__(
        self,
        image: str,
        environ: Mapping[str, str],
        *,
        flags: Sequence[str] = (),
        start_timeout: float = 60.0,
        stop_timeout: float = 30.0,
    ) -> None:
        self.image = image
        self.port = free_port()
        self.url = f"http://{LOOPBACK}:{self.port}"
        self.environ = {**environ, "BIND": f"{LOOPBACK}:{self.port}"}
        self.flags = list(flags)
        self.start_timeout = start_timeout
        self.stop_timeout = stop_timeout
        self.name = unique_name("serve")
        self.exit_code: int | None = None
        self.logs = ""

    def start(self) -> None:
        settings = [f"--env={key}={value}" for key, value in self.environ.items()]
        started = podman(
            "run", "--detach", "--name", self.name, *RUN_FLAGS, *settings, *self.flags, self.image
        )
        if started.returncode != 0:
            raise ServerFailed(f"podman run failed: {started.stderr}")
        deadline = time.monotonic() + self.start_timeout
        while not self.answers():
            if not self.running():
                raise ServerFailed(f"the container exited early; its log:\n{self.log()}")
            if time.monotonic() > deadline:
                raise ServerFailed(f"no answer within {self.start_timeout} s:\n{self.log()}")
            time.sleep(0.2)

    def answers(self) -> bool:
        """Whether GET /healthz answers 200 right now."""
        from tests.support.checks import call

        try:
            return call(self.url, "GET", "/healthz", timeout=2).status == 200
        except OSError:
            return False

    def running(self) -> bool:
        return self.inspect("{{.State.Running}}") == "true"

    def inspect(self, template: str) -> str:
        """A field of `podman inspect` of the container."""
        return podman("inspect", "--format", template, self.name).stdout.strip()

    def exec(self, *command: str) -> subprocess.CompletedProcess[str]:
        """`command` run beside gunicorn in the running container."""
        return podman("exec", self.name, *command)

    def log(self) -> str:
        """Its output (stdout and stderr), the last lines."""
        done = podman("logs", "--tail", "40", self.name)
        return done.stdout + done.stderr

    def signal_stop(self) -> subprocess.Popen[str]:
        """`podman stop` in the background: the stop signal now; wait() on it ends with the container."""
        return subprocess.Popen(
            [program("podman"), "stop", "--time", str(int(self.stop_timeout)), self.name],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )

    def stop(self) -> None:
        """Stop it (if it runs), keep its exit code and log, and remove it; idempotent."""
        exists = podman("container", "exists", self.name).returncode == 0
        if exists:
            self.signal_stop().communicate(timeout=self.stop_timeout + 30)
            code = poll_until(
                lambda: self.inspect("{{.State.ExitCode}} {{.State.Running}}"),
                lambda value: value.endswith("false"),
                within=10.0,
            )
            self.exit_code = int(code.split()[0])
            done = podman("logs", self.name)
            self.logs = done.stdout + done.stderr
        podman("rm", "--force", "--ignore", "--time", "0", self.name)
