"""Learned rewards: the preference task's gold scorer, the BT model and the GenRM against direct computations, the
win rate with its length penalty, Bradley-Terry labels, the label ceiling, training with exact restore, config
checks."""

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest

from stepflash_jax import model as model_lib
from stepflash_jax import parallel
from stepflash_jax.data import load_tokenizer, tasks
from stepflash_jax.data.tasks import pref
from stepflash_jax.rl import reward_models as rm
from stepflash_jax.rl import reward_training as rt
from stepflash_jax.rl import rewards
from stepflash_jax.rl.critic import critic_from_actor

FAMILIES = ("arithmetic", "countdown", "pref")


@pytest.fixture(scope="module")
def tok():
  return load_tokenizer(vocab_size=512, families=FAMILIES)


@pytest.fixture(scope="module")
def lm(tiny_cfg):
  return model_lib.init(tiny_cfg, jax.random.key(0))


def test_pref_task_styles_share_problems_and_gold_ranks_them():
  ex = {v: tasks.generate("pref", 5, 4, variant=v) for v in pref.VARIANTS}
  assert len({e["prompt"] for e in ex.values()}) == 1  # every variant: the same problem
  nums = ex["steps"]["metadata"]["numbers"]
  assert ex["steps"]["prompt"] == "Add " + " ".join(map(str, nums)) and len(nums) == 4
  total = sum(nums)
  assert ex["short"]["answer"] == str(total)
  assert ex["steps"]["answer"] == pref.reference(ex["steps"]) and ex["steps"]["answer"].endswith(f"</think>{total}")
  g = {s: pref.gold(ex[s], ex[s]["answer"]) for s in pref.STYLES}
  pads = ex["padded"]["answer"].count(pref.RECHECK)
  assert g == {"short": 1.0, "steps": 1.5, "padded": pytest.approx(1.5 - 0.15 * pads)} and 1 <= pads <= 3
  assert pref.gold(ex["steps"], ex["steps"]["answer"].replace(f"</think>{total}", f"</think>{total + 1}")) == 0.0
  # a chain with a wrong running sum and the right answer: no bonus
  bad = ex["steps"]["answer"].replace(pref.chain(nums)[0], pref.chain(nums)[0] + "1")
  assert pref.gold(ex["steps"], bad) == 1.0
  styles = [tasks.generate("pref", s, 3)["answer"] for s in range(400)]
  short = np.mean(["</think>" not in a for a in styles])
  assert abs(short - pref.STYLE_WEIGHTS[0]) < 0.07  # the mixed teacher's style frequencies


def test_win_rate_and_length_penalty_known_values():
  c = np.array([0.5, 0.8, 0.8, 0.8])
  got = rm.win_rate(c, [10, 10, 15, 20], np.array([10, 20, 10, 10.0]), length_penalty=1.0)
  logit = np.log(0.8 / 0.2)
  want = [0.5, 0.8, 1 / (1 + np.exp(-(logit - 0.5))), 1 / (1 + np.exp(-(logit - 1.0)))]
  np.testing.assert_allclose(got, want, rtol=1e-9)
  np.testing.assert_allclose(rm.win_rate(c, [40] * 4, np.full(4, 10.0), 0.0), c)  # penalty off
  assert rm.win_rate([1.0], [10], np.array([10.0]), 1.0)[0] < 1.0  # clipped: a finite logit


def test_bt_scores_and_loss_match_the_value_head(tiny_cfg, lm):
  critic = critic_from_actor(lm)
  head = critic["params"]["value_head"]["kernel"]
  critic["params"]["value_head"]["kernel"] = head + 0.1 * jax.random.normal(jax.random.key(1), head.shape)
  args = model_lib.as_args(tiny_cfg)
  tokens = jax.random.randint(jax.random.key(2), (4, 12), 4, 500)
  lengths = jnp.array([12, 7, 3, 9])
  values = model_lib.apply(args, critic, tokens, head="value")["values"]
  want = values[jnp.arange(4), lengths - 1]
  np.testing.assert_allclose(rm.bt_scores(args, critic, tokens, lengths), want, rtol=1e-5, atol=1e-6)
  loss, m = rm.bt_loss(critic["params"], critic["router"], {"tokens": tokens, "lengths": lengths}, args)
  rc, rr = np.asarray(want[:2], np.float64), np.asarray(want[2:], np.float64)
  np.testing.assert_allclose(loss, np.mean(np.log1p(np.exp(-(rc - rr)))), rtol=1e-5)
  assert float(m["accuracy"]) == np.mean(rc > rr)


def test_verdict_logprobs_match_forward_logits(tiny_cfg, lm, tok):
  args = model_lib.as_args(tiny_cfg)
  ids = rm.verdict_ids(tok)
  tokens = jax.random.randint(jax.random.key(3), (3, 10), 4, 500)
  lengths = jnp.array([10, 4, 6])
  logits = model_lib.forward(tiny_cfg, lm, tokens)  # independent: the full [B, T, V] logits
  want = jax.nn.log_softmax(logits[jnp.arange(3), lengths - 1].astype(jnp.float32), -1)[:, ids]
  got = rm.verdict_logprobs(args, lm, tokens, lengths, jnp.asarray(ids))
  np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
  label = jnp.array([0, 1, 1])
  loss, _ = rm.genrm_loss(lm["params"], lm["router"], {"tokens": tokens, "lengths": lengths, "label": label}, args, ids)
  np.testing.assert_allclose(loss, -np.mean(np.asarray(want)[np.arange(3), label]), rtol=1e-5)


def test_learned_reward_unparsed_and_batched(tiny_cfg, lm, tok):
  exs = [tasks.generate("pref", s, 3) for s in range(5)]
  comps = [e["answer"] for e in exs]
  comps[1] = "9" * 300  # longer than the judge's template width
  genrm = rm.LearnedReward("genrm", tiny_cfg, lm, tok, max_len=120, batch_size=4, length_penalty=1.0)
  out = genrm.score_batch(exs, comps)
  # a random LM puts ~2/512 of its mass on the two verdict tokens: no verdict anywhere, reward 0, counted
  assert out["unparsed"].all() and (out["reward"] == 0).all()
  lax = rm.LearnedReward("genrm", tiny_cfg, lm, tok, max_len=120, batch_size=4, length_penalty=1.0, min_verdict_mass=0)
  out = lax.score_batch(exs, comps)
  np.testing.assert_array_equal(out["unparsed"], [False, True, False, False, False])
  assert np.all((out["confidence"] > 0) & (out["confidence"] < 1))
  scored = rewards.score_batch(genrm, exs, comps, filters=("format",))
  assert scored["zeroed"]["unparsed"].sum() == 5 and (scored["reward"] == 0).all()
  critic = critic_from_actor(lm)
  bt = rm.LearnedReward("bt", tiny_cfg, critic, tok, max_len=64, batch_size=4, length_penalty=0.0)
  out = bt.score_batch(exs, comps)
  np.testing.assert_array_equal(out["unparsed"], [False, True, False, False, False])
  # a zero value head scores everything 0: the candidate equals the reference, win rate 1/2
  np.testing.assert_allclose(out["reward"][[0, 2, 3, 4]], 0.5)
  with pytest.raises(ValueError, match="kind"):
    rm.LearnedReward("judge", tiny_cfg, lm, tok, max_len=64, batch_size=4, length_penalty=0.0)


def test_bt_labels_and_ceiling():
  rng = np.random.default_rng(0)
  ga, gb = np.zeros(20000), np.full(20000, 0.25)
  assert abs(rt.bt_label(ga, gb, 0.25, rng).mean() - 1 / (1 + np.exp(-1))) < 0.01  # sigmoid(0.25 / 0.25)
  np.testing.assert_array_equal(rt.bt_label([0.0, 1.5], [1.0, 0.0], 0.0, rng), [1, 0])  # tau 0: the gold order
  recs = [
    dict(gold_a=0.0, gold_b=1.0, label=1),
    dict(gold_a=1.5, gold_b=1.0, label=1),  # a noisy label
    dict(gold_a=1.0, gold_b=1.0, label=0),  # a tie: left out
    dict(gold_a=1.2, gold_b=0.0, label=0),
  ]
  assert rt.ceiling(recs) == pytest.approx(2 / 3)


def test_greedy_eval_scores_gold_over_the_gold_families_only():
  """The eval's greedy_gold (the pipeline's preference column): the mean gold score over the examples whose family
  has a gold scorer, here steps 1.5 and a bare right sum 1.0; an arithmetic example adds accuracy but no gold."""
  from stepflash_jax.train import evaluate

  exs = [pref.make_example([3, 4, 5], 3, "steps"), pref.make_example([3, 4, 5], 3, "short")]
  exs.append(tasks.generate("arithmetic", 0, 3, variant="+"))

  class Tok:  # response row b decodes to example b's demonstration
    def decode(self, row, stop_at_eos=True):
      return exs[int(row[0])]["answer"]

  out = evaluate._score(Tok(), [exs], [{"response": np.arange(3)[:, None], "truncated": np.zeros(3, bool)}])
  assert out["greedy_gold"] == pytest.approx(1.25) and out["accuracy"] == 1.0
  out = evaluate._score(Tok(), [exs[2:]], [{"response": np.array([[2]]), "truncated": np.zeros(1, bool)}])
  assert "greedy_gold" not in out


def test_gold_metrics_win_rate_counts_ties_half():
  from stepflash_jax.train.evaluate import gold_metrics

  got = gold_metrics(np.array([1.0, 0.0, 1.5, 0.0]), np.array([0.0, 0.0, 1.5, 1.0]))
  assert got == {"gold": pytest.approx(0.625), "win_rate_vs_sft": pytest.approx((1 + 0.5 + 0.5 + 0) / 4)}
  assert gold_metrics(None, None) == {}


def _config(tiny_cfg, **rm_fields):
  c = ml_collections.ConfigDict()
  c.seed, c.model = 0, tiny_cfg
  c.data = dict(mixture="pref:3", max_prompt_len=16, tokenizer_families=FAMILIES)
  c.optim = dict(
    muon_method="polar_express",
    ortho_dtype="float16",
    weight_decay=0.1,
    grad_clip=1.0,
    warmup_frac=0.1,
    end_lr_frac=0.5,
  )
  c.train = dict(log_every=100, checkpoint_every=3)
  c.rl = dict(reward="bt", max_new_tokens=24, rollout_dtype="float32", reward_filters=("format",))
  c.reward_model = dict(
    train=("bt",),
    label_tau=0.25,
    train_prompts=8,
    test_prompts=4,
    sample_batch=16,
    steps=3,
    batch_size=4,
    lr=dict(bt=1e-3, genrm=1e-3),
    max_len=96,
    score_batch=8,
    length_penalty=1.0,
    min_verdict_mass=0.5,
  )
  c.reward_model.update(rm_fields)
  return c


def test_bt_training_learns_resumes_exactly_and_a_finished_model_is_restored(tiny_cfg, lm, tok, tmp_path):
  import shutil

  c = _config(tiny_cfg, steps=6)
  exs = [tasks.generate("pref", s, 3, variant="steps") for s in range(8)]
  # chosen = the reasoned answer, rejected = a wrong bare number: separable by length alone
  recs = [
    dict(example=e, a=str(sum(e["metadata"]["numbers"]) + 1), b=e["answer"], gold_a=0.0, gold_b=1.5, label=1)
    for e in exs
  ]
  mesh, rules = parallel.make_mesh(dict(data=1, fsdp=1, expert=1, context=1, tensor=1)), parallel.rules()
  d = str(tmp_path / "bt")
  train = lambda: rt.train(c, "bt", d, lm, tok, recs, mesh, rules, log=lambda *_: None)
  same = lambda x, y: jax.tree.all(jax.tree.map(lambda a, b: bool(jnp.array_equal(a, b)), x, y))
  with parallel.use_mesh(mesh, rules):
    v = train()
    assert same(v, train())  # finished: restored, not retrained
    shutil.rmtree(tmp_path / "bt" / "checkpoints" / "6")  # as if killed after the checkpoint of step 3
    assert same(v, train())  # resumed at step 3 with the same batches: the same model
  assert rt.heldout_accuracy(rt.learned_reward(c, "bt", v, tok), recs) == 1.0
  rows = rt.read_jsonl(str(tmp_path / "bt" / "metrics_reward_bt.jsonl"))
  assert [r["step"] for r in rows] == list(range(1, 7)) and rows[-1]["loss"] < rows[0]["loss"]


def test_check_config_names_the_field(tiny_cfg):
  rt.check_config(_config(tiny_cfg))
  bad = [
    (dict(rl=dict(reward="judge")), "rl.reward"),
    (dict(rl=dict(reward_filters=("nope",))), "rl.reward_filters"),
    (dict(rl=dict(rubric_mapping={"satisfied": 1.0})), "rl.rubric_mapping"),
    (dict(rl=dict(reward="rule", family_rewards={"pref": "judge"})), "rl.family_rewards.pref"),
    (dict(rl=dict(reward="rule", family_rewards={"prefs": "bt"})), "rl.family_rewards"),
    (dict(rl=dict(reward="rule", family_rewards={"pref": "genrm"})), "reward_model.train"),
    (dict(reward_model=dict(train=("genrm",))), "reward_model.train"),
    (dict(reward_model=dict(steps=0)), "reward_model.steps"),
    (dict(reward_model=dict(lr=dict(bt=0.0, genrm=1e-3))), "reward_model.lr.bt"),
    (dict(reward_model=dict(batch_size=64)), "reward_model.batch_size"),
    (dict(reward_model=dict(label_tau=-1.0)), "reward_model.label_tau"),
    (dict(reward_model=dict(min_verdict_mass=2.0)), "reward_model.min_verdict_mass"),
    (
      dict(reward_model=dict(train=("bt", "genrm")), data=dict(tokenizer_families=("arithmetic",))),
      "data.tokenizer_families",
    ),
  ]
  for override, field in bad:
    c = _config(tiny_cfg)
    for section, fields in override.items():
      c[section].update(fields)
    with pytest.raises(ValueError, match=f"'{field}'"):
      rt.check_config(c)


def test_shipped_configs_pass_the_checks():
  from configs import mispo, preference
  from stepflash_jax.train.validate import validate_run_config

  for c in (preference.get_config(""), preference.get_config("small"), mispo.get_config("small")):
    validate_run_config(c, num_devices=1)
    rt.check_config(c)
