"""The programs the system tests drive: found where Debian installs them, else the test skips.

Debian puts some of them (nginx, pgbouncer, ip) in /usr/sbin or /sbin, which a normal user's PATH
lacks, so those directories are searched too. A missing program skips its test with one line
naming it and the script that installs it (tests/conftest.py fails every skip under CI, where
`make test` runs as root and has run every .ci/install-* script first).
"""

from __future__ import annotations

import glob
import os
import shutil

import pytest

# Where Debian installs programs beside the PATH of a normal user.
SYSTEM_DIRS = ("/usr/local/sbin", "/usr/sbin", "/sbin", "/usr/local/bin", "/usr/bin", "/bin")
# program -> the script of .ci/ that installs it (with Debian's package manager).
INSTALLERS = {
    "nginx": ".ci/install-nginx",
    "pgbouncer": ".ci/install-pgbouncer",
    "redis-server": ".ci/install-redis-sentinel",
    "redis-sentinel": ".ci/install-redis-sentinel",
    "redis-cli": ".ci/install-redis-sentinel",
    "prometheus": ".ci/install-prometheus",
    "promtool": ".ci/install-prometheus",
    "chromium": ".ci/install-browser",
    "chromedriver": ".ci/install-browser",
    "ip": ".ci/install-iproute2",
    "logrotate": ".ci/install-logrotate",
    "openssl": ".ci/install-nginx",
    "curl": ".ci/install-nginx",
    "patroni": ".ci/install-patroni",
    "patronictl": ".ci/install-patroni",
    "etcd": ".ci/install-patroni",
    "haproxy": ".ci/install-haproxy",
    "libfaketime.so.1": ".ci/install-faketime",
    "systemd-analyze": ".ci/install-systemd",
    "podman": ".ci/install-podman",
    "buildah": ".ci/install-podman",
    "debootstrap": ".ci/install-podman",
}
# Programs that no script of .ci/ installs: the CI machines come with them (Debian's package
# kubectl, from Kubernetes' own package repository); elsewhere, install them from there.
PREINSTALLED = {"kubectl": "https://kubernetes.io/docs/tasks/tools/"}
# Libraries a test preloads, not programs: where Debian installs each.
LIBRARIES = {"libfaketime.so.1": "/usr/lib/*/faketime/libfaketime.so.1"}


def find(name: str) -> str | None:
    """The path of program `name`: on PATH, else in Debian's system directories (a library of
    LIBRARIES where Debian puts it); None if absent."""
    if name in LIBRARIES:
        return next(iter(sorted(glob.glob(LIBRARIES[name]))), None)
    return shutil.which(name) or shutil.which(name, path=os.pathsep.join(SYSTEM_DIRS))


def install_command(name: str) -> str:
    """The command that installs `name` from the checkout, for whoever runs the tests: the script
    as root, through sudo where there is one, else through su (root's password)."""
    script = f"bash {INSTALLERS[name]}"
    if os.geteuid() == 0:
        return script
    if shutil.which("sudo"):
        return f"sudo {script}"
    # A plain Debian has no sudo; su keeps the working directory, the checkout.
    return f"su -c '{script}'"


def missing_line(name: str) -> str:
    """The one line a test skips with when `name` is missing."""
    if name in PREINSTALLED:
        return (
            f"{name} is not installed: CI machines have it; install it as {PREINSTALLED[name]} says"
        )
    return f"{name} is not installed: install it as root with `{install_command(name)}`"


def program(name: str) -> str:
    """The path of program `name`; skips the calling test when it is not installed."""
    found = find(name)
    if found is None:
        pytest.skip(missing_line(name))
    return found


def faketime_library() -> str:
    """The path of Debian's libfaketime.so.1; skips the calling test when it is not installed."""
    return program("libfaketime.so.1")
