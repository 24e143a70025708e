"""The law of the first sampled tokens: the chi-square check that speculative sampling keeps plain
sampling's token law, shared by the engine, drafter and target-kind tests.

Many copies of STAT_PROMPT are sampled, each row with its own seed, with and without speculation.
The exact joint law P(t1, t2, t3) [V, V, V] of the first three new tokens comes from the target's
shaped next-token distributions at every two-token continuation of the prompt. The speculative
sample must fit it and agree with the plain sample (p >= P_PASS), the plain sample must fit it too,
and plain samples drawn at temperature 0.7 must be rejected (p < P_FAIL): the statistic has power.

Two batch layouts: all rows sampled (`SamplingParams.make(n, seed=..., **shape)`), or a mixed batch
of N_GREEDY greedy rows followed by sampled ones (`mixed_sampling`), whose sampled rows are
`tokens[N_GREEDY:]`.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from conftest import chi2_gof, chi2_two_sample, jit_forward
from specjax.engine.sampling import SamplingParams, shaped_probs
from specjax.models.kv_cache import KVCache

STAT_PROMPT = [3, 1, 4, 1, 5]
STAT_NEW = 3                                          # leading new tokens whose joint law is tested
P_PASS = 1e-4                                         # a sample that keeps the law passes at this p
P_FAIL = 1e-12                                        # a sample from another law fails at this p
MIXED_SHAPE = dict(temperature=1.0, top_k=5, top_p=0.9)   # the sampled rows of a mixed batch
N_GREEDY = 3                                          # greedy rows at the head of a mixed batch
COLD_TEMPERATURE = 0.7                                # the power check's other law


def exact_joint_law(logits_of, v: int, sampling_kw: dict) -> np.ndarray:
  """P(t1, t2, t3) [V, V, V] of plain sampling after STAT_PROMPT with `sampling_kw` (temperature,
  top_k, top_p). `logits_of(seqs)` maps int32 sequences [V * V, n + 2] (the prompt, then t1, t2) to
  the target's logits [V * V, n + 2, V]."""
  n = len(STAT_PROMPT)
  t1, t2 = np.meshgrid(np.arange(v), np.arange(v), indexing="ij")
  seqs = np.concatenate([np.broadcast_to(STAT_PROMPT, (v * v, n)), t1.reshape(-1, 1), t2.reshape(-1, 1)], 1)
  logits = logits_of(jnp.asarray(seqs, jnp.int32))                                  # [V * V, n + 2, V]
  probs = np.asarray(shaped_probs(logits[:, n - 1:], SamplingParams.make(v * v, **sampling_kw)), np.float64)
  p1 = probs[0, 0]                          # [V]
  p2 = probs[::v, 1]                        # [V(t1), V]
  p3 = probs[:, 2].reshape(v, v, v)         # [t1, t2, V]
  return p1[:, None, None] * p2[:, :, None] * p3


def decoder_law(params, cfg, sampling_kw: dict = MIXED_SHAPE) -> np.ndarray:
  """`exact_joint_law` of a decoder target (`specjax.models.decoder.forward`, jitted)."""
  return exact_joint_law(lambda seqs: jit_forward(params, cfg, seqs, KVCache.init(cfg, *seqs.shape))[0],
                         cfg.vocab_size, sampling_kw)


def joint_counts(tokens, v: int) -> np.ndarray:
  """Counts [V ** 3] of the first STAT_NEW tokens of every row, at (t1 * V + t2) * V + t3."""
  a = np.asarray([t[:STAT_NEW] for t in tokens])
  assert a.shape == (len(tokens), STAT_NEW), a.shape
  return np.bincount((a[:, 0] * v + a[:, 1]) * v + a[:, 2], minlength=v ** 3).astype(np.float64)


def mixed_sampling(n_seq: int, first_seed: int, temperature: float = MIXED_SHAPE["temperature"]) -> SamplingParams:
  """A mixed batch: N_GREEDY greedy rows, then n_seq rows at `temperature` with MIXED_SHAPE's top-k /
  top-p; row i has seed first_seed + i."""
  n = N_GREEDY + n_seq
  return SamplingParams.make(n, temperature=[0.0] * N_GREEDY + [temperature] * n_seq, top_k=MIXED_SHAPE["top_k"],
                             top_p=MIXED_SHAPE["top_p"], seed=list(range(first_seed, first_seed + n)))


def check_token_law(exact: np.ndarray, v: int, spec_tokens, plain_tokens, cold_tokens=None, *,
                    plain_fits: bool = True, what: str = "speculative sampling") -> dict[str, float]:
  """Chi-square checks of the sampled rows against `exact` [V, V, V]: the plain sample fits it (when
  `plain_fits`), the speculative sample fits it and agrees with the plain one (p >= P_PASS), and the
  sample drawn at COLD_TEMPERATURE, when given, does not fit it (p < P_FAIL). Prints the p-values,
  then asserts; returns them."""
  c_spec, c_plain = joint_counts(spec_tokens, v), joint_counts(plain_tokens, v)
  p = {}
  if plain_fits:
    _, df_plain, p["plain"] = chi2_gof(c_plain, exact)
  _, df_spec, p["spec"] = chi2_gof(c_spec, exact)
  _, df_two, p["two"] = chi2_two_sample(c_spec, c_plain)
  if cold_tokens is not None:
    _, _, p["cold"] = chi2_gof(joint_counts(cold_tokens, v), exact)
  print(f"{what}: " + ", ".join(f"p({k}) {x:.3g}" for k, x in p.items()))
  if plain_fits:
    assert p["plain"] >= P_PASS, f"plain sampling does not fit its own exact law (p={p['plain']:.3g}, df={df_plain})"
  assert p["spec"] >= P_PASS, f"{what} changed the token law (p={p['spec']:.3g}, df={df_spec})"
  assert p["two"] >= P_PASS, f"{what} and plain sampling disagree (p={p['two']:.3g}, df={df_two})"
  if cold_tokens is not None:
    assert p["cold"] < P_FAIL, f"the statistic cannot tell temperature {COLD_TEMPERATURE} from 1.0 (p={p['cold']:.3g})"
  return p
