"""The sandbox (stepflash_jax/agents/sandbox.py) under hostile code, and the executors (agents/executor.py).

Each hostile case is the kind of program an RL policy can write; the checks are on what the host sees afterwards."""

import glob
import os
import socket
import tempfile
import threading
import time

import pytest

from stepflash_jax.agents import executor, sandbox

CAPS = sandbox.capabilities()
needs_landlock = pytest.mark.skipif(not CAPS["landlock"], reason="the kernel has no Landlock: writes are not confined")
needs_isolation = pytest.mark.skipif(
  not CAPS["namespaces"] and CAPS["landlock"] < 4, reason="neither a network namespace nor Landlock TCP rules"
)


@pytest.fixture(autouse=True)
def _own_temp_dir(tmp_path_factory, monkeypatch):
  """Each test's sandbox directories in a temporary directory of its own (tempfile's default): the checks for
  leftovers and processes see this test's runs, not those of other test files running beside it (pytest-xdist)."""
  monkeypatch.setattr(tempfile, "tempdir", str(tmp_path_factory.mktemp("sandboxes")))


def _leftovers():
  return set(glob.glob(os.path.join(tempfile.gettempdir(), sandbox.PREFIX + "*")))


def _sandbox_processes():
  """Processes still running a sandbox's program of this test (their command line names its sandbox directory)."""
  n, mine = 0, os.path.join(tempfile.gettempdir(), sandbox.PREFIX).encode()
  for pid in filter(str.isdigit, os.listdir("/proc")):
    try:
      with open(f"/proc/{pid}/cmdline", "rb") as f:
        n += mine in f.read()
    except OSError:
      pass
  return n


def test_runs_code_with_stdin_and_exit_code():
  r = sandbox.run_python("import sys\nprint(sys.stdin.read().upper())\nsys.exit(3)", stdin="hello")
  assert (r.stdout, r.exit_code, r.timed_out, r.error) == ("HELLO\n", 3, False, None)
  r = sandbox.run_python("open('a.txt', 'w').write('ok'); print(open('a.txt').read())")  # its own directory
  assert r.stdout == "ok\n" and r.exit_code == 0
  # a limit that is not a positive number is an error, never a limit left off (disk_mb -3 ran without its tmpfs)
  for name, value in (("timeout_s", 0), ("memory_mb", True), ("max_processes", 0), ("disk_mb", -3)):
    with pytest.raises(ValueError, match=rf"{name} must be a number > 0, got {value!r}"):
      sandbox.run_python("print(1)", **{name: value})


def test_infinite_loop_is_stopped_within_twice_its_limit():
  for code in ("while True: pass", "import time\ntime.sleep(60)"):
    t = time.monotonic()
    r = sandbox.run_python(code, timeout_s=1.0)
    assert time.monotonic() - t < 2.0, code
    assert r.exit_code is None and r.error is not None, r
  assert _sandbox_processes() == 0


def test_memory_bomb_is_stopped():
  r = sandbox.run_python("x = []\nwhile True:\n  x.append(bytearray(10**7))", memory_mb=128, timeout_s=5.0)
  assert r.exit_code != 0 and "memory" in (r.error or ""), r
  r = sandbox.run_python("x = bytearray(1 << 30)", memory_mb=128)
  assert "MemoryError" in r.stderr


SPLIT_ALLOCATION = """
import os, sys, time
kids = []
for i in range(4):  # four processes of 40 MB each, each inside its own address-space limit
  pid = os.fork()
  if pid == 0:
    b = b"x" * (40 << 20)
    print("held", flush=True)
    time.sleep(1.0)
    os._exit(0)
  kids.append(pid)
sys.exit(sum(os.waitpid(pid, 0)[1] != 0 for pid in kids))
"""


@pytest.mark.skipif(not CAPS["memory_cgroup"], reason="no memory cgroup this process may create: bounded per process")
def test_memory_is_bounded_per_run_not_per_process():
  """160 MB over four processes: within memory_mb = 64 each, over the run's 64 (+ 32 of tmpfs) MB: the kernel kills
  some. With memory_mb = 256 (the run's 256+ MB) all four hold their 40 MB at once."""
  r = sandbox.run_python(SPLIT_ALLOCATION, memory_mb=64, disk_mb=32, timeout_s=5.0)
  run_mb = 64 + 32 * CAPS["namespaces"]
  assert (
    r.stdout.count("held") < 4 and r.error == f"memory limit of the run ({run_mb} MB over all its processes and files)"
  ), r
  r = sandbox.run_python(SPLIT_ALLOCATION, memory_mb=256, disk_mb=32, timeout_s=5.0)
  assert r.stdout.count("held") == 4 and r.exit_code == 0 and r.error is None, r


def test_fork_bomb_is_stopped_and_leaves_no_process():
  code = "import os\nwhile True:\n  try:\n    os.fork()\n  except OSError:\n    pass"
  t = time.monotonic()
  r = sandbox.run_python(code, timeout_s=1.0, max_processes=16)
  assert time.monotonic() - t < 3.0 and r.error is not None, r
  assert _sandbox_processes() == 0
  assert sandbox.run_python("print('host fine')").stdout == "host fine\n"  # the host can still start processes


@needs_landlock
def test_writing_outside_its_directory_fails(tmp_path):
  target = tmp_path / "escaped.txt"
  home = os.path.expanduser("~/sfj_sandbox_escape.txt")
  for path in (str(target), home, "../outside.txt"):
    r = sandbox.run_python(f"open({path!r}, 'w').write('x')")
    denied = "PermissionError" in r.stderr or "Read-only file system" in r.stderr  # Landlock, or the ro mounts
    assert r.exit_code == 1 and denied, (path, r)
  assert not target.exists() and not os.path.exists(home)


@pytest.mark.skipif(not CAPS["namespaces"], reason="no user + mount namespace: the mounts cannot be made read-only")
def test_host_files_keep_their_mode_owner_and_times(tmp_path):
  """Landlock has no right for chmod / chown / utime / xattr; the sandbox's mounts are read-only instead."""
  target = tmp_path / "host.txt"
  target.write_text("x")
  os.chmod(target, 0o644)
  before = os.stat(target)
  code = (
    f"import os\n"
    f"for f in (lambda p: os.chmod(p, 0o4777), lambda p: os.chown(p, 1, 1), lambda p: os.utime(p, (0, 0))):\n"
    f"  try:\n    f({str(target)!r}); print('changed')\n  except OSError as e:\n    print('denied', e.errno)"
  )
  r = sandbox.run_python(code)
  assert "changed" not in r.stdout and r.stdout.count("denied") == 3, r
  after = os.stat(target)
  assert (after.st_mode, after.st_uid, after.st_mtime_ns) == (before.st_mode, before.st_uid, before.st_mtime_ns)


@pytest.mark.skipif(not CAPS["landlock"], reason="runs with the sandbox's full confinement only")
def test_host_unix_sockets_are_unreachable(tmp_path):
  """A network namespace does not hide Unix sockets on disk; the seccomp filter denies socket(AF_UNIX)."""
  path = str(tmp_path / "host.sock")
  server = socket.socket(socket.AF_UNIX)
  server.bind(path)
  server.listen()
  server.settimeout(3.0)
  accepted = []
  threading.Thread(target=lambda: accepted.append(_accept(server)), daemon=True).start()
  code = f"import socket\ns = socket.socket(socket.AF_UNIX)\ns.connect({path!r})\nprint('connected')"
  r = sandbox.run_python(code, timeout_s=3.0)
  assert "connected" not in r.stdout and r.exit_code == 1 and "PermissionError" in r.stderr, r
  time.sleep(0.2)
  assert accepted in ([], [None])
  server.close()
  r = sandbox.run_python("import socket\na, b = socket.socketpair()\na.send(b'x')\nprint(b.recv(1))")  # still fine
  assert r.stdout.strip() == "b'x'", r


@needs_isolation
def test_network_connections_fail():
  server = socket.socket()
  server.bind(("127.0.0.1", 0))
  server.listen()
  server.settimeout(3.0)
  accepted = []
  threading.Thread(target=lambda: accepted.append(_accept(server)), daemon=True).start()
  port = server.getsockname()[1]
  for host in ("127.0.0.1", "1.1.1.1"):
    code = f"import socket\nsocket.create_connection(({host!r}, {port}), timeout=2)\nprint('connected')"
    r = sandbox.run_python(code, timeout_s=3.0)
    assert "connected" not in r.stdout and r.exit_code == 1, r
  time.sleep(0.2)
  assert accepted in ([], [None])  # nothing reached the host's server
  server.close()


def _accept(server):
  try:
    return server.accept()
  except OSError:
    return None


def test_huge_output_is_cut():
  r = sandbox.run_python("import sys\nwhile True:\n  sys.stdout.write('x' * 4096)", max_output_bytes=10_000)
  assert len(r.stdout) == 10_000 and set(r.stdout) == {"x"} and "output limit" in r.error, r.error
  r = sandbox.run_python("print('y' * 50_000)", max_output_bytes=1000)
  assert len(r.stdout) == 1000


def test_nothing_is_left_behind():
  before = _leftovers()
  codes = ["import os\nos.makedirs('a/b')\nopen('a/b/f', 'w').write('x')\nos.chmod('a/b', 0o500)\nos.chmod('a', 0o500)"]
  codes += ["import os, time\nif os.fork() == 0:\n  time.sleep(30)\nprint('parent done')"]  # an orphaned child
  for code in codes:
    r = sandbox.run_python(code, timeout_s=2.0)
    assert r.error is None, r
  assert _leftovers() == before and _sandbox_processes() == 0


HOSTILE = [
  "while True: pass",
  "x = bytearray(1 << 31)",
  "import os\nwhile True:\n  try: os.fork()\n  except OSError: pass",
  "import sys\nwhile True: sys.stdout.write('z' * 4096)",
  "open('/etc/hostname_copy', 'w')",
  "raise RuntimeError('boom')",
]


def _jobs(n):
  """n jobs: every third one hostile, the others print a number derived from their index."""
  out = []
  for i in range(n):
    if i % 3 == 2:
      out.append(
        {"code": HOSTILE[(i // 3) % len(HOSTILE)], "timeout_s": 0.5, "memory_mb": 128, "max_output_bytes": 4096}
      )
    else:  # a generous limit: a loaded 2-core machine may take seconds to start a process
      out.append({"code": f"print({i} * {i} + 7)", "timeout_s": 20.0})
  return out


def _check(results, jobs):
  assert len(results) == len(jobs)
  for i, (r, job) in enumerate(zip(results, jobs)):
    assert isinstance(r, sandbox.Result), (i, r)
    if i % 3 != 2:
      assert r.stdout == f"{i * i + 7}\n" and r.exit_code == 0, (i, r)
    else:
      assert r.exit_code != 0 and not r.stdout.startswith(f"{i * i + 7}"), (i, r)


def test_executor_keeps_200_mixed_runs_with_their_calls():
  jobs = _jobs(200)
  with executor.make("local", 8) as ex:  # max_workers by position (make("ray", num_cpus=2) below: by name)
    results = ex.map(sandbox.run_job, jobs)
    failures = ex.map(sandbox.run_job, [{"code": "print(1)", "timeout_s": -1}, {"code": "print(2)"}])
  _check(results, jobs)
  assert isinstance(failures[0], executor.Failure) and "timeout_s" in failures[0].error
  assert failures[1].stdout == "2\n"
  assert _leftovers() == set() or all(time.time() - os.path.getmtime(p) > 60 for p in _leftovers())


def test_ray_executor_on_a_local_instance():
  ray = pytest.importorskip("ray")
  jobs = _jobs(12)
  with executor.make("ray", num_cpus=2) as ex:
    assert ray.is_initialized()
    results = ex.map(sandbox.run_job, jobs)
  assert not ray.is_initialized()  # the executor started the instance, so it stopped it
  _check(results, jobs)
  with pytest.raises(ValueError, match="'local' or 'ray'"):
    executor.make("slurm")
