"""Calls for tests/test_processes.py's spawned processes (module-level: a spawned process imports them by name),
and `alive` for the tests that check a process died.

As a script (`python process_worker.py DIR`): a job that runs side_by_side([sleep here, write_pid_and_sleep
there]), to be killed with -9 by the test.
"""

import os
import sys
import time


def alive(pid: int) -> bool:
  """A process that exists and is not a zombie (an orphan's zombie may wait for a non-reaping init); Linux."""
  try:
    with open(f"/proc/{pid}/stat") as f:
      return f.read().rsplit(")", 1)[1].split()[0] not in "ZX"
  except FileNotFoundError:
    return False


def write_pid(path: str) -> None:
  with open(path + ".tmp", "w") as f:
    f.write(str(os.getpid()))
  os.replace(path + ".tmp", path)


def write_pid_and_sleep(path: str, seconds: float) -> None:
  write_pid(path)
  time.sleep(seconds)


def fail(message: str) -> None:
  raise ValueError(message)


if __name__ == "__main__":
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  from stepflash_jax.parallel import side_by_side

  side_by_side([(time.sleep, (120,)), (write_pid_and_sleep, (os.path.join(sys.argv[1], "child"), 120))])
