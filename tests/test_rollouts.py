"""The rollout queue (rl/rollouts.py): which actor samples which generation, background vs in-turn sampling, and a
checkpoint that queues the same jobs again."""

import threading

import pytest

from stepflash_jax.rl.rollouts import RolloutQueue


class Stream:
  """A prompt stream with grain's iterator state: batch i is {"i": i}."""

  def __init__(self):
    self.i = 0

  def __next__(self):
    self.i += 1
    return {"i": self.i - 1}

  def get_state(self):
    return {"i": self.i}

  def set_state(self, state):
    self.i = state["i"]


def run(steps, s, background, start=0, behind=None, data=None, stop=None):
  """A trainer loop whose 'actor' of generation g is the string f"actor{g}": returns [(generation, actor that
  sampled it, prompt batch, sampling thread)], and the queue's checkpoint after `stop` generations."""
  data = data or Stream()
  sample = lambda policy, prompts, index: dict(policy=policy, prompts=prompts["i"], thread=threading.get_ident())
  queue = RolloutQueue(sample, data, s, background=background)
  queue.start(start, steps, behind if behind is not None else ["actor0"] * s)
  seen, ckpt = [], None
  try:
    for step in range(start, stop or steps):
      queue.advance(step, steps, f"actor{step}")
      prompts, gen, version = queue.take(step)
      assert gen["prompts"] == prompts["i"] and gen["sample_seconds"] >= 0
      seen.append((step, gen["policy"], version, prompts["i"], gen["thread"]))
    ckpt = queue.checkpoint()
  finally:
    queue.close()
  return seen, ckpt


@pytest.mark.parametrize("s", [0, 1, 2])
def test_generation_j_is_sampled_by_the_actor_of_j_minus_s(s):
  sync, _ = run(6, s, background=False)
  assert [(g, p, v, i) for g, p, v, i, _ in sync] == [(j, f"actor{max(0, j - s)}", max(0, j - s), j) for j in range(6)]
  assert {t for *_, t in sync} == {threading.get_ident()}
  if s:  # background: the same jobs, in another thread
    bg, _ = run(6, s, background=True)
    assert [x[:4] for x in bg] == [x[:4] for x in sync]
    assert threading.get_ident() not in {t for *_, t in bg}


@pytest.mark.parametrize("background", [False, True])
def test_a_checkpoint_queues_the_same_jobs_again(background):
  """Stop after 3 of 5 generations (a run of 3 steps, or of 5 interrupted), resume to 5: the same actors and
  prompts as one uninterrupted run of 5."""
  full, _ = run(5, 2, background)
  for steps in (3, 5):
    data = Stream()
    first, (behind, data_state) = run(steps, 2, background, data=data, stop=3)
    assert behind == ["actor1", "actor2"]  # generations 3 and 4 are sampled by them
    data.set_state(data_state)
    rest, _ = run(5, 2, background, start=3, behind=behind, data=data)
    assert [x[:4] for x in first + rest] == [x[:4] for x in full]


def test_bad_arguments_are_named():
  with pytest.raises(ValueError, match="max_staleness"):
    RolloutQueue(lambda *a: {}, Stream(), -1)
  with pytest.raises(ValueError, match="need 2 actors"):
    RolloutQueue(lambda *a: {}, Stream(), 2).start(0, 4, ["actor0"])
  queue = RolloutQueue(lambda *a: {}, Stream(), 1)
  queue.start(0, 4, ["actor0"])
  with pytest.raises(RuntimeError, match=r"take\(1\): queued generations are \[0\]"):
    queue.take(1)
