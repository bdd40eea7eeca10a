"""The sandbox's launcher: run as a script inside the new namespaces, it confines itself, then execs the code.

    python -I confine.py LIMITS_JSON -- PROGRAM ARGS...

Standard library only (it runs under `python -I`, without the project on the path). In order: every mount read-only
and a size-limited tmpfs on the working directory (when running as root of a fresh mount namespace: no chmod,
chown, utime or xattr on the host's files), resource limits (CPU seconds, address space, file size, processes,
open files, no core dumps), `PR_SET_NO_NEW_PRIVS`, then a Landlock ruleset
(Linux >= 5.13): the whole filesystem read-only and executable, the working directory and /dev/null writable, TCP
bind / connect denied (Landlock ABI >= 4), signals and abstract Unix sockets scoped to the sandbox (ABI >= 6), then a
seccomp filter that denies socket(AF_UNIX) (the host's Unix sockets on disk) and syscalls of a foreign ABI.
What is unavailable is skipped and reported on stderr as one `confine:` line; sandbox.py reads it.
"""

import ctypes
import json
import os
import platform
import resource
import sys

# Landlock (include/uapi/linux/landlock.h). Syscall numbers are the same on x86_64 and aarch64.
SYS_CREATE_RULESET, SYS_ADD_RULE, SYS_RESTRICT_SELF = 444, 445, 446
CREATE_RULESET_VERSION = 1
RULE_PATH_BENEATH = 1
FS_EXECUTE, FS_READ_FILE, FS_READ_DIR = 1 << 0, 1 << 2, 1 << 3
FS_ALL = {1: (1 << 13) - 1, 2: (1 << 14) - 1, 3: (1 << 15) - 1, 5: (1 << 16) - 1}  # rights known per ABI
NET_BIND_TCP, NET_CONNECT_TCP = 1 << 0, 1 << 1
SCOPE_ABSTRACT_UNIX, SCOPE_SIGNAL = 1 << 0, 1 << 1
PR_SET_NO_NEW_PRIVS = 38
MS_NOSUID, MS_NODEV = 2, 4
SYS_MOUNT_SETATTR, AT_FDCWD, AT_RECURSIVE, MOUNT_ATTR_RDONLY = 442, -100, 0x8000, 0x1  # Linux >= 5.12, all arches
# seccomp: (AUDIT_ARCH, socket's syscall number) of the native ABI; AF_UNIX = 1
SECCOMP_ABI = {"x86_64": (0xC000003E, 41), "aarch64": (0xC00000B7, 198)}
PR_SET_SECCOMP, SECCOMP_MODE_FILTER = 22, 2

libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long


class RulesetAttr(ctypes.Structure):
  _fields_ = [("fs", ctypes.c_uint64), ("net", ctypes.c_uint64), ("scoped", ctypes.c_uint64)]


class PathBeneath(ctypes.Structure):
  _pack_ = 1
  _fields_ = [("allowed", ctypes.c_uint64), ("parent_fd", ctypes.c_int32)]


class MountAttr(ctypes.Structure):
  _fields_ = [(n, ctypes.c_uint64) for n in ("attr_set", "attr_clr", "propagation", "userns_fd")]


class SockFilter(ctypes.Structure):
  _fields_ = [("code", ctypes.c_uint16), ("jt", ctypes.c_uint8), ("jf", ctypes.c_uint8), ("k", ctypes.c_uint32)]


class SockFprog(ctypes.Structure):
  _fields_ = [("len", ctypes.c_uint16), ("filter", ctypes.POINTER(SockFilter))]


def read_only_mounts() -> str:
  """Every mount of this (private) mount namespace read-only, before the working directory's tmpfs is mounted: no
  chmod, chown, utime or xattr on the host's files, which Landlock has no right for."""
  attr = MountAttr(MOUNT_ATTR_RDONLY, 0, 0, 0)
  ok = libc.syscall(SYS_MOUNT_SETATTR, AT_FDCWD, b"/", AT_RECURSIVE, ctypes.byref(attr), ctypes.sizeof(attr)) == 0
  return "mounts read-only" if ok else f"mounts not read-only (errno {ctypes.get_errno()})"


def no_unix_sockets() -> str:
  """A seccomp filter: socket(AF_UNIX, ...) fails with EACCES (a network namespace does not hide the host's Unix
  sockets on disk, and Landlock has no right for connecting to them), and so does every syscall of another ABI
  (i386, x32), which could reach socket() under another number."""
  abi = SECCOMP_ABI.get(platform.machine())
  if abi is None:
    return f"unix sockets allowed (no seccomp filter for {platform.machine()})"
  ld, jeq, jge, ret = 0x20, 0x15, 0x35, 0x06  # BPF_LD|W|ABS, BPF_JMP|JEQ|K, BPF_JMP|JGE|K, BPF_RET|K
  deny, allow = 0x00050000 | 13, 0x7FFF0000  # SECCOMP_RET_ERRNO | EACCES, SECCOMP_RET_ALLOW
  prog = [
    (ld, 0, 0, 4),  # 0: the syscall's ABI (seccomp_data.arch)
    (jeq, 1, 0, abi[0]),  # 1: native -> 3
    (ret, 0, 0, deny),  # 2
    (ld, 0, 0, 0),  # 3: the syscall number (seccomp_data.nr)
    (jge, 3, 0, 0x40000000),  # 4: x32 numbers -> 8 (deny)
    (jeq, 0, 3, abi[1]),  # 5: not socket() -> 9 (allow)
    (ld, 0, 0, 16),  # 6: its first argument, the address family (low 32 bits of args[0])
    (jeq, 0, 1, 1),  # 7: AF_UNIX -> 8, else 9
    (ret, 0, 0, deny),  # 8
    (ret, 0, 0, allow),  # 9
  ]
  filters = (SockFilter * len(prog))(*[SockFilter(*f) for f in prog])
  fprog = SockFprog(len(prog), filters)
  if libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
    return f"unix sockets allowed (no_new_privs failed, errno {ctypes.get_errno()})"
  if libc.prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.byref(fprog), 0, 0) != 0:
    return f"unix sockets allowed (seccomp failed, errno {ctypes.get_errno()})"
  return "unix sockets denied (seccomp)"


def landlock(writable) -> str:
  """Restrict this process (and what it execs) to read-only files except `writable`; returns what was applied."""
  abi = libc.syscall(SYS_CREATE_RULESET, None, 0, CREATE_RULESET_VERSION)
  if abi < 1:
    return "no landlock"
  fs = FS_ALL[max(k for k in FS_ALL if k <= abi)]
  attr = RulesetAttr(fs, NET_BIND_TCP | NET_CONNECT_TCP if abi >= 4 else 0, SCOPE_ABSTRACT_UNIX | SCOPE_SIGNAL)
  size = 24 if abi >= 6 else (16 if abi >= 4 else 8)
  ruleset = libc.syscall(SYS_CREATE_RULESET, ctypes.byref(attr), size, 0)
  if ruleset < 0:
    return f"landlock ruleset failed (errno {ctypes.get_errno()})"
  rules = [("/", FS_EXECUTE | FS_READ_FILE | FS_READ_DIR)] + [(p, fs) for p in writable]
  for path, allowed in rules:
    fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
    if not os.path.isdir(path):
      allowed &= (1 << 0) | (1 << 1) | (1 << 2) | (1 << 14) | (1 << 15)  # only file rights on a file
    rule = PathBeneath(allowed & fs, fd)
    if libc.syscall(SYS_ADD_RULE, ruleset, RULE_PATH_BENEATH, ctypes.byref(rule), 0) != 0:
      return f"landlock rule for {path} failed (errno {ctypes.get_errno()})"
    os.close(fd)
  if libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0 or libc.syscall(SYS_RESTRICT_SELF, ruleset, 0) != 0:
    return f"landlock restrict failed (errno {ctypes.get_errno()})"
  return f"landlock abi {abi}" + (" (tcp denied)" if abi >= 4 else "")


def tmpfs(path: str, size_mb: int) -> str:
  """A size-limited tmpfs over the working directory (only root of a user + mount namespace may mount)."""
  opts = f"size={size_mb}m,mode=0700".encode()
  ok = libc.mount(b"tmpfs", path.encode(), b"tmpfs", MS_NOSUID | MS_NODEV, opts) == 0
  return f"tmpfs {size_mb} MB" if ok else "no tmpfs"


def main():
  limits = json.loads(sys.argv[1])
  program = sys.argv[sys.argv.index("--") + 1 :]
  work = os.getcwd()
  applied = []
  if os.getuid() == 0 and limits.get("mount_ns"):  # root of the sandbox's own mount namespace, never the host's
    applied.append(read_only_mounts())
    if limits.get("disk_mb"):
      applied.append(tmpfs(work, limits["disk_mb"]))
    os.chdir(work)  # re-enter: the cwd was the directory under the new mount
  cpu = int(limits["cpu_s"])
  for kind, value in (
    (resource.RLIMIT_CPU, (cpu, cpu + 1)),  # SIGXCPU at the soft limit, SIGKILL one second later
    (resource.RLIMIT_AS, (limits["memory_bytes"],) * 2),
    (resource.RLIMIT_FSIZE, (limits["file_bytes"],) * 2),  # caps stdout / stderr files and any file written
    (resource.RLIMIT_NPROC, (limits["nproc"],) * 2),
    (resource.RLIMIT_NOFILE, (64, 64)),
    (resource.RLIMIT_CORE, (0, 0)),
  ):
    resource.setrlimit(kind, value)
  applied.append(landlock([work, "/dev/null"]))
  applied.append(no_unix_sockets())
  sys.stderr.write("confine: " + "; ".join(applied) + "\n")
  sys.stderr.flush()
  os.execv(program[0], program)


if __name__ == "__main__":
  main()
