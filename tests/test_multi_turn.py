"""Multi-turn rollouts (stepflash_jax/agents/rollout.py): turns stop at the tool-call end, tool messages join the
context with zero loss weight, and the training pass reproduces the engine's log-probs of the model's tokens."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from stepflash_jax import model as model_lib
from stepflash_jax.agents import executor
from stepflash_jax.agents.rollout import multi_turn
from stepflash_jax.agents.tools import parse_tool_calls
from stepflash_jax.data.tokenizer import load_tokenizer
from stepflash_jax.rl.batches import sequences
from stepflash_jax.sampling import RolloutEngine

P, R, TURN = 12, 40, 10  # prompt width, trajectory budget, one turn's budget


def echo_step(item):
  """A stand-in environment: reports what it parsed from the turn."""
  _, calls, errors = parse_tool_calls(item["text"])
  return {"message": f"ok {len(item['text']) % 7}", "calls": len(calls), "parse_errors": len(errors) + 1}


@pytest.fixture(scope="module")
def setup(tiny_cfg, tmp_path_factory):
  tok = load_tokenizer(str(tmp_path_factory.mktemp("tok")))
  args = model_lib.as_args(tiny_cfg)
  variables = model_lib.init(args, jax.random.key(0))
  rng = np.random.default_rng(0)
  prompts = [
    [tok.bos_id, tok.user_id] + list(rng.integers(10, 500, n)) + [tok.assistant_id] for n in (3, 5, 8, 6, 4, 9)
  ]
  return tok, args, variables, prompts


def _engine(tiny_cfg, tok, call_end):
  return RolloutEngine(
    tiny_cfg,
    max_prompt_len=P + R,
    max_new_tokens=TURN,
    eos_id=tok.eos_id,
    pad_id=tok.pad_id,
    dtype="float32",
    temperature=0.0,
    stop_ids=(call_end,),
  )


def test_turns_tool_messages_and_training_logprobs(tiny_cfg, setup):
  tok, args, variables, prompts = setup
  # the random model's most frequent greedy token plays the tool-call end, so turns end early and often
  probe = _engine(tiny_cfg, tok, tok.eos_id)
  lens = np.array([len(p) for p in prompts])
  first = jax.device_get(probe.generate(variables, _pad(prompts, P + R, tok.pad_id), lens, jax.random.key(1)))
  call_end = int(np.bincount(first["response"][first["response_mask"] > 0].ravel()).argmax())
  examples = [{"id": i} for i in range(len(prompts))]
  with executor.make("local", max_workers=4) as ex:
    gen = multi_turn(
      _engine(tiny_cfg, tok, call_end),
      variables,
      tok,
      prompts,
      examples,
      jax.random.key(2),
      step_fn=echo_step,
      executor=ex,
      max_turns=3,
      max_response=R,
      call_end_id=call_end,
    )
  own, valid = gen["response_mask"], gen["response_valid"]
  assert (gen["turns"] >= 2).any() and ((valid > 0) & (own == 0)).any()  # tool messages inside trajectories
  assert np.array_equal(gen["parse_errors"], gen["turns"] - 1)  # one per executed turn
  assert np.all(own <= valid) and np.all(gen["logp"][own == 0] == 0)
  for b in range(len(prompts)):  # every turn but the last ends at the tool-call end, followed by a tool message
    ids, o = gen["response"][b], own[b]
    ends = [t for t in range(1, int(valid[b].sum())) if o[t - 1] == 1 and o[t] == 0]
    assert len(ends) == gen["turns"][b] - 1 and all(ids[t - 1] == call_end for t in ends)
    assert all(ids[t] == tok.encode("<|tool|>")[0] for t in ends)

  # the training pass (fp32, the whole sequence at once) gives the engine's log-probs on the model's tokens
  batch = sequences(_prompt_batch(prompts, tok), gen)
  assert np.array_equal(batch["segment_ids"][:, P:], valid.astype(np.int32))
  logits = model_lib.apply(
    args,
    variables,
    jnp.asarray(batch["tokens"]),
    positions=jnp.asarray(batch["positions"]),
    segment_ids=jnp.asarray(batch["segment_ids"]),
  )["logits"]
  lp = jax.nn.log_softmax(logits[:, P - 1 : -1], -1)
  lp = np.asarray(jnp.take_along_axis(lp, jnp.asarray(batch["response"])[..., None], -1)[..., 0])
  diff = np.abs(lp - gen["logp"])[own > 0]
  assert diff.max() < 1e-5, diff.max()


def _pad(rows, width, pad_id):
  out = np.full((len(rows), width), pad_id, np.int32)
  for i, r in enumerate(rows):
    out[i, width - len(r) :] = r
  return out


def _prompt_batch(prompts, tok):
  """The prompt half of a training batch, left-padded to P."""
  lens = np.array([len(p) for p in prompts])
  seg = (np.arange(P)[None] >= P - lens[:, None]).astype(np.int32)
  return {
    "tokens": _pad(prompts, P, tok.pad_id),
    "lengths": lens,
    "segment_ids": seg,
    "positions": np.maximum(np.arange(P)[None] - (P - lens[:, None]), 0).astype(np.int32),
  }


# ------------------------------------------------------------------------- tool tokens carry no weight anywhere
def _layout(lengths, T, rng):
  """Where the compact response tokens of each row land in a multi-turn row: holes (tool tokens) of 1-3 positions
  after random model tokens. Returns positions [B, Tc] (-1 past the row's length) and the multi-turn width."""
  pos, width = [], 0
  for n in lengths:
    p, cur = [], 0
    for i in range(n):
      p.append(cur)
      cur += 1 + (rng.integers(1, 4) if rng.random() < 0.4 and i < n - 1 else 0)
    pos.append(p + [-1] * (T - n))
    width = max(width, cur + 1)
  return np.array(pos), width


def _spread(x, pos, width, rng, fill=None):
  """Compact [B, Tc] -> multi-turn [B, width]: entries moved to `pos`, garbage (or `fill`) everywhere else."""
  out = (
    rng.uniform(-50, 50, (x.shape[0], width)).astype(np.float32)
    if fill is None
    else np.full((x.shape[0], width), fill, np.float32)
  )
  for b in range(x.shape[0]):
    for i, p in enumerate(pos[b]):
      if p >= 0:
        out[b, p] = x[b, i]
  return out


def test_tool_tokens_carry_zero_weight_in_every_objective_and_the_critic():
  """Each loss over a multi-turn layout (model tokens with tool-token holes, garbage in the holes) equals the same
  loss over the model tokens alone; its gradient is zero at every hole. Same for GAE's advantages and returns."""
  from stepflash_jax.rl import advantages, losses

  rng = np.random.default_rng(0)
  B, T, lengths = 4, 8, [8, 6, 3, 0]
  mask = (np.arange(T)[None] < np.array(lengths)[:, None]).astype(np.float32)
  pos, width = _layout(lengths, T, rng)
  lr = -rng.uniform(0.1, 3.0, (B, T)).astype(np.float32)
  c = dict(logp_rollout=lr, logp_old=lr + rng.normal(0, 0.0005, (B, T)).astype(np.float32))
  c.update(logp=c["logp_old"] + rng.normal(0, 0.05, (B, T)).astype(np.float32), logp_ref=lr + 0.01)
  c.update(adv=rng.normal(0, 1, (B, T)).astype(np.float32), returns=rng.normal(0, 1, (B, T)).astype(np.float32))
  h = {k: _spread(v, pos, width, rng) for k, v in c.items()}
  h_mask = _spread(mask, pos, width, rng, fill=0.0)
  objectives = {
    "mispo": lambda a, m: losses.mispo_loss(a["logp"], a["logp_old"], a["logp_rollout"], a["adv"], m),
    "ppo": lambda a, m: losses.ppo_loss(a["logp"], a["logp_old"], a["adv"], m),
    "gspo": lambda a, m: losses.gspo_loss(a["logp"], a["logp_old"], a["logp_rollout"], a["adv"], m),
    "tis": lambda a, m: losses.tis_loss(a["logp"], a["logp_old"], a["logp_rollout"], a["adv"], m),
    "kl": lambda a, m: (losses.unbiased_kl(a["logp"], a["logp_old"], a["logp_ref"], m), {}),
    "critic": lambda a, m: losses.value_loss(a["logp"], a["returns"], m),  # logp plays the values here
  }
  for name, f in objectives.items():
    grad = lambda a, m: jax.value_and_grad(lambda lp: f({**a, "logp": lp}, m), has_aux=True)(jnp.asarray(a["logp"]))
    (l_c, m_c), g_c = grad(c, mask)
    (l_h, m_h), g_h = grad(h, h_mask)
    np.testing.assert_allclose(float(l_h), float(l_c), rtol=1e-6, err_msg=name)
    for k in m_c:
      np.testing.assert_allclose(float(m_h[k]), float(m_c[k]), rtol=1e-5, atol=1e-7, err_msg=f"{name}/{k}")
    np.testing.assert_allclose(
      _spread(np.asarray(g_c), pos, width, rng, fill=0.0), np.asarray(g_h), rtol=1e-5, atol=1e-8, err_msg=name
    )

  # GAE (gamma = lambda = 1 and a discounting case): the values' targets and advantages skip the holes
  values = rng.normal(0, 1, (B, T + 1)).astype(np.float32)
  rewards = advantages.place_terminal_reward(jnp.asarray(rng.normal(0, 1, B), jnp.float32), mask)
  h_values = rng.uniform(-50, 50, (B, width + 1)).astype(np.float32)
  for b in range(B):
    for i in range(lengths[b]):
      h_values[b, pos[b, i]] = values[b, i]
    h_values[b, pos[b, lengths[b] - 1] + 1 if lengths[b] else 0] = values[b, lengths[b]]  # V(s_n)
  h_rewards = _spread(np.asarray(rewards), pos, width, rng)
  for gamma, lam, boot in ((1.0, 1.0, None), (0.9, 0.8, np.array([1, 0, 1, 0]))):
    a_c, r_c = advantages.gae_advantages(rewards, values, mask, gamma, lam, boot)
    a_h, r_h = advantages.gae_advantages(h_rewards, h_values, h_mask, gamma, lam, boot)
    np.testing.assert_allclose(
      np.asarray(a_h), _spread(np.asarray(a_c), pos, width, rng, fill=0.0), rtol=1e-5, atol=1e-6
    )
    np.testing.assert_allclose(
      np.asarray(r_h), _spread(np.asarray(r_c), pos, width, rng, fill=0.0), rtol=1e-5, atol=1e-6
    )
