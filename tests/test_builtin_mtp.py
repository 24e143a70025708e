"""A Qwen3.5 checkpoint's own MTP layers (`mtp.*`) as the `mtp` speculator, with no head file.

The checkpoint: a tiny Qwen3.5 text model saved by transformers itself (`save_pretrained`), plus
the MTP tensors transformers does not model (it drops `^mtp.*` on load), written into its
model.safetensors under the key names vLLM's loader reads
(vllm/model_executor/models/qwen3_5_mtp.py, Qwen3_5MultiTokenPredictor: `mtp.fc`,
`mtp.pre_fc_norm_embedding`, `mtp.pre_fc_norm_hidden`, `mtp.layers.0.*` a full-attention
Qwen3_5DecoderLayer, `mtp.norm`), and `mtp_num_hidden_layers` in its config.json as Qwen3.5's has.

The oracle for what the layer computes is that forward in torch with transformers' own modules:
Qwen3_5TextModel with one full-attention layer is the layer plus `mtp.norm`, Qwen3_5RMSNorm the
pre-fc norms, the target's embedding and LM head around them, fed the target's normed hidden state.

Checked: the layers load from the target's folder (`api.generate(..., speculator="mtp")` with no
head); their next-token probabilities over a sequence and a whole recursive draft equal the torch
forward's; speculative greedy output equals plain greedy output (both rollback modes); a folder
without `mtp.*` tensors, or a GGUF target, is one UserError that says why.
"""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import randomize_hf_
from specjax import api
from specjax.drafters.base import DraftContext, DraftParams
from specjax.drafters.mtp import MTPDrafter, apply_head
from specjax.drafters.mtp_reference import builtin_layers
from specjax.drafters.registry import make_speculator
from specjax.engine.decode import generate_plain
from specjax.errors import UserError
from specjax.models import hybrid
from specjax.models.hybrid import hybrid_forward
from specjax.models.load import LoadedModel, load_model
from specjax.models.recurrent_state import HybridState

V, D = 24, 32
PROMPTS = [[3, 1, 4, 1, 5, 9, 2, 6], [2, 7, 1, 8, 2, 8], [5, 5, 5, 1, 2, 3, 5, 5, 5, 1]]
MAX_NEW = 24
K = 3


def _text_config(**kw):
  from transformers import Qwen3_5TextConfig
  fields = dict(vocab_size=V, hidden_size=D, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
                num_key_value_heads=2, head_dim=8, linear_conv_kernel_dim=4, linear_key_head_dim=8,
                linear_value_head_dim=8, linear_num_key_heads=2, linear_num_value_heads=4, rms_norm_eps=1e-6,
                layer_types=["linear_attention", "full_attention", "linear_attention"], tie_word_embeddings=False,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5})
  return Qwen3_5TextConfig(**{**fields, **kw})


class TorchMTP:
  """The MTP forward of vLLM's Qwen3_5MultiTokenPredictor in torch, from transformers' modules."""

  def __init__(self, seed: int):
    import torch
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5RMSNorm, Qwen3_5TextModel
    torch.manual_seed(seed)
    self.trunk = Qwen3_5TextModel(_text_config(num_hidden_layers=1, layer_types=["full_attention"])).float().eval()
    self.fc = torch.nn.Linear(2 * D, D, bias=False)
    self.pre_e, self.pre_h = Qwen3_5RMSNorm(D, eps=1e-6), Qwen3_5RMSNorm(D, eps=1e-6)
    self.modules = torch.nn.ModuleDict({"trunk": self.trunk, "fc": self.fc, "pre_e": self.pre_e, "pre_h": self.pre_h})
    randomize_hf_(self.modules, seed=seed)
    with torch.no_grad():
      # mostly a copy of the hidden state through quiet residual branches: the layer drafts the
      # target's own next token again, right often enough on these prompts to accept part of a draft
      self.fc.weight.mul_(0.1)[:, D:].add_(torch.eye(D))
      layer = self.trunk.layers[0]
      layer.self_attn.o_proj.weight.mul_(0.2)
      layer.mlp.down_proj.weight.mul_(0.2)

  def tensors(self) -> dict:
    """The checkpoint's `mtp.*` tensors."""
    layer = {f"mtp.layers.0.{k}": v for k, v in self.trunk.layers[0].state_dict().items()}
    return {"mtp.fc.weight": self.fc.weight, "mtp.pre_fc_norm_embedding.weight": self.pre_e.weight,
            "mtp.pre_fc_norm_hidden.weight": self.pre_h.weight, "mtp.norm.weight": self.trunk.norm.weight, **layer}

  def __call__(self, target, tokens, hidden):
    """tokens [1, T] (the token after each position), hidden [1, T, D] (the target's normed hidden
    state, or the previous step's output) -> (output [1, T, D] after mtp.norm, logits [1, T, V])."""
    import torch
    with torch.no_grad():
      x = self.fc(torch.cat([self.pre_e(target.model.embed_tokens(tokens)), self.pre_h(hidden)], dim=-1))
      out = self.trunk(inputs_embeds=x, position_ids=torch.arange(tokens.shape[1])[None]).last_hidden_state
      return out, target.lm_head(out)


def _save(model, path, extra: dict | None):
  """save_pretrained, then `extra` tensors added to model.safetensors and mtp_num_hidden_layers to config.json."""
  import torch
  from safetensors.torch import load_file, save_file
  model.save_pretrained(str(path), safe_serialization=True)
  config = json.loads((path / "config.json").read_text())
  (path / "config.json").write_text(json.dumps({**config, "mtp_num_hidden_layers": 1}))
  if extra:
    tensors = load_file(str(path / "model.safetensors"))
    tensors |= {k: v.detach().to(torch.float32).contiguous() for k, v in extra.items()}
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
  """(transformers target, TorchMTP, specjax target loaded from the folder, folder)."""
  import torch
  from transformers import AutoModelForCausalLM
  torch.manual_seed(0)
  model = AutoModelForCausalLM.from_config(_text_config()).float().eval()
  randomize_hf_(model, seed=7)
  gen = torch.Generator().manual_seed(8)
  with torch.no_grad():                      # decays exp(g) mostly in 0.7..0.97, as test_hybrid draws them
    for name, p in model.named_parameters():
      if name.endswith("A_log"):
        p.copy_(torch.empty(p.shape).uniform_(0.05, 0.5, generator=gen).log())
      elif name.endswith("dt_bias"):
        p.copy_(0.5 * torch.randn(p.shape, generator=gen))
  mtp = TorchMTP(seed=11)
  path = tmp_path_factory.mktemp("qwen3_5_mtp")
  _save(model, path, mtp.tensors())
  return model, mtp, load_model(str(path)), path


def test_the_folder_s_own_layers_load_as_the_mtp_speculator(ckpt):
  _, mtp, target, path = ckpt
  assert builtin_layers(target) == (path, "")
  drafter = make_speculator("mtp", target, draft_params=DraftParams(n_max=K))
  assert isinstance(drafter, MTPDrafter) and drafter.style == "qwen3_next" and drafter.n_heads == 1
  assert drafter.max_draft == K and drafter.weights["target"] is target.params
  head, out = drafter.weights["heads"][0], drafter.weights["out"][0]
  same = lambda a, b: np.testing.assert_array_equal(np.asarray(a), b.detach().numpy())
  same(head["eh_proj"]["kernel"], mtp.fc.weight)
  same(head["enorm"]["weight"], mtp.pre_e.weight)
  same(out["norm"], mtp.trunk.norm.weight)
  attn = mtp.trunk.layers[0].self_attn
  from specjax.models.hybrid import gated_qkv_layout
  from specjax.models.weights import fuse_rows
  c = target.cfg                                        # q / k / v rows placed by the fused layout
  qkv = fuse_rows([attn.q_proj.weight.detach().numpy(), attn.k_proj.weight.detach().numpy(),
                   attn.v_proj.weight.detach().numpy()], gated_qkv_layout(c.n_heads, c.n_kv_heads, c.head_dim))
  np.testing.assert_array_equal(np.asarray(head["block"]["self_attn"]["qkv_proj"]["kernel"]), qkv)
  named = make_speculator("mtp", target, head=str(path), draft_params=DraftParams(n_max=K))    # --head HF_DIR
  jax.tree_util.tree_map(np.testing.assert_array_equal, named.weights["heads"], drafter.weights["heads"])


def _prefill(target, tokens):
  """The target's prenorm hidden states [1, T, D] over `tokens` (one sequence)."""
  state = HybridState.init(target.cfg, 1, 64)
  run = jax.jit(lambda p, t, s: hybrid_forward(p, target.cfg, t, s)[1]["prenorm"])
  return run(target.params, jnp.asarray([tokens]), state)


def test_next_token_probabilities_equal_the_torch_forward(ckpt):
  import torch
  model, mtp, target, _ = ckpt
  seq = PROMPTS[2]
  t = len(seq) - 1                                     # entries (h_p, x_{p+1}), p < T
  with torch.no_grad():
    hidden = model.model(torch.tensor([seq])).last_hidden_state[:, :t]
  _, ref_logits = mtp(model, torch.tensor([seq[1:]]), hidden)
  ref = torch.softmax(ref_logits[0], dim=-1).numpy()   # [T, V]

  drafter = make_speculator("mtp", target, draft_params=DraftParams(n_max=K))
  tp, cfg = target.params, target.cfg
  h = drafter._hidden(tp, _prefill(target, seq)[:, :t])
  np.testing.assert_allclose(np.asarray(h), hidden.numpy(), rtol=2e-4, atol=2e-4)
  emb = drafter._embed(tp, jnp.asarray([seq[1:]]), jnp.arange(t)[None])
  mask = jnp.tril(jnp.ones((t, t), bool))[None]
  @jax.jit
  def picks(weights, emb, h):
    o, _ = apply_head(weights["heads"][0], cfg, emb, h, jnp.arange(t)[None], lambda k, v: (k, v),
                      {"full": mask, "sliding": mask})
    return jax.vmap(lambda x: drafter._pick(weights, 0, x[:, None]), in_axes=1)(o)
  toks, probs, _ = picks(drafter.weights, emb, h)
  np.testing.assert_array_equal(np.asarray(toks)[:, 0], ref.argmax(-1))
  np.testing.assert_allclose(np.asarray(probs)[:, 0], ref.max(-1), rtol=2e-4, atol=2e-5)


def test_a_recursive_draft_equals_the_torch_forward(ckpt):
  """init on a prompt, then one propose: K tokens, each the torch forward's argmax over the
  committed entries plus the draft entries before it (fed its own normed output, as vLLM feeds
  an MTP layer's output to the next step)."""
  import torch
  model, mtp, target, _ = ckpt
  prompt, last = PROMPTS[0], 7
  n = len(prompt)
  with torch.no_grad():
    hidden = model.model(torch.tensor([prompt])).last_hidden_state       # h_0 .. h_{n-1}
  toks, hs, want = prompt[1:] + [last], hidden, []
  for _ in range(K):
    out, logits = mtp(model, torch.tensor([toks]), hs)
    want.append(int(logits[0, -1].argmax()))
    toks, hs = toks + [want[-1]], torch.cat([hs, out[:, -1:]], dim=1)

  drafter = make_speculator("mtp", target, draft_params=DraftParams(n_max=K))
  lens = jnp.asarray([n], jnp.int32)
  ctx = DraftContext(last=jnp.asarray([last]), history=jnp.asarray([prompt + [last]]), hist_len=lens + 1,
                     target_len=lens, n_max=jnp.asarray([K]), p_min=jnp.zeros((1,)), temperature=jnp.zeros((1,)))

  @jax.jit
  def init_and_propose(weights, prompt, prenorm, ctx):
    state = drafter.init(weights, prompt, lens, {"prenorm": prenorm}, 64)
    return drafter.propose(weights, state, ctx)[0]
  draft = init_and_propose(drafter.weights, jnp.asarray([prompt]), _prefill(target, prompt), ctx)
  assert np.asarray(draft.tokens)[0].tolist() == want and int(draft.lengths[0]) == K


@pytest.mark.parametrize("rollback", ["per_step", "redecode"])
def test_speculative_greedy_equals_plain_greedy(ckpt, rollback):
  _, _, target, _ = ckpt
  plain = generate_plain(target.params, target.cfg, PROMPTS, max_new_tokens=MAX_NEW).tokens
  out = api.generate(target, PROMPTS, speculator="mtp", draft_params={"n_max": K}, max_new_tokens=MAX_NEW,
                     chat=False, rollback=rollback)
  assert out.tokens == plain
  assert 0 < out.stats.acc_tokens < out.stats.gen_tokens, out.stats.format()     # drafts partly accepted


def test_no_mtp_tensors_is_one_user_error_that_says_why(ckpt, tmp_path):
  model = ckpt[0]
  _save(model, tmp_path / "plain", None)               # transformers' own save: config names 1 layer, no tensors
  target = load_model(str(tmp_path / "plain"))
  with pytest.raises(UserError, match=r"^speculator 'mtp' needs a trained MTP head \(--head PATH\); .*names 1 MTP "
                     r"layer but its safetensors hold no mtp\.\* tensor"):
    api.generate(target, [[1, 2, 3]], speculator="mtp", chat=False, max_new_tokens=4)
  gguf_like = LoadedModel(name="tiny.gguf", cfg=target.cfg, params=target.params, source=str(tmp_path / "x.gguf"))
  with pytest.raises(UserError, match="tiny.gguf is not an HF checkpoint folder with MTP layers of its own"):
    make_speculator("mtp", gguf_like)
