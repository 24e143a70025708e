"""The speculator registry: every registered speculator is checked without test code of its own,
options are typed and checked before anything loads, and a speculator registered from outside the
package (examples/corpus_drafter.py) works through `api.generate` and `specjax generate`.

- (Losslessness and the sampling law over the whole registry: tests/test_registry_laws.py.)
- The option schema: unknown names, wrong types, out-of-range values and missing required options
  are one UserError that names the speculator and the option.
- The example plugin: loaded by path, listed by `specjax speculators`, lossless on the real
  SmolLM2, and its drafts are accepted when the corpus holds the answer.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from specjax import api
from specjax.cli import main
from specjax.drafters import speculator_spec
from specjax.drafters.registry import make_speculator
from specjax.errors import UserError

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "corpus_drafter.py"


def test_the_registry_lists_every_built_in():
  assert {"ngram_simple", "ngram_map_k", "ngram_map_k4v", "ngram_mod", "ngram_cache", "suffix", "draft",
          "draft_tree", "mtp", "eagle3", "eagle3_tree", "dflash", "dflash_tree"} <= set(speculator_spec.names())


def test_readme_table_is_the_registry():
  """The README's speculator table is `specjax speculators --markdown` (built-ins): no drift."""
  from specjax.cli import speculator_table
  from specjax.drafters.registry import ALL
  readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
  assert speculator_table(ALL) in readme


@pytest.mark.parametrize("spec,options,words", [
    ("ngram_simple", {"size_q": 3}, ["ngram_simple", "unknown option", "size_q"]),
    ("ngram_simple", {"size_n": 2.5}, ["size_n", "integer"]),
    ("ngram_simple", {"size_n": 0}, ["size_n", ">= 1"]),
    ("suffix", {"min_token_prob": 3}, ["min_token_prob", "<= 1"]),
    ("suffix", {"max_spec_factor": float("nan")}, ["max_spec_factor", "number"]),
    ("ngram_simple", {"device": "yes"}, ["device", "true or false"]),
    ("ngram_simple,suffix", {"size_n": 3}, ["per member"]),
    ("ngram_simple,suffix", {"suffix": {"bogus": 1}}, ["suffix", "bogus"]),
    ("ngram_simple,mtp", {}, ["cannot join"]),
])
def test_options_are_checked_against_the_schema(spec, options, words):
  with pytest.raises(UserError) as e:
    make_speculator(spec, None, options=options)
  for w in words:
    assert w in str(e.value), (w, str(e.value))


def test_options_reach_the_drafter():
  d = make_speculator("ngram_simple", None, options={"size_n": 3, "size_m": 5, "device": False})
  assert (d.size_n, d.size_m, d.on_device) == (3, 5, False)
  chain = make_speculator("ngram_simple,suffix", None, options={"suffix": {"max_depth": 7}})
  assert chain.drafters[1].max_depth == 7 and not chain.drafters[0].on_device


def test_register_refuses_duplicates_and_bad_specs():
  spec = speculator_spec.get("suffix")
  with pytest.raises(ValueError, match="already registered"):
    speculator_spec.register_speculator(speculator_spec.SpeculatorSpec("suffix", spec.build, "x"))
  with pytest.raises(ValueError, match="no commas"):
    speculator_spec.SpeculatorSpec("a,b", spec.build, "x")


# --- the example plugin, registered from outside the package ---------------------------------------

@pytest.fixture(scope="module")
def corpus_plugin():
  speculator_spec.load_plugin(str(EXAMPLE))
  yield speculator_spec.get("corpus")
  speculator_spec.unregister_speculator("corpus")


def test_plugin_is_listed_and_its_options_checked(corpus_plugin, capsys):
  assert main(["--plugin", str(EXAMPLE), "speculators"]) == 0
  out = capsys.readouterr().out
  assert "corpus  (host, chain, chainable)" in out and "path (str, required)" in out
  with pytest.raises(UserError, match=r"corpus: option\(s\) \['path'\] required"):
    make_speculator("corpus", None, options={})


@pytest.mark.real
def test_plugin_is_lossless_and_drafts_from_its_corpus(corpus_plugin, smollm2_jax, tmp_path, capsys):
  prompts = ["Write a haiku about the sea."]          # one prompt: the CLI run below reuses the compiled shapes
  plain = api.generate(smollm2_jax, prompts, max_new_tokens=40)
  corpus = tmp_path / "docs.txt"
  corpus.write_text("\n\n".join(plain.texts))           # the corpus holds the answers: drafts should land
  spec = api.generate(smollm2_jax, prompts, max_new_tokens=40, speculator="corpus",
                      options={"path": str(corpus)}, draft_params={"n_max": 8})
  assert spec.tokens == plain.tokens                     # lossless
  assert spec.stats.acc_tokens > 0.5 * sum(len(t) for t in plain.tokens)   # most tokens came from drafts
  # the same from the command line, the plugin loaded by path
  rc = main(["--plugin", str(EXAMPLE), "generate", "--chat", "--max-new-tokens", "40", "--spec", "corpus",
             "--spec-config", json.dumps({"path": str(corpus), "n_max": 8}), prompts[0]])
  out = capsys.readouterr()
  assert rc == 0, out.err
  assert plain.texts[0].strip() in out.out
