"""spec-tune: search speculator choice, chain composition and draft parameters for the highest
measured tokens/s, then check the winner against the default on prompts the search never saw.

A tune config is a bench config (`specjax.bench.config.ExperimentConfig`: target, dtype, prompts,
max_new_tokens, sampling, ...) plus a `tune:` section. Its `methods[0]` is the *default* the tuned
config must beat (ngram_simple with n_max 8 when there is none):

    name: tune_smollm2
    target: smollm2-135m-instruct
    prompts: [mt_bench]
    limit: 40
    max_new_tokens: 128
    methods: [{name: default, speculator: ngram_simple, draft_params: {n_max: 8}}]
    tune:
      seed: 0
      strategy: halving            # or random
      budget: {trials: 24, seconds: 1800}
      holdout_fraction: 0.5        # questions held out of the search, stratified by category
      speculators:                 # speculator -> option -> choices (a scalar is one fixed choice)
        ngram_simple: {size_n: [1, 2, 3, 4], size_m: [8, 16, 32]}
        suffix: {max_depth: [32, 64], min_token_prob: [0.05, 0.1]}
      chains: {members: [ngram_simple, suffix], max_len: 2, policies: [best, first]}
      draft_params: {n_max: [4, 8, 16], n_min: [0, 1]}

How it runs (`run_tune`):
1. The prompt set is split, per category and deterministically given `seed`, into tuning and
   held-out questions.
2. Candidates are drawn from the space with `numpy.random.default_rng(seed)` (so the sequence of
   candidates depends on the seed and the space only, never on timings): a speculator or a chain
   (uniformly, or by `arm_weights`), then every option uniformly from its choices. Duplicates are
   drawn again; `n_max` is capped at the speculator's longest draft and `n_min` at `n_max`. Trial 0
   is the default.
3. `random`: every candidate runs on all tuning questions. `halving` (successive halving): all
   candidates run on a few questions, the best 1/eta go on to eta times as many (only the new
   questions run; the metric covers all of them), until one rung covers every tuning question.
4. Budget: `trials` caps the number of candidates (the default included); `seconds` caps the wall
   time of the search: the deadline is checked before every generation call, a candidate cut off
   mid-rung keeps its earlier rungs only, and no new one starts.
5. The best trial is the one with the highest metric among those evaluated on the most questions.
   Plain decoding, the default and the best run on the held-out questions in the same process:
   `holdout.json` is a harness result (`specjax report`, `plot_result` read it).

Cost: every new speculator configuration compiles its programs, tens of seconds a trial even for a
small target, against about a second of timed generation on a few questions (SmolLM2-135M trials:
experiments/results/tune_smollm2_device_h100/trials.json), so budget ~30 s a trial on a GPU. When
compilation dominates like this, `random` over all tuning questions costs little more than
halving's first rung and measures with less noise; halving pays off when
generation dominates (long answers, many questions, configurations that share programs).

Timings are the bench harness's (`specjax.bench.runner.Runner`, one runner for both): each trial
warms every new input shape up with a two-token generation (which compiles the same programs as a
full one) before its timed runs, drafters with cross-request memory (suffix, ngram_mod,
ngram_cache) are restored to the same state before every timed repeat, so no repeat drafts from an
answer it has already produced, and every repeat's time is kept (`repeat_spread` in the summaries).

Outputs (`write_outputs`): `best.yaml` (a bench config: plain vs default vs tuned on the held-out
questions, `holdout_prompts.jsonl`), `trials.json`, `trials.md`, `trials.png`, `holdout.json`,
`holdout.png`, `tune_prompts.jsonl`.

The package, one concept a module: `config` (the tune config and its validation), `space` (candidate
methods drawn from the space), `questions` (the tune / held-out split), `trial` (measuring one
method with the harness's runner), `search` (`run_tune`), `report` (the trials table and figure),
`outputs` (the files of a run), `tiny_model` (a tiny random model for notebooks and tests; a bench
or tune config runs it as `target: tiny-random`). Everything public is importable from `specjax.tune`.
"""

from specjax.bench.config import ConfigError, DraftParamsConfig, MethodConfig
from specjax.tune.config import (DEFAULT_METHOD, METRICS, STRATEGIES, BudgetConfig, ChainSpace, TuneConfig, TuneError,
                                 TuneSettings, load_tune_config, tune_config_from_dict, tune_config_to_dict,
                                 validate_tune)
from specjax.tune.outputs import best_config, load_tune_run, write_outputs
from specjax.tune.questions import split_questions, write_questions
from specjax.tune.report import plot_tune, trials_markdown
from specjax.tune.search import best_trial, halving_schedule, run_tune
from specjax.tune.space import SPACE_KEYS, Space, _max_draft, method_key, method_label, sample_candidates
from specjax.tune.tiny_model import ByteTokenizer, tiny_target
from specjax.tune.trial import WARM_TOKENS, run_questions, summarize

__all__ = [
    "BudgetConfig", "ByteTokenizer", "ChainSpace", "ConfigError", "DEFAULT_METHOD", "DraftParamsConfig", "METRICS",
    "MethodConfig", "SPACE_KEYS", "STRATEGIES", "Space", "TuneConfig", "TuneError", "TuneSettings", "WARM_TOKENS",
    "_max_draft", "best_config", "best_trial", "halving_schedule", "load_tune_config", "load_tune_run",
    "method_key", "method_label", "plot_tune", "run_questions", "run_tune", "sample_candidates",
    "split_questions", "summarize", "tiny_target", "trials_markdown", "tune_config_from_dict",
    "tune_config_to_dict", "validate_tune", "write_outputs", "write_questions",
]
