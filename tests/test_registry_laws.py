"""Every registered speculator, the example plugin included, is lossless and samples exactly the
target's distribution, with no test code of its own: each is built from its spec's `example` (a
random head, a draft model or small options for a random tiny target) and checked here.

One batch per speculator checks both laws (one compiled program each, as plain decoding's
reference is one): its first 3 rows are greedy ragged prompts, the other 512 rows copies of one
prompt sampled at temperature 1, each with its own seed.

- Greedy: the greedy rows' tokens equal plain greedy decoding's (ragged prompts, beside sampled
  rows), and the speculator drafted for them (verified draft tokens > 0), so the check is not
  vacuous.
- Sampling law (temperature 1): the marginal distribution of the sampled rows' tokens at output
  positions 1-3 (all produced by speculative rounds: position 0 comes from the prefill) over 512
  sequences with distinct seeds matches plain sampling's (chi-square test of homogeneity, p >= 1e-4;
  the seeds are fixed, so the outcome is deterministic).
- Trees: the `n_nodes` option is the node budget every round verifies, and n_max caps the depth of
  the nodes verified; the output stays plain greedy decoding's.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from conftest import TINY_LLAMA, chi2_two_sample, random_params
from specjax.drafters import speculator_spec
from specjax.drafters.base import DraftParams
from specjax.engine import speculative_generate
from specjax.engine.decode import generate_plain
from specjax.engine.sampling import SamplingParams
from specjax.io.hf_tokenizer import HFTokenizer
from specjax.models.load import LoadedModel

EXAMPLE_PLUGIN = Path(__file__).resolve().parents[1] / "examples" / "corpus_drafter.py"
PROMPTS = [[1, 5, 9, 3, 5, 9, 3, 5], [2, 4, 6, 2, 4], [7, 7, 7, 7, 1, 2, 7, 7, 7]]
MAX_NEW = 16
N_MAX = 4
N_SAMPLED, SAMPLED_NEW = 512, 4


def _word_tokenizer(folder: Path, vocab_size: int) -> HFTokenizer:
  """A real word-level tokenizer (HF `tokenizers`) over the tiny model's vocabulary: token i is "w{i}"."""
  from tokenizers import Tokenizer, models, pre_tokenizers
  tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(vocab_size)}, unk_token="w0"))
  tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
  folder.mkdir(parents=True, exist_ok=True)
  tok.save(str(folder / "tokenizer.json"))
  (folder / "tokenizer_config.json").write_text(json.dumps({"add_bos_token": False}))
  return HFTokenizer(folder)


def _names() -> list[str]:
  speculator_spec.load_plugin(str(EXAMPLE_PLUGIN))
  return list(speculator_spec.names())


@pytest.fixture(autouse=True)
def _example_plugin_registered():
  """The example plugin ('corpus') registered when a test runs, not only when this file was
  collected: another file's fixture in the same process may have unregistered it since."""
  if "corpus" not in speculator_spec.names():
    speculator_spec.load_plugin(str(EXAMPLE_PLUGIN))


@pytest.fixture(scope="module")
def target(tmp_path_factory):
  folder = tmp_path_factory.mktemp("word_tokenizer")
  return LoadedModel(name="tiny", cfg=TINY_LLAMA, params=random_params(TINY_LLAMA, seed=0),
                     tokenizer=_word_tokenizer(folder, TINY_LLAMA.vocab_size))


def _build(name: str, target, workdir: Path):
  spec = speculator_spec.get(name)
  dp = DraftParams(n_max=N_MAX)
  kwargs = spec.example(target, workdir) if spec.example is not None else {}
  return spec.build(target, draft_params=dp, **kwargs), dp


def _tree_names() -> list[str]:
  return [n for n in _names() if speculator_spec.get(n).tree and "n_nodes" in speculator_spec.get(n).option_names]


def _mixed_sampling(first_seed: int) -> SamplingParams:
  """The greedy rows (temperature 0), then N_SAMPLED rows at temperature 1 with seeds first_seed + i."""
  return SamplingParams.make(len(PROMPTS) + N_SAMPLED, temperature=[0.0] * len(PROMPTS) + [1.0] * N_SAMPLED,
                             seed=list(range(len(PROMPTS))) + list(range(first_seed, first_seed + N_SAMPLED)))


MIXED_PROMPTS = PROMPTS + [PROMPTS[0]] * N_SAMPLED


@pytest.fixture(scope="module")
def plain_mixed(target):
  """Plain decoding of the mixed batch: (greedy tokens of PROMPTS, sampled tokens [N, SAMPLED_NEW])."""
  out = generate_plain(target.params, target.cfg, MIXED_PROMPTS, max_new_tokens=MAX_NEW,
                       sampling=_mixed_sampling(50_000)).tokens
  return out[:len(PROMPTS)], np.asarray(out[len(PROMPTS):])[:, :SAMPLED_NEW]


@pytest.fixture(scope="module")
def plain_greedy(plain_mixed):
  return plain_mixed[0]


@pytest.mark.parametrize("name", _names())
def test_greedy_output_and_sampled_law_are_plain_decodings(name, target, plain_mixed, tmp_path):
  """The greedy rows equal plain greedy decoding's and were drafted for; the sampled rows' tokens
  at positions 1-3 follow plain sampling's law."""
  plain_greedy, plain_sampled = plain_mixed
  drafter, dp = _build(name, target, tmp_path)
  out = speculative_generate(target.params, target.cfg, MIXED_PROMPTS, drafter, max_new_tokens=MAX_NEW,
                             draft_params=dp, sampling=_mixed_sampling(10_000))
  assert out.tokens[:len(PROMPTS)] == plain_greedy
  assert sum(out.stats.per_seq_gen_tokens[:len(PROMPTS)]) > 0, f"{name} drafted nothing: the check would be vacuous"
  spec_tokens = np.asarray(out.tokens[len(PROMPTS):])[:, :SAMPLED_NEW]                 # [N, SAMPLED_NEW]
  v = target.cfg.vocab_size
  for pos in range(1, SAMPLED_NEW):
    a = np.bincount(spec_tokens[:, pos], minlength=v)
    b = np.bincount(plain_sampled[:, pos], minlength=v)
    stat, df, p = chi2_two_sample(a, b)
    assert p >= 1e-4, f"{name}: position {pos} differs from plain sampling (chi2 {stat:.1f}, df {df}, p {p:.2g})"


@pytest.mark.parametrize("name", _tree_names())
def test_tree_node_budget_is_its_option_and_n_max_its_depth(name, target, plain_greedy, tmp_path):
  """Built with `n_nodes` 4 (below the example trees' 6 candidates), every live round verifies
  exactly 4 nodes per sequence; with n_max 1 only the root's children are verified (nothing past
  depth 1 drafted or accepted). Both outputs are plain greedy decoding's."""
  spec = speculator_spec.get(name)
  kwargs = {**(spec.example(target, tmp_path) if spec.example is not None else {}), "n_nodes": 4}
  drafter = spec.build(target, draft_params=DraftParams(n_max=N_MAX), **kwargs)
  assert drafter.max_draft == 4
  out = speculative_generate(target.params, target.cfg, PROMPTS, drafter, max_new_tokens=MAX_NEW,
                             draft_params=DraftParams(n_max=N_MAX))
  assert out.tokens == plain_greedy
  assert out.stats.per_seq_gen_tokens == [4 * r for r in out.stats.per_seq_rounds]
  shallow = speculative_generate(target.params, target.cfg, PROMPTS, drafter, max_new_tokens=MAX_NEW,
                                 draft_params=DraftParams(n_max=1))
  assert shallow.tokens == plain_greedy
  st = shallow.stats
  assert sum(st.drafted_by_pos[1:]) == sum(st.accepted_by_pos[1:]) == 0 and st.drafted_by_pos[0] > 0
  assert all(g <= 4 * r for g, r in zip(st.per_seq_gen_tokens, st.per_seq_rounds))
