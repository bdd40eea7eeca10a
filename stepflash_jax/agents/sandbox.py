"""Run untrusted Python (model output) in a confined process (docs/agents.md §2).

    r = sandbox.run_python(code, timeout_s=5.0, memory_mb=256, stdin="")
    r.stdout, r.stderr, r.exit_code, r.timed_out, r.error

Containment comes from the operating system, never from reading the code:
  * a fresh temporary directory per run (the working directory, HOME and TMPDIR), removed afterwards;
  * `unshare` (util-linux), where namespaces are allowed: new user (its root has no capability on the host),
    network (no interfaces: no network at all), PID (everything the code starts dies with it) and mount
    namespaces, /proc remounted, a size-limited tmpfs on the working directory;
  * a pids and a memory cgroup per run where this process may create them (as root: the kernel does not apply
    the process limit to root, even inside a user namespace; the memory cgroup bounds all of a run's processes
    and its tmpfs together, where the address-space limit bounds each process);
  * resource limits: CPU seconds, address space, file size (which also caps stdout and stderr, written to files),
    process count, open files, no core dumps;
  * Landlock (Linux >= 5.13): every path read-only except the working directory, TCP bind / connect denied
    (Landlock ABI >= 4), signals to processes outside the sandbox denied (ABI >= 6);
  * a wall-clock limit: the whole process group (and namespace) is killed.
`capabilities()` says which of these this machine gives; stepflash_jax/agents/confine.py applies them in the child.
Reading files is not restricted (the Python installation must stay readable).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

from stepflash_jax.checks import is_number

CONFINE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "confine.py")
PREFIX = "sfj-sandbox-"
UNSHARE = [
  "unshare",
  "--user",
  "--map-root-user",
  "--net",
  "--ipc",  # SysV shared memory, queues, semaphores: private, gone with the run
  "--pid",
  "--fork",
  "--kill-child",
  "--mount",
  "--mount-proc",
]
# per controller: where a run's cgroup may go (the cgroup v1 hierarchy, then the v2 unified one) and the files its
# limit is written to where they exist (v1 memory, then memory + swap, which must stay >= it; v2 memory)
CGROUPS = {
  "pids": (("/sys/fs/cgroup/pids", "/sys/fs/cgroup"), ("pids.max",)),
  "memory": (
    ("/sys/fs/cgroup/memory", "/sys/fs/cgroup"),
    ("memory.limit_in_bytes", "memory.memsw.limit_in_bytes", "memory.max"),
  ),
}


@dataclasses.dataclass(frozen=True)
class Result:
  stdout: str
  stderr: str
  exit_code: int | None  # None when the process was killed (timeout, a limit's signal)
  timed_out: bool
  error: str | None  # why it was stopped, or None
  confinement: str = ""  # what the launcher applied, e.g. "tmpfs 64 MB; landlock abi 7 (tcp denied)"
  seconds: float = 0.0


@functools.cache
def capabilities() -> dict:
  """Which containment this machine gives: {"namespaces": bool, "landlock": ABI (0 = none), "pids_cgroup" and
  "memory_cgroup": the directory under which a per-run cgroup of that controller can be made, or ""}."""
  try:
    ns = subprocess.run(UNSHARE + ["true"], capture_output=True, timeout=10).returncode == 0
  except (OSError, subprocess.SubprocessError):
    ns = False
  probe = "import ctypes; print(ctypes.CDLL(None).syscall(444, None, 0, 1))"
  out = subprocess.run([sys.executable, "-I", "-c", probe], capture_output=True, text=True, timeout=10).stdout
  caps = {"namespaces": ns, "landlock": max(0, int(out.strip() or 0))}
  return caps | {f"{c}_cgroup": _cgroup_base(c) for c in CGROUPS}


def _cgroup_base(controller: str) -> str:
  """A cgroup directory with `controller` where this process may create children (root, usually), or ""."""
  bases, files = CGROUPS[controller]
  for base in bases:
    try:
      probe = tempfile.mkdtemp(prefix=PREFIX, dir=base)
    except OSError:
      continue
    ok = any(os.path.exists(os.path.join(probe, f)) for f in files)
    os.rmdir(probe)
    if ok:
      return base
  return ""


def _cgroups(caps: dict, limits: dict) -> list[str]:
  """Fresh per-run cgroups with their limits: {"pids": count, "memory": bytes} (one directory per base: v2 holds
  both controllers in one). Swap is not allowed past the memory limit where the kernel has the file."""
  paths = {}
  for controller, limit in limits.items():
    base = caps[f"{controller}_cgroup"]
    if not base:
      continue
    path = paths.get(base) or tempfile.mkdtemp(prefix=PREFIX, dir=base)
    paths[base] = path
    for name in CGROUPS[controller][1]:
      _write(path, name, limit)
    if controller == "memory":  # v2 counts swap apart: none
      _write(path, "memory.swap.max", 0)
  return list(paths.values())


def _write(path: str, name: str, value: int):
  if os.path.exists(os.path.join(path, name)):
    with open(os.path.join(path, name), "w") as f:
      f.write(str(value))


def _oom_kills(paths: list[str]) -> int:
  """Processes the kernel killed at a run's memory cgroup limit (v1 memory.oom_control, v2 memory.events)."""
  n = 0
  for path in paths:
    for name in ("memory.oom_control", "memory.events"):
      try:
        with open(os.path.join(path, name)) as f:
          n += sum(int(line.split()[1]) for line in f if line.startswith("oom_kill "))
      except OSError:
        pass
  return n


def _remove_cgroup(path: str):
  for _ in range(50):  # empty once the kernel has reaped the namespace's processes
    try:
      os.rmdir(path)
      return
    except OSError:
      time.sleep(0.02)


def _kill(proc):
  """Kill a run: first the PID namespace's init (the child of `unshare`), whose exit makes the kernel kill and
  reap everything else in the namespace before `unshare` returns, then the whole process group."""
  try:
    with open(f"/proc/{proc.pid}/task/{proc.pid}/children") as f:
      for pid in f.read().split():
        os.kill(int(pid), signal.SIGKILL)
    proc.wait(timeout=10)
  except (OSError, ValueError, subprocess.TimeoutExpired):
    pass
  try:
    os.killpg(proc.pid, signal.SIGKILL)
  except (ProcessLookupError, PermissionError):
    pass
  proc.wait()


def _read_capped(path: str, cap: int) -> tuple[str, bool]:
  with open(path, "rb") as f:
    data = f.read(cap + 1)
  return data[:cap].decode("utf-8", errors="replace"), len(data) >= cap


def _remove(path: str):
  """Remove a run's directory even if the code made parts of it read-only."""

  def retry(fn, p, _):
    os.chmod(os.path.dirname(p), 0o700)
    os.chmod(p, 0o700) if os.path.isdir(p) else None
    fn(p)

  shutil.rmtree(path, onexc=retry) if sys.version_info >= (3, 12) else shutil.rmtree(path, onerror=retry)


def _diagnose(code: int | None, stderr: str, out_full: bool, err_full: bool, limits: dict) -> str | None:
  """The reason a run stopped, from its exit status and output."""
  if code != 0 and limits["oom_kills"]:
    return f"memory limit of the run ({limits['run_memory_mb']} MB over all its processes and files)"
  if code is not None and code < 0:
    sig = -code
    if sig == signal.SIGXCPU or (sig == signal.SIGKILL and limits["cpu_hit"]):
      return f"CPU time limit ({limits['cpu_s']} s)"
    return f"killed by signal {signal.Signals(sig).name}" if sig in signal.valid_signals() else f"signal {sig}"
  if out_full or err_full:
    return f"output limit ({limits['file_bytes']} bytes per stream)"
  if code and "MemoryError" in stderr[-2000:]:
    return f"memory limit ({limits['memory_bytes'] >> 20} MB)"
  return None


def _check_args(code, stdin, **positive):
  if not isinstance(code, str) or not isinstance(stdin, str):
    raise ValueError(f"code and stdin must be str, got {type(code).__name__} and {type(stdin).__name__}")
  for name, v in positive.items():
    if not is_number(v) or not v > 0:
      raise ValueError(f"{name} must be a number > 0, got {v!r}")


def _command(main: str, confine: str, namespaces: bool, cgroups: list) -> list:
  """argv of the sandbox: confine.py (its limits as JSON) running `python -I main`, inside unshare's namespaces and
  the cgroups where the machine has them."""
  argv = [sys.executable, "-I", CONFINE, confine, "--", sys.executable, "-I", main]
  argv = (UNSHARE + argv) if namespaces else argv
  if cgroups:  # the shell joins them, then becomes the sandbox: everything it starts is counted
    join = 'for d in "$@"; do [ "$d" = -- ] && break; echo $$ > "$d/cgroup.procs" || exit 125; shift; done'
    argv = ["/bin/sh", "-c", join + '; shift; exec "$@"', "sh", *cgroups, "--"] + argv
  return argv


def _wait(argv: list, root: str, work: str, env: dict, timeout_s: float):
  """Run argv in a session of its own (stdin, stdout, stderr: files under root) until it exits or timeout_s passes;
  then kill its process group. Returns (exit code or None on time out, timed_out, seconds)."""
  t0 = time.monotonic()
  with open(os.path.join(root, "stdin"), "rb") as fin, open(os.path.join(root, "stdout"), "wb") as fout:
    with open(os.path.join(root, "stderr"), "wb") as ferr:
      proc = subprocess.Popen(argv, stdin=fin, stdout=fout, stderr=ferr, cwd=work, env=env, start_new_session=True)
      try:
        code, timed_out = proc.wait(timeout=timeout_s), False
      except subprocess.TimeoutExpired:
        code, timed_out = None, True
      _kill(proc)  # on time out; otherwise whatever the code left running in its group
  return code, timed_out, time.monotonic() - t0


def run_python(
  code: str,
  *,
  timeout_s: float = 5.0,
  memory_mb: int = 256,
  stdin: str = "",
  max_output_bytes: int = 1 << 16,
  max_processes: int = 16,
  disk_mb: int = 64,
) -> Result:
  """Run `code` with `python -I` in a confined child process; never raises for anything the code does.

  timeout_s: wall clock (CPU seconds are limited to ceil(timeout_s)); memory_mb: address space; max_output_bytes:
  stdout and stderr are cut there (and any file the code writes); max_processes: the process limit (inside the
  sandbox's own user namespace where available, else on top of the user's current count); disk_mb: the tmpfs
  size of the working directory (with namespaces)."""
  _check_args(
    code,
    stdin,
    timeout_s=timeout_s,
    memory_mb=memory_mb,
    max_output_bytes=max_output_bytes,
    max_processes=max_processes,
    disk_mb=disk_mb,
  )
  caps = capabilities()
  root, cgroups = tempfile.mkdtemp(prefix=PREFIX), []
  try:
    work = os.path.join(root, "work")
    os.mkdir(work, 0o700)
    for name, text in (("main.py", code), ("stdin", stdin)):
      with open(os.path.join(root, name), "w", encoding="utf-8", errors="surrogatepass") as f:  # no raise on "\ud800"
        f.write(text)
    nproc = max_processes if caps["namespaces"] else _user_processes() + max_processes
    limits = dict(
      cpu_s=max(1, math.ceil(timeout_s)),
      memory_bytes=int(memory_mb) << 20,
      file_bytes=int(max_output_bytes),
      nproc=int(nproc),
      disk_mb=int(disk_mb) if caps["namespaces"] else 0,
      mount_ns=bool(caps["namespaces"]),  # confine.py remounts read-only only inside a mount namespace of its own
    )
    confine = json.dumps(limits)  # what confine.py applies before it runs the code
    # the kernel does not apply RLIMIT_NPROC to root: a pids cgroup counts for it (+ unshare and the launcher); the
    # memory cgroup holds the run's processes and its tmpfs's pages (charged to the writer's cgroup)
    limits["run_memory_mb"] = int(memory_mb) + limits["disk_mb"]
    cgroups = _cgroups(caps, {"pids": max_processes + 2, "memory": limits["run_memory_mb"] << 20})
    argv = _command(os.path.join(root, "main.py"), confine, caps["namespaces"], cgroups)
    env = {"PATH": "/usr/bin:/bin", "HOME": work, "TMPDIR": work, "LANG": "C.UTF-8", "PYTHONIOENCODING": "utf-8"}
    status, timed_out, seconds = _wait(argv, root, work, env, timeout_s)
    out, out_full = _read_capped(os.path.join(root, "stdout"), max_output_bytes)
    err, err_full = _read_capped(os.path.join(root, "stderr"), max_output_bytes)
    confinement, _, err = err.partition("\n") if err.startswith("confine: ") else ("", "", err)
    if timed_out and caps["namespaces"]:  # unshare's own complaint when its child is killed
      err = "".join(ln for ln in err.splitlines(True) if not ln.startswith("unshare: "))
    limits["cpu_hit"], limits["oom_kills"] = seconds >= limits["cpu_s"], _oom_kills(cgroups)
    error = f"wall-clock timeout ({timeout_s} s)" if timed_out else _diagnose(status, err, out_full, err_full, limits)
    exit_code = None if timed_out or (status is not None and status < 0) else status
    return Result(out, err, exit_code, timed_out, error, confinement.removeprefix("confine: "), seconds)
  finally:
    _remove(root)
    for path in cgroups:
      _remove_cgroup(path)


def _user_processes() -> int:
  """How many processes this user runs now (RLIMIT_NPROC counts them all when there is no user namespace)."""
  uid = os.getuid()
  n = 0
  for pid in os.listdir("/proc"):
    try:
      n += pid.isdigit() and os.stat(f"/proc/{pid}").st_uid == uid
    except OSError:
      pass
  return n


def run_job(job: dict) -> Result:
  """run_python(**job) for executors: job = {"code": ..., and any keyword of run_python}."""
  return run_python(job["code"], **{k: v for k, v in job.items() if k != "code"})
