"""deploy/petstore.service (issue 36 §2): systemd's own checks of the file, and its ExecStart run
as the unit runs it, without systemd as PID 1.

systemd-analyze verifies the file in a throwaway root (it wants the commands the unit names to
exist) and scores its sandbox. The service test plays the service manager: it reads the unit,
gives the service the environment systemd would (Environment=, then EnvironmentFile=, then
NOTIFY_SOCKET), runs ExecStart in an emulation of the unit's sandbox (tests/support/systemd.py:
a mount namespace for ProtectSystem=strict, ReadWritePaths=, PrivateTmp=, ProtectHome=,
PrivateDevices=, ProtectProc= and ProcSubset=; the user, no capabilities, NoNewPrivileges=,
UMask=; seccomp filters for SystemCallFilter=, RestrictAddressFamilies=,
MemoryDenyWriteExecute= and RestrictNamespaces=), reads sd_notify's messages as systemd does, and
follows the main process the way Type=notify with NotifyAccess=all does. The unit's paths hold
the test's releases: /opt/petstore/releases/<release> with a venv of Debian's python3 (this
checkout installed by pip) and gunicorn.conf.py, `current` linking to one, /var/lib/petstore the
state directory.
"""

from __future__ import annotations

import ctypes
import errno
import json
import os
import pwd
import re
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from petstore import config, db, keys, migrations
from tests.support.checks import call
from tests.support.databases import empty_database
from tests.support.load import MixedLoad
from tests.support.programs import program
from tests.support.releases import copy_checkout, point, read_pid
from tests.support.servers import LOOPBACK, ROOT, alive, free_port, log_tail
from tests.support.systemd import (
    SERVICE_PATH,
    NotifySocket,
    Sandbox,
    UnitFile,
    allowed_syscalls,
)

UNIT = ROOT / "deploy" / "petstore.service"
HOME = Path("/opt/petstore")
STATE = Path("/var/lib/petstore")
# The interpreter a release's venv is made with on a Debian host (not under /root or /home,
# which ProtectHome= hides).
DEBIAN_PYTHON = Path("/usr/bin/python3")
NEW_VERSION = "1.1.0.post1"
PR_SET_CHILD_SUBREAPER = 36

# The unit's [Service] settings, each emulated by tests/support/systemd.py (with the value the
# emulation assumes), or not, for the reason given.
EMULATED = {
    "ExecStart": None,
    "ExecReload": None,
    "User": "petstore",
    "Group": "petstore",
    "EnvironmentFile": "/etc/petstore.env",
    "Environment": None,
    "WorkingDirectory": str(HOME / "current"),
    "UMask": None,
    "ProtectSystem": "strict",
    # The emulation's namespace is one of its own, its mounts private.
    "PrivateMounts": "yes",
    "ReadWritePaths": str(STATE),
    "PrivateTmp": "yes",
    "ProtectHome": "yes",
    "PrivateDevices": "yes",
    "ProtectProc": "invisible",
    "ProcSubset": "pid",
    # /sys and everything else read-only; /proc/sys absent (subset=pid).
    "ProtectKernelTunables": "yes",
    "ProtectControlGroups": "yes",
    "NoNewPrivileges": "yes",
    "CapabilityBoundingSet": "",
    "MemoryDenyWriteExecute": "yes",
    "RestrictNamespaces": "yes",
    "RestrictAddressFamilies": None,
    "SystemCallFilter": None,
    "SystemCallErrorNumber": None,
    # libseccomp's filters take the native architecture only, as the setting does.
    "SystemCallArchitectures": "native",
    # The service manager's part, played by the test.
    "Type": "notify",
    "NotifyAccess": "all",
}
NOT_EMULATED = {
    # What the service manager does around the service, not inside it; said in the docs.
    "Restart",
    "RestartSec",
    "TimeoutStopSec",
    # A user namespace mapping only root and the service's user: the service reads its files
    # by their "other" bits either way (root-owned code, world-readable) and owns its state.
    "PrivateUsers",
    # The service uses no System V IPC or POSIX message queues (PrivateIPC, RemoveIPC), sets no
    # hostname or clock (their system calls are outside the filter's ~@privileged anyway),
    # loads no module, reads no kernel log (/dev/kmsg and /proc/kmsg are absent in the
    # emulation), opens no device beyond /dev's pseudo-devices, makes no set-uid file, asks no
    # real-time scheduling (sched_setscheduler is in ~@resources) and changes no personality.
    "PrivateIPC",
    "RemoveIPC",
    "ProtectHostname",
    "ProtectClock",
    "ProtectKernelModules",
    "ProtectKernelLogs",
    "DevicePolicy",
    "RestrictSUIDSGID",
    "RestrictRealtime",
    "LockPersonality",
}


def analyze(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [program("systemd-analyze"), *args], capture_output=True, text=True, timeout=60
    )


def test_systemd_verifies_the_unit(tmp_path: Path) -> None:
    """`systemd-analyze verify` says nothing, in a root holding systemd's own units and the
    commands the unit names (it checks that they are executable)."""
    unit = UnitFile(UNIT)
    root = tmp_path / "root"
    (root / "usr/lib/systemd").mkdir(parents=True)
    subprocess.run(
        ["cp", "-a", "/usr/lib/systemd/system", str(root / "usr/lib/systemd/")], check=True
    )
    for key in ("ExecStart", "ExecReload"):
        command = root / unit.command(key)[0].lstrip("/")
        command.parent.mkdir(parents=True, exist_ok=True)
        command.write_text("#!/bin/sh\n", encoding="utf-8")
        command.chmod(0o755)
    installed = root / "etc/systemd/system/petstore.service"
    installed.parent.mkdir(parents=True)
    installed.write_bytes(UNIT.read_bytes())

    verified = analyze("verify", f"--root={root}", "/etc/systemd/system/petstore.service")

    assert (verified.returncode, verified.stdout + verified.stderr) == (0, "")
    # The same check finds a mistake: a misspelt key, a command that is missing.
    installed.write_text(UNIT.read_text().replace("PrivateTmp=", "PrivateTemp="))
    (root / unit.command("ExecStart")[0].lstrip("/")).unlink()
    broken = analyze("verify", f"--root={root}", "/etc/systemd/system/petstore.service")
    assert "Unknown key 'PrivateTemp'" in broken.stderr
    assert "is not executable" in broken.stderr


def test_the_units_exposure_is_at_most_2() -> None:
    """`systemd-analyze security --offline=yes`: the overall exposure, out of 10."""
    scored = analyze("security", "--offline=yes", "--threshold=20", str(UNIT))
    line = scored.stdout.strip().splitlines()[-1]
    print(f"\n{line}")
    found = re.search(r"Overall exposure level for petstore.service: (\d+\.\d)", line)
    assert found, scored.stdout + scored.stderr
    assert float(found.group(1)) <= 2.0
    # --threshold=20 (2.0) agrees.
    assert scored.returncode == 0, scored.stderr


def test_every_setting_of_the_unit_is_emulated_or_reasoned() -> None:
    """A setting added to the unit is either emulated by the service test below or has its
    reason in NOT_EMULATED; an emulated one has the value the emulation assumes."""
    unit = UnitFile(UNIT)
    assert sorted(unit.keys() - EMULATED.keys() - NOT_EMULATED) == []
    assumed = {key: value for key, value in EMULATED.items() if value is not None}
    assert {key: unit.value(key) for key in assumed} == assumed


def make_release(home: Path, name: str, venv: Path, version: str | None = None) -> Path:
    """releases/<name>: a copy of `venv`, its gunicorn script naming its interpreter by the
    path it has on the host, and deploy/gunicorn.conf.py. With `version`, the release says that
    version (a dist-info first on gunicorn's sys.path, its working directory)."""
    release = home / "releases" / name
    shutil.copytree(venv, release / "venv", symlinks=True)
    script = release / "venv" / "bin" / "gunicorn"
    script.write_text(
        f"#!{HOME / 'releases' / name / 'venv/bin/python'}\n"
        "import sys\nfrom gunicorn.app.wsgiapp import run\nsys.exit(run())\n",
        encoding="utf-8",
    )
    (release / "gunicorn.conf.py").write_bytes((ROOT / "deploy" / "gunicorn.conf.py").read_bytes())
    if version is not None:
        info = release / f"petstore-{version}.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(
            f"Metadata-Version: 2.1\nName: petstore\nVersion: {version}\n", encoding="utf-8"
        )
    return release


def status_fields(pid: int) -> dict[str, str]:
    """/proc/<pid>/status as a dict."""
    lines = Path(f"/proc/{pid}/status").read_text().splitlines()
    return {k: v.strip() for k, _, v in (line.partition(":") for line in lines)}


def children(pid: int) -> list[int]:
    try:
        return [int(p) for p in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except FileNotFoundError:
        return []


def version(url: str) -> str | None:
    try:
        answer = call(url, "GET", "/healthz", timeout=5)
    except OSError:
        return None
    return str(answer.body["version"]) if answer.status == 200 else None


class Manager:
    """The service manager's part: the notify socket, and the main process as Type=notify with
    NotifyAccess=all follows it (READY=1 and MAINPID= from any process of the unit)."""

    def __init__(self, log: Path) -> None:
        # The service's output (the journal's stand-in), for the failures.
        self.log = log
        self.notify = NotifySocket()
        self.main_pid = 0
        self.ready_from: list[int] = []
        self.messages: list[tuple[int, dict[str, str]]] = []

    def read(self, within: float) -> None:
        """Take the messages that come within `within` s of each other."""
        for sender, fields in self.notify.receive(within):
            self.messages.append((sender, fields))
            if fields.get("READY") == "1":
                self.ready_from.append(sender)
            if "MAINPID" in fields and alive(int(fields["MAINPID"])):
                self.main_pid = int(fields["MAINPID"])

    def wait(self, condition: Callable[[], bool], within: float, what: str) -> None:
        deadline = time.monotonic() + within
        while not condition():
            assert time.monotonic() < deadline, (
                f"not within {within} s: {what}; notified: {self.messages}; log:\n"
                f"{log_tail(self.log)}"
            )
            self.read(0.1)


@contextmanager
def reaper() -> Iterator[None]:
    """This process reaps its orphaned descendants, as PID 1 does: the master USR2 started,
    once its parent is gone (so that its exit status can be read)."""
    libc = ctypes.CDLL(None, use_errno=True)
    assert libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0
    try:
        yield
    finally:
        libc.prctl(PR_SET_CHILD_SUBREAPER, 0, 0, 0, 0)


@pytest.fixture(scope="module")
def release_venv(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A venv of Debian's python3 with this checkout installed by pip, as a release's is made."""
    if os.geteuid() != 0:
        pytest.skip("the sandbox's emulation needs root (a mount namespace, another user)")
    if not DEBIAN_PYTHON.exists():
        pytest.skip(
            f"{DEBIAN_PYTHON} is not installed: install it as root with `bash .ci/install-systemd`"
        )
    source = tmp_path_factory.mktemp("source")
    copy_checkout(source)
    venv = tmp_path_factory.mktemp("release") / "venv"
    subprocess.run([str(DEBIAN_PYTHON), "-m", "venv", str(venv)], check=True, timeout=120)
    subprocess.run(
        [
            str(venv / "bin" / "pip"),
            "install",
            "--quiet",
            "--disable-pip-version-check",
            str(source),
        ],
        check=True,
        timeout=600,
    )
    return venv


@pytest.fixture
def host(tmp_path: Path, release_venv: Path) -> Path:
    """The test's stand-ins for /opt/petstore (releases, `current`) and /var/lib/petstore."""
    program("systemd-analyze")
    tmp_path.chmod(0o755)
    (tmp_path / "opt").mkdir(mode=0o755)
    make_release(tmp_path / "opt", "1.1.0", release_venv)
    (tmp_path / "opt" / "current").symlink_to("releases/1.1.0")
    state = tmp_path / "state"
    state.mkdir(mode=0o750)
    nobody = pwd.getpwnam("nobody")
    os.chown(state, nobody.pw_uid, nobody.pw_gid)
    return tmp_path


def sandbox_of(unit: UnitFile, host: Path, command: list[str], environ: dict[str, str]) -> Sandbox:
    """The unit's sandbox for `command`, as nobody (the unit's User= and Group= on a host), with
    the host fixture's directories at the unit's paths."""
    nobody = pwd.getpwnam("nobody")
    return Sandbox(
        command=command,
        environ=environ,
        cwd=unit.value("WorkingDirectory"),
        uid=nobody.pw_uid,
        gid=nobody.pw_gid,
        umask=int(unit.value("UMask"), 8),
        binds={str(HOME): str(host / "opt"), str(STATE): str(host / "state")},
        writable=unit.value("ReadWritePaths").split(),
        syscalls=sorted(allowed_syscalls(unit)),
        address_families=[
            getattr(socket, name) for name in unit.value("RestrictAddressFamilies").split()
        ],
        errno_number=getattr(errno, unit.value("SystemCallErrorNumber")),
    )


# Run in the sandbox by Debian's python3: what each forbidden (and some allowed) act gives.
PROBE = r"""
import ctypes, json, mmap, os, socket

def attempt(act):
    try:
        act()
        return "ok"
    except OSError as exc:
        return os.strerror(exc.errno)

def unshare():
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.unshare(0x10000000) != 0:  # CLONE_NEWUSER
        raise OSError(ctypes.get_errno(), "unshare")

def write(path):
    with open(path, "w") as file:
        file.write("x")

print(json.dumps({
    "write and execute memory": attempt(lambda: mmap.mmap(-1, 4096, prot=7)),
    "read and execute memory": attempt(lambda: mmap.mmap(-1, 4096, prot=5)),
    "netlink socket": attempt(lambda: socket.socket(socket.AF_NETLINK, socket.SOCK_RAW).close()),
    "TCP socket": attempt(lambda: socket.socket(socket.AF_INET6).close()),
    "user namespace": attempt(unshare),
    "lower priority": attempt(lambda: os.setpriority(os.PRIO_PROCESS, 0, 5)),
    "chown own file": attempt(lambda: os.chown("/var/lib/petstore", os.getuid(), os.getgid())),
    "write /etc": attempt(lambda: write("/etc/petstore-probe")),
    "write the release": attempt(lambda: write("/opt/petstore/current/probe")),
    "write the state": attempt(lambda: write("/var/lib/petstore/probe")),
    "write /tmp": attempt(lambda: write("/tmp/petstore-probe")),
    "list /root": attempt(lambda: os.listdir("/root")),
    "processes of others": sorted(
        {os.stat(f"/proc/{pid}").st_uid for pid in os.listdir("/proc") if pid.isdigit()}
        - {os.getuid()}
    ),
    "/proc/meminfo": os.path.exists("/proc/meminfo"),
    "/dev": sorted(os.listdir("/dev")),
}))
"""


def test_the_emulation_refuses_what_the_unit_forbids(host: Path) -> None:
    """The sandbox of the service test is not a stand-in that lets everything through: each
    setting it emulates refuses its act, and what the service needs is left."""
    unit = UnitFile(UNIT)
    spec = sandbox_of(unit, host, [str(DEBIAN_PYTHON), "-c", PROBE], {"PATH": SERVICE_PATH})
    probed = subprocess.run(
        Sandbox.launcher(spec.write(host / "probe.json")),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert probed.returncode == 0, probed.stderr
    assert json.loads(probed.stdout) == {
        "write and execute memory": "Operation not permitted",
        "read and execute memory": "ok",
        "netlink socket": "Address family not supported by protocol",
        "TCP socket": "ok",
        "user namespace": "Operation not permitted",
        "lower priority": "Operation not permitted",
        "chown own file": "Operation not permitted",
        "write /etc": "Read-only file system",
        "write the release": "Read-only file system",
        "write the state": "ok",
        "write /tmp": "ok",
        "list /root": "Permission denied",
        "processes of others": [],
        "/proc/meminfo": False,
        "/dev": [
            "fd",
            "full",
            "null",
            "random",
            "shm",
            "stderr",
            "stdin",
            "stdout",
            "tty",
            "urandom",
            "zero",
        ],
    }
    assert not Path("/tmp/petstore-probe").exists()


def test_the_service_runs_reloads_and_releases_under_the_units_sandbox(
    host: Path, release_venv: Path, database_url: str, redis_url: str
) -> None:
    """ExecStart in the sandbox: READY=1 from the master, /healthz and keyed requests (the
    database and Redis over TCP), /metrics (its directory in the private /tmp), the pid file in
    the state directory; ExecReload replaces the workers; the USR2 release of docs/upgrading.rst
    under a load moves the main process to the new master before the old one is told to stop,
    with only 200 and 201 answered; the stop (SIGTERM to every process) ends with status 0."""
    unit = UnitFile(UNIT)
    nobody = pwd.getpwnam("nobody")
    port = free_port()
    url = f"http://{LOOPBACK}:{port}"
    log = host / "journal.log"
    manager = Manager(log)
    with empty_database(database_url, "_unit") as database:
        with db.connect(config.from_environ({"DATABASE_URL": database})) as conn:
            migrations.upgrade(conn)
            key, _row = keys.issue_key(conn, "enterprise", "unit", 1_000_000, 10_000_000)
        # What deploy/install.sh writes to /etc/petstore.env, with this test's addresses; in the
        # state directory, where the sandbox sees it (its /etc is the machine's), readable by the
        # service's user as /etc/petstore.env is by the group petstore.
        environment_file = host / "state" / "petstore.env"
        environment_file.write_text(
            f"DATABASE_URL={database}\nRATELIMIT_STORAGE_URI={redis_url}\n"
            f"PETSTORE_PROXY_COUNT=1\nBIND={LOOPBACK}:{port}\nWEB_CONCURRENCY=2\n",
            encoding="utf-8",
        )
        # systemd's own variables for a service of User=nobody, then the unit's.
        environ = {
            "PATH": SERVICE_PATH,
            "HOME": nobody.pw_dir,
            "USER": nobody.pw_name,
            "LOGNAME": nobody.pw_name,
            "SHELL": nobody.pw_shell,
            "INVOCATION_ID": os.urandom(16).hex(),
            **unit.environment(environment_file),
            "NOTIFY_SOCKET": manager.notify.address,
        }
        # A USR2 release's new master reads the environment file again (pre_exec): the one
        # EnvironmentFile= names, at its place in the sandbox.
        assert environ["PETSTORE_ENV_FILE"] == unit.value("EnvironmentFile") == "/etc/petstore.env"
        environ["PETSTORE_ENV_FILE"] = str(STATE / environment_file.name)

        def sandbox(command: list[str], name: str) -> Path:
            return sandbox_of(unit, host, command, environ).write(host / f"{name}.json")

        pid_file = host / "state" / "gunicorn.pid"
        with reaper(), log.open("wb") as journal:
            # A session of its own: the unit's control group, for the stop.
            master = subprocess.Popen(
                Sandbox.launcher(sandbox(unit.command("ExecStart"), "start")),
                cwd=ROOT,
                env={"PATH": SERVICE_PATH},
                stdin=subprocess.DEVNULL,
                stdout=journal,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
            manager.main_pid = master.pid
            new_master = None
            try:
                manager.wait(lambda: master.pid in manager.ready_from, 30, "READY=1")
                assert master.poll() is None, log_tail(log)
                # The sandbox is the one asked for (seen from outside, by the kernel).
                status = status_fields(master.pid)
                assert status["Uid"].split()[0] == str(nobody.pw_uid)
                assert (status["NoNewPrivs"], status["CapBnd"]) == ("1", "0000000000000000")
                assert (status["Seccomp"], status["Seccomp_filters"]) == ("2", "4")
                assert status["Umask"] == unit.value("UMask")
                assert read_pid(pid_file) == master.pid

                manager.wait(lambda: version(url) == "1.1.0", 30, "/healthz answers")
                auth = {"Authorization": f"Bearer {key}"}
                created = call(
                    url,
                    "POST",
                    "/v1/pets",
                    headers=auth,
                    json_body={"name": "Rex", "categoryId": 1},
                )
                assert created.status == 201, created.body
                assert call(url, "GET", "/v1/pets", headers=auth).status == 200
                scrape = call(url, "GET", "/metrics")
                assert scrape.status == 200
                # ProcSubset=pid hides /proc/stat: each worker's process numbers read /proc/self.
                for gauge in ("cpu_seconds", "resident_memory_bytes", "open_fds"):
                    assert f"petstore_worker_{gauge}{{pid=" in scrape.raw.decode(), gauge

                # ExecReload, with $MAINPID, in the unit's sandbox as systemd runs it.
                workers = set(children(master.pid))
                reload = [
                    word.replace("$MAINPID", str(manager.main_pid))
                    for word in unit.command("ExecReload")
                ]
                reloaded = subprocess.run(
                    Sandbox.launcher(sandbox(reload, "reload")),
                    cwd=ROOT,
                    capture_output=True,
                    text=True,
                    timeout=30,
                )
                assert reloaded.returncode == 0, reloaded.stderr
                manager.wait(
                    lambda: (
                        len(set(children(master.pid)) - workers) == 2 and version(url) == "1.1.0"
                    ),
                    30,
                    "new workers after the reload",
                )

                # The release of docs/upgrading.rst, under a load: link, USR2, wait for the new
                # main process, TERM the old master.
                make_release(host / "opt", NEW_VERSION, release_venv, NEW_VERSION)
                with MixedLoad(url, key, "unit", clients=4).running() as load:
                    time.sleep(1)
                    point(host / "opt" / "current", f"releases/{NEW_VERSION}")
                    os.kill(read_pid(pid_file) or 0, signal.SIGUSR2)
                    successor = pid_file.with_name("gunicorn.pid.2")
                    manager.wait(lambda: read_pid(successor) is not None, 30, "a new master")
                    new_master = read_pid(successor)
                    manager.wait(
                        lambda: manager.main_pid == new_master, 30, "MAINPID= of the new master"
                    )
                    os.kill(master.pid, signal.SIGTERM)
                    assert master.wait(timeout=30) == 0, log_tail(log)
                    manager.wait(
                        lambda: read_pid(pid_file) == new_master, 10, "the pid file renamed"
                    )
                    time.sleep(1)
                assert version(url) == NEW_VERSION
                # READY=1 from each master; MAINPID= from a worker of the new one (NotifyAccess=all).
                assert manager.ready_from[:1] == [master.pid] and new_master in manager.ready_from
                senders = [s for s, fields in manager.messages if "MAINPID" in fields]
                assert senders and new_master not in senders, manager.messages
                statuses = {answer.status for answer in load.answers}
                print(
                    f"\nmasters {master.pid} then {new_master}; notified (sender pid, fields): "
                    f"{manager.messages}\nunder the unit's sandbox: {len(load.answers)} answers "
                    f"around the release, statuses {sorted(statuses)}, "
                    f"{len(load.failures)} failures"
                )
                assert load.failures == [] and load.abandoned == []
                assert statuses <= {200, 201}, sorted(statuses)

                # The stop: SIGTERM to every process of the unit (KillMode=control-group).
                os.killpg(master.pid, signal.SIGTERM)
                _pid, wait_status = os.waitpid(new_master, 0)
                assert os.waitstatus_to_exitcode(wait_status) == 0, log_tail(log)
                assert not pid_file.exists()
            finally:
                manager.notify.close()
                try:
                    os.killpg(master.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                master.wait(timeout=10)
                if new_master is not None and alive(new_master):
                    os.kill(new_master, signal.SIGKILL)
                    os.waitpid(new_master, 0)
        assert "Traceback" not in log.read_text(errors="replace"), log_tail(log)
