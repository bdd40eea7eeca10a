"""parallel.side_by_side: the first call in this process, the others in spawned processes that die with it;
parallel.beside: a spawned process for the time of a with-block."""

import os
import signal
import subprocess
import sys
import time

import process_worker
import pytest

from stepflash_jax.parallel import beside, side_by_side


def _wait_for(path, timeout: float = 60.0) -> int:
  deadline = time.time() + timeout
  while not os.path.exists(path) and time.time() < deadline:
    time.sleep(0.05)
  return int(open(path).read())


def _gone(pid: int, timeout: float = 10.0) -> bool:
  deadline = time.time() + timeout
  while process_worker.alive(pid) and time.time() < deadline:
    time.sleep(0.05)
  return not process_worker.alive(pid)


def test_the_first_call_runs_here_the_others_each_in_a_process_of_its_own(tmp_path):
  paths = [str(tmp_path / str(i)) for i in range(3)]
  side_by_side([(process_worker.write_pid, (p,)) for p in paths])
  pids = [int(open(p).read()) for p in paths]
  assert pids[0] == os.getpid() and len(set(pids)) == 3


def test_a_failed_process_is_an_error_after_the_others_finished(tmp_path):
  done = str(tmp_path / "here")
  with pytest.raises(RuntimeError, match=r"call\(s\) \[2\] failed"):
    side_by_side([(process_worker.write_pid, (done,)), (time.sleep, (0.1,)), (process_worker.fail, ("bad",))])
  assert os.path.exists(done)


@pytest.mark.skipif(not os.path.exists("/proc/self/stat"), reason="reads process states from /proc")
def test_a_failure_here_kills_the_processes(tmp_path):
  child = str(tmp_path / "child")

  def fail_after_child_started():
    _wait_for(child)
    raise KeyError("here")

  with pytest.raises(KeyError, match="here"):
    side_by_side([(fail_after_child_started, ()), (process_worker.write_pid_and_sleep, (child, 120))])
  assert _gone(int(open(child).read()))


@pytest.mark.skipif(not os.path.exists("/proc/self/stat"), reason="reads process states from /proc")
def test_the_processes_die_with_a_killed_caller(tmp_path):
  job = subprocess.Popen([sys.executable, process_worker.__file__, str(tmp_path)])
  try:
    pid = _wait_for(str(tmp_path / "child"))
    assert process_worker.alive(pid)
    job.send_signal(signal.SIGKILL)
    job.wait()
    assert _gone(pid), "the spawned process outlived the kill -9 of its caller"
  finally:
    job.kill()


@pytest.mark.skipif(not os.path.exists("/proc/self/stat"), reason="reads process states from /proc")
def test_beside_runs_during_the_block_and_is_killed_at_its_end(tmp_path):
  child = str(tmp_path / "child")
  with beside(process_worker.write_pid_and_sleep, (child, 120)) as proc:
    pid = _wait_for(child)
    assert pid == proc.pid != os.getpid() and process_worker.alive(pid)
  assert _gone(pid, timeout=1.0)


def test_a_failure_beside_is_no_error(tmp_path):
  with beside(process_worker.fail, ("bad",)) as proc:
    proc.join(60)
  assert proc.exitcode == 1
