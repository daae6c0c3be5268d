"""A systemd unit file read as systemd reads it, and its service run in an emulation of the unit's
sandbox, without systemd as PID 1.

The parent side (UnitFile, allowed_syscalls, Sandbox and its launcher, NotifySocket) runs in the
test. The child side is this module run as a program, as root: `python -m tests.support.systemd SPEC`
sets up what the unit's settings would (a mount namespace, the user, the capabilities, seccomp
filters) and then execs the unit's ExecStart, so the service is the process the test started.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import json
import os
import re
import shlex
import socket
import struct
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

from tests.support.programs import program

# systemd's PATH for services of the system manager (systemd.exec(5), "Environment").
SERVICE_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin"


class UnitFile:
    """The [Section] Key=Value settings of a unit file, in order, a key possibly given several times."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.settings: list[tuple[str, str, str]] = []
        section = ""
        for line in path.read_text(encoding="utf-8").splitlines():
            line = line.strip()
            if not line or line[0] in "#;":
                continue
            if line.startswith("[") and line.endswith("]"):
                section = line[1:-1]
                continue
            key, _, value = line.partition("=")
            self.settings.append((section, key.strip(), value.strip()))

    def values(self, section: str, key: str) -> list[str]:
        """Every value given to `key` in `section`, in order ([] when it is not set)."""
        return [v for s, k, v in self.settings if (s, k) == (section, key)]

    def value(self, key: str) -> str:
        """The one value of `key` in [Service]; an error if it is not set exactly once."""
        values = self.values("Service", key)
        assert len(values) == 1, f"{self.path.name}: {key}= is set {len(values)} times"
        return values[0]

    def keys(self, section: str = "Service") -> set[str]:
        """The keys set in `section`."""
        return {k for s, k, _v in self.settings if s == section}

    def command(self, key: str) -> list[str]:
        """An Exec*= line split as systemd splits it (no specifiers or prefixes used here)."""
        line = self.value(key)
        assert line[0] not in "-@:+!", f"{key}= has a prefix this emulation does not know"
        return shlex.split(line)

    def environment(self, environment_file: Path) -> dict[str, str]:
        """Environment= then EnvironmentFile= (read from `environment_file`), as systemd merges
        them: the file's values win."""
        environ: dict[str, str] = {}
        for line in self.values("Service", "Environment"):
            environ.update(word.split("=", 1) for word in shlex.split(line))  # type: ignore[misc]
        environ.update(read_environment_file(environment_file))
        return environ


def read_environment_file(path: Path) -> dict[str, str]:
    """KEY=VALUE lines as EnvironmentFile= reads them: # and ; comments, optional quotes."""
    environ = {}
    for line in path.read_text(encoding="utf-8").splitlines():
        line = line.strip()
        if not line or line[0] in "#;":
            continue
        key, _, value = line.partition("=")
        value = value.strip()
        if len(value) >= 2 and value[0] == value[-1] and value[0] in "'\"":
            value = value[1:-1]
        environ[key.strip()] = value
    return environ


def syscall_groups() -> dict[str, list[str]]:
    """systemd's system call groups (`systemd-analyze syscall-filter`): @group -> its members."""
    text = subprocess.run(
        [program("systemd-analyze"), "syscall-filter"],
        capture_output=True,
        text=True,
        check=True,
        timeout=30,
    ).stdout
    groups: dict[str, list[str]] = {}
    current: list[str] = []
    for line in text.splitlines():
        if line.startswith("@"):
            current = groups.setdefault(line.strip(), [])
        elif line.strip() and not line.strip().startswith("#"):
            current.append(line.strip())
    return groups


def expand(names: Sequence[str], groups: Mapping[str, list[str]]) -> set[str]:
    """System call names and @groups, the groups replaced by their members (recursively)."""
    found: set[str] = set()
    for name in names:
        found |= expand(groups[name], groups) if name.startswith("@") else {name}
    return found


def allowed_syscalls(unit: UnitFile) -> set[str]:
    """What SystemCallFilter= lines allow: the first an allow list, each `~` line removing."""
    groups = syscall_groups()
    allowed: set[str] = set()
    for line in unit.values("Service", "SystemCallFilter"):
        if line.startswith("~"):
            allowed -= expand(line[1:].split(), groups)
        else:
            allowed |= expand(line.split(), groups)
    return allowed


@dataclass
class Sandbox:
    """What the child side sets up before it execs `command` (see main())."""

    command: list[str]
    environ: dict[str, str]
    cwd: str
    uid: int
    gid: int
    umask: int
    # The unit's paths -> the test's directories bound there (read-only unless in `writable`).
    binds: dict[str, str]
    writable: list[str]
    syscalls: list[str]
    address_families: list[int]
    errno_number: int
    private_tmp: bool = True
    protect_home: bool = True
    private_devices: bool = True
    proc_options: str = "hidepid=invisible,subset=pid"
    deny_write_execute: bool = True
    restrict_namespaces: bool = True
    # /proc/sys/kernel/cap_last_cap, read before the sandbox's /proc (subset=pid) hides it.
    last_capability: int = field(
        default_factory=lambda: int(Path("/proc/sys/kernel/cap_last_cap").read_text())
    )

    def write(self, path: Path) -> Path:
        """The spec as JSON for the child side."""
        path.write_text(json.dumps(asdict(self)), encoding="utf-8")
        return path

    @staticmethod
    def launcher(spec: Path) -> list[str]:
        """The command that runs the spec's command in the sandbox (as root, from the checkout)."""
        return [sys.executable, "-m", "tests.support.systemd", str(spec)]


class NotifySocket:
    """A datagram socket in the abstract namespace, as systemd's NOTIFY_SOCKET: each message
    with the pid of its sender (SO_PASSCRED), as systemd reads them."""

    def __init__(self) -> None:
        self.name = f"petstore-test-notify-{os.getpid()}-{time.monotonic_ns()}"
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)
        self.sock.bind("\0" + self.name)

    @property
    def address(self) -> str:
        """The NOTIFY_SOCKET value: `@` for the abstract namespace."""
        return "@" + self.name

    def receive(self, within: float) -> Iterator[tuple[int, dict[str, str]]]:
        """(sender pid, its KEY=VALUE fields) for each message until `within` s pass without one."""
        self.sock.settimeout(within)
        while True:
            try:
                data, ancillary, _flags, _address = self.sock.recvmsg(
                    4096, socket.CMSG_SPACE(struct.calcsize("3i"))
                )
            except TimeoutError:
                return
            pid = next(
                struct.unpack("3i", cdata)[0]
                for level, kind, cdata in ancillary
                if (level, kind) == (socket.SOL_SOCKET, socket.SCM_CREDENTIALS)
            )
            fields = dict(line.split("=", 1) for line in data.decode().splitlines() if "=" in line)
            yield pid, fields

    def close(self) -> None:
        self.sock.close()


# The child side: Linux's and libseccomp's constants, as their headers define them.
CLONE_NEWNS = 0x00020000
NAMESPACE_FLAGS = 0x7E020080  # CLONE_NEW{NS,CGROUP,UTS,IPC,USER,PID,NET} and CLONE_NEWTIME
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT = 1, 2, 4, 8, 32
MS_BIND, MS_REC, MS_PRIVATE = 4096, 16384, 1 << 18
MOUNT_FLAGS = {
    "nosuid": MS_NOSUID,
    "nodev": MS_NODEV,
    "noexec": MS_NOEXEC,
    "noatime": 1024,
    "nodiratime": 2048,
    "relatime": 1 << 21,
}
PR_CAPBSET_DROP, PR_SET_NO_NEW_PRIVS = 24, 38
PROT_WRITE, PROT_EXEC, SHM_EXEC = 0x2, 0x4, 0o100000
SCMP_ACT_ALLOW = 0x7FFF0000
SCMP_CMP_EQ, SCMP_CMP_GT, SCMP_CMP_MASKED_EQ = 4, 6, 7
DEVICES = ("null", "zero", "full", "random", "urandom", "tty")


def scmp_errno(number: int) -> int:
    """libseccomp's SCMP_ACT_ERRNO(number)."""
    return 0x00050000 | (number & 0xFFFF)


class ArgCmp(ctypes.Structure):
    """libseccomp's struct scmp_arg_cmp."""

    _fields_ = [
        ("arg", ctypes.c_uint),
        ("op", ctypes.c_int),
        ("datum_a", ctypes.c_uint64),
        ("datum_b", ctypes.c_uint64),
    ]


class Seccomp:
    """One seccomp filter built with libseccomp (loaded as systemd loads one per setting)."""

    lib = ctypes.CDLL(ctypes.util.find_library("seccomp") or "libseccomp.so.2", use_errno=True)
    lib.seccomp_init.restype = ctypes.c_void_p
    lib.seccomp_init.argtypes = [ctypes.c_uint32]
    lib.seccomp_syscall_resolve_name.argtypes = [ctypes.c_char_p]
    lib.seccomp_rule_add_array.argtypes = [
        ctypes.c_void_p,
        ctypes.c_uint32,
        ctypes.c_int,
        ctypes.c_uint,
        ctypes.POINTER(ArgCmp),
    ]
    lib.seccomp_load.argtypes = [ctypes.c_void_p]

    def __init__(self, default_action: int) -> None:
        self.ctx = self.lib.seccomp_init(default_action)
        assert self.ctx, "seccomp_init failed"

    def rule(self, action: int, name: str, *compare: tuple[int, int, int, int]) -> bool:
        """Add a rule for `name`; False when this architecture has no such system call."""
        number = self.lib.seccomp_syscall_resolve_name(name.encode())
        if number < 0:
            return False
        args = (ArgCmp * max(1, len(compare)))(*(ArgCmp(*c) for c in compare))
        result = self.lib.seccomp_rule_add_array(self.ctx, action, number, len(compare), args)
        assert result == 0, f"seccomp_rule_add {name}: {os.strerror(-result)}"
        return True

    def load(self) -> None:
        result = self.lib.seccomp_load(self.ctx)
        assert result == 0, f"seccomp_load: {os.strerror(-result)}"


libc = ctypes.CDLL(None, use_errno=True)


def check(result: int, what: str) -> None:
    """Raise OSError with errno when a libc call returned non-zero."""
    if result != 0:
        number = ctypes.get_errno()
        raise OSError(number, f"{what}: {os.strerror(number)}")


def mount(source: str | None, target: str, fstype: str | None, flags: int, data: str = "") -> None:
    check(
        libc.mount(
            source.encode() if source else None,
            target.encode(),
            fstype.encode() if fstype else None,
            ctypes.c_ulong(flags),
            data.encode() if data else None,
        ),
        f"mount {target}",
    )


def bind_fd(fd: int, target: str) -> None:
    """Bind the directory or file open as `fd` (O_PATH) onto `target`, which exists."""
    mount(f"/proc/self/fd/{fd}", target, None, MS_BIND)


def mount_points() -> list[tuple[str, int]]:
    """(mount point, its per-mount flags) of this namespace, in mount order."""
    found = []
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        fields = line.split()
        # Spaces and the like are octal escapes (\040).
        point = re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), fields[4])
        flags = sum(MOUNT_FLAGS.get(option, 0) for option in fields[5].split(","))
        found.append((point, flags))
    return found


def within(path: str, parents: Sequence[str]) -> bool:
    """Whether `path` is one of `parents` or beneath one."""
    return any(path == p or path.startswith(p.rstrip("/") + "/") for p in parents)


def set_up_mounts(spec: Sandbox) -> None:
    """A mount namespace as the unit's settings make it.

    The test's directories are bound at the unit's paths: over a tmpfs hiding what is at the
    unit's parent directory on this machine (/opt, /var/lib), which nothing of the service
    reads. Then PrivateTmp, ProtectHome, PrivateDevices, ProtectProc/ProcSubset, and
    ProtectSystem=strict: every other mount read-only (so also /sys: ProtectKernelTunables,
    ProtectControlGroups), the ReadWritePaths left writable.
    """
    check(libc.unshare(CLONE_NEWNS), "unshare")
    mount(None, "/", None, MS_REC | MS_PRIVATE)
    # Opened in the new namespace (a bind takes only its own mounts) before anything hides them
    # (they are in the test's /tmp, and /dev).
    sources = {target: os.open(source, os.O_PATH) for target, source in spec.binds.items()}
    devices = {name: os.open(f"/dev/{name}", os.O_PATH) for name in DEVICES}
    for target, fd in sources.items():
        if not os.path.isdir(target):
            parent = os.path.dirname(target)
            mount("tmpfs", parent, "tmpfs", MS_NOSUID | MS_NODEV, "mode=755")
            os.mkdir(target)
        bind_fd(fd, target)
    if spec.private_tmp:
        for tmp in ("/tmp", "/var/tmp"):
            mount("tmpfs", tmp, "tmpfs", MS_NOSUID | MS_NODEV, "mode=1777")
    if spec.protect_home:
        for home in ("/home", "/root", "/run/user"):
            if os.path.isdir(home):
                mount("tmpfs", home, "tmpfs", MS_NOSUID | MS_NODEV | MS_NOEXEC, "mode=000")
    if spec.private_devices:
        mount("tmpfs", "/dev", "tmpfs", MS_NOSUID | MS_NOEXEC, "mode=755")
        for name, fd in devices.items():
            Path(f"/dev/{name}").touch()
            bind_fd(fd, f"/dev/{name}")
        os.mkdir("/dev/shm")
        mount("tmpfs", "/dev/shm", "tmpfs", MS_NOSUID | MS_NODEV, "mode=1777")
        for name, target in (("fd", "/proc/self/fd"), ("stdin", "/proc/self/fd/0")):
            os.symlink(target, f"/dev/{name}")
        os.symlink("/proc/self/fd/1", "/dev/stdout")
        os.symlink("/proc/self/fd/2", "/dev/stderr")
    mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, spec.proc_options)
    writable = [*spec.writable, "/proc"]
    if spec.private_tmp:
        writable += ["/tmp", "/var/tmp"]
    if spec.private_devices:
        writable.append("/dev/shm")
    for point, flags in mount_points():
        if within(point, writable):
            continue
        try:
            mount(None, point, None, MS_BIND | MS_REMOUNT | MS_RDONLY | flags)
        except OSError as exc:
            # Under a mount this namespace put over it (the machine's /tmp, /dev/pts): hidden.
            if exc.errno not in (errno.ENOENT, errno.EINVAL):
                raise
    for fd in [*sources.values(), *devices.values()]:
        os.close(fd)


def drop_privileges(spec: Sandbox) -> None:
    """User=, Group=, an empty CapabilityBoundingSet=, NoNewPrivileges=, UMask=."""
    for cap in range(spec.last_capability + 1):
        check(libc.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0), f"dropping capability {cap}")
    os.setgroups([])
    os.setgid(spec.gid)
    os.setuid(spec.uid)
    check(libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "no_new_privs")
    os.umask(spec.umask)


def load_filters(spec: Sandbox) -> None:
    """The seccomp filters systemd loads for the unit, one per setting.

    SystemCallFilter= (with SystemCallErrorNumber= for the rest, native architecture only),
    RestrictAddressFamilies= (socket() of another family: EAFNOSUPPORT), MemoryDenyWriteExecute=
    (no mapping both writable and executable, nothing made executable later) and
    RestrictNamespaces= (no unshare, setns or clone of a namespace; clone3, whose flags a filter
    cannot read, says ENOSYS so that the C library falls back to clone).
    """
    families = Seccomp(SCMP_ACT_ALLOW)
    for family in range(64):
        if family not in spec.address_families:
            families.rule(scmp_errno(errno.EAFNOSUPPORT), "socket", (0, SCMP_CMP_EQ, family, 0))
    families.rule(scmp_errno(errno.EAFNOSUPPORT), "socket", (0, SCMP_CMP_GT, 63, 0))
    filters = [families]
    if spec.deny_write_execute:
        mdwe = Seccomp(SCMP_ACT_ALLOW)
        both = PROT_WRITE | PROT_EXEC
        mdwe.rule(scmp_errno(errno.EPERM), "mmap", (2, SCMP_CMP_MASKED_EQ, both, both))
        for name in ("mprotect", "pkey_mprotect"):
            mdwe.rule(scmp_errno(errno.EPERM), name, (2, SCMP_CMP_MASKED_EQ, PROT_EXEC, PROT_EXEC))
        mdwe.rule(scmp_errno(errno.EPERM), "shmat", (2, SCMP_CMP_MASKED_EQ, SHM_EXEC, SHM_EXEC))
        filters.append(mdwe)
    if spec.restrict_namespaces:
        spaces = Seccomp(SCMP_ACT_ALLOW)
        spaces.rule(scmp_errno(errno.EPERM), "unshare")
        spaces.rule(scmp_errno(errno.EPERM), "setns")
        # clone(flags, ...) on x86-64: any namespace flag refused.
        for bit in range(32):
            if NAMESPACE_FLAGS & (1 << bit):
                spaces.rule(
                    scmp_errno(errno.EPERM), "clone", (0, SCMP_CMP_MASKED_EQ, 1 << bit, 1 << bit)
                )
        spaces.rule(scmp_errno(errno.ENOSYS), "clone3")
        filters.append(spaces)
    # The allow list last, as systemd does: seccomp() itself is not in it.
    allow = Seccomp(scmp_errno(spec.errno_number))
    for name in spec.syscalls:
        allow.rule(SCMP_ACT_ALLOW, name)
    for each in [*filters, allow]:
        each.load()


def main(spec_path: str) -> None:
    """The child side: read the spec, set the sandbox up, exec the command (never returns)."""
    spec = Sandbox(**json.loads(Path(spec_path).read_text(encoding="utf-8")))
    set_up_mounts(spec)
    os.chdir(spec.cwd)
    drop_privileges(spec)
    load_filters(spec)
    os.execve(spec.command[0], spec.command, spec.environ)


if __name__ == "__main__":
    main(sys.argv[1])
