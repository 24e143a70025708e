"""The MTP, EAGLE-3 and DFlash losses train on the positions a row's `loss_mask` marks: on a chat row
with two assistant turns (user, assistant, user, assistant, then a trailing user turn), exactly the
assistant tokens are learned. The user turns are not: changing the trailing user turn leaves the loss
as it is (under `p + 1 >= prompt_lens` those tokens were learned), changing an assistant token
changes it, and the positions / blocks counted are the assistant ones only. A batch without
`loss_mask` (rows built by hand, shards written before masks) learns the response after prompt_lens."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import TINY_LLAMA
from specjax.train.shards import response_mask

L = 24
SPANS = {"user1": (0, 4), "assistant1": (4, 8), "user2": (8, 12), "assistant2": (12, 17), "user3": (17, 22)}
LENS = 22


def _row(seed: int = 0) -> dict:
  tokens = np.random.default_rng(seed).integers(1, TINY_LLAMA.vocab_size, (1, L)).astype(np.int32)
  mask = np.zeros((1, L), bool)
  for name in ("assistant1", "assistant2"):
    mask[0, slice(*SPANS[name])] = True
  return {"tokens": tokens, "lens": np.asarray([LENS], np.int32),
          "prompt_lens": np.asarray([SPANS["assistant1"][0]], np.int32), "loss_mask": mask}


def _changed(batch: dict, span: str) -> dict:
  tokens = batch["tokens"].copy()
  lo, hi = SPANS[span]
  tokens[0, lo:hi] = tokens[0, lo:hi] % (TINY_LLAMA.vocab_size - 1) + 1          # ids 1..15, each another
  assert (tokens[0, lo:hi] != batch["tokens"][0, lo:hi]).all()
  return {**batch, "tokens": tokens}


def _mtp(params):
  from specjax.train.mtp import LossConfig, make_loss_fn
  from specjax.drafters.mtp import init_heads
  fn = make_loss_fn(TINY_LLAMA, LossConfig(n_steps=2, batch_size=1, loss="kl"), 1, jnp.dtype("float32"))
  heads = init_heads(TINY_LLAMA, 1, seed=1, init="random")
  return lambda batch: fn(heads, params, batch, jax.random.key(0))


def _eagle3(params):
  from specjax.drafters.eagle3 import Eagle3Config, build_d2t, init_head
  from specjax.train.eagle3 import Eagle3LossConfig, make_loss_fn
  v = TINY_LLAMA.vocab_size
  hc = Eagle3Config.make(TINY_LLAMA, v)
  d2t = build_d2t([np.arange(v)], v, v)
  fn = make_loss_fn(hc, Eagle3LossConfig(n_steps=2, batch_size=1), jnp.dtype("float32"))
  hp = init_head(hc, 1, target_params=params, d2t=d2t)
  return lambda batch: fn(hp, {"target": params, "d2t": jnp.asarray(d2t)}, batch, jax.random.key(0))


def _dflash(params):
  from specjax.drafters.dflash import DFlashConfig, init_dflash
  from specjax.train.dflash import LossConfig, make_loss_fn
  dc = DFlashConfig(taps=(0, 1), n_layers=1, block_size=4, window=8)
  fn = make_loss_fn(TINY_LLAMA, dc, LossConfig(anchors_per_row=16, batch_size=1, loss="kl"), jnp.dtype("float32"))
  dp = init_dflash(TINY_LLAMA, dc, seed=1, target_params=params)
  return lambda batch: fn(dp, params, batch, jax.random.key(0))


HEADS = {"mtp": _mtp, "eagle3": _eagle3, "dflash": _dflash}
# positions counted: MTP / EAGLE-3 `tokens`, the p whose next token is learned (assistant tokens but
# the first of the row's learned span at position 0: none here); DFlash `blocks`, the anchors a >= 1
# with tokens a and a + 1 both learned
COUNTED = {"mtp": ("tokens", 4 + 5), "eagle3": ("tokens", 4 + 5), "dflash": ("blocks", 3 + 4)}


@pytest.mark.parametrize("head", list(HEADS))
def test_chat_row_learns_exactly_the_assistant_turns(head, tiny_llama):
  _, params = tiny_llama
  loss = jax.jit(HEADS[head](params))
  batch = _row()
  base, metrics = loss(batch)
  key, n = COUNTED[head]
  assert float(metrics[key]) == n                   # user turns (user2 between the answers included) not counted
  same, _ = loss(_changed(batch, "user3"))          # tokens past the last answer: learned by no position
  np.testing.assert_allclose(float(same), float(base), rtol=1e-6)
  other, _ = loss(_changed(batch, "assistant2"))
  assert abs(float(other) - float(base)) > 1e-4
  # rows without a mask learn prompt_lens <= p < lens: here user2 and user3 too
  old = {k: v for k, v in batch.items() if k != "loss_mask"}
  with_mask = {**old, "loss_mask": response_mask(old["lens"], old["prompt_lens"], L)}
  np.testing.assert_allclose(float(loss(old)[0]), float(loss(with_mask)[0]), rtol=1e-6)
  assert float(loss(old)[1][key]) > n
