"""The offline tiny model: loadable by transformers, deterministic, with a working ChatML template."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from worker.tiny_model import (
    BUILD_VERSION,
    TINY_TEMPLATES,
    build_tiny_model,
    default_cache_dir,
    resolve_model,
)

SPECIALS = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<think>",
    "</think>",
    "<tool_call>",
    "</tool_call>",
    "<tool_response>",
    "</tool_response>",
)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "model")


@pytest.fixture(scope="module")
def tokenizer(model_dir: Path) -> Any:
    return AutoTokenizer.from_pretrained(model_dir)


def _conversation() -> list[dict[str, Any]]:
    return [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": "Checking.",
            "reasoning_content": "EARLIER-REASONING needs a tool",
            "tool_calls": [
                {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}},
                {"type": "function", "function": {"name": "get_time", "arguments": '{"tz": "CET"}'}},
            ],
        },
        {"role": "tool", "content": "18 C, sunny"},
        {"role": "tool", "content": "14:05"},
        {"role": "user", "content": "Thanks!"},
    ]


def test_directory_contents(model_dir: Path) -> None:
    for name in ("tokenizer.json", "tokenizer_config.json", "config.json", "model.safetensors"):
        assert (model_dir / name).is_file(), name
    assert (model_dir / "chat_template.jinja").is_file()
    info = json.loads((model_dir / "tokentrail.json").read_text())
    assert info == {
        "builder": "tokentrail tiny",
        "template": "chatml",
        "seed": 0,
        "build_version": BUILD_VERSION,
    }
    gen = json.loads((model_dir / "generation_config.json").read_text())
    assert gen["eos_token_id"] == json.loads((model_dir / "config.json").read_text())["eos_token_id"]
    assert "chatml" in TINY_TEMPLATES


def test_tokenizer_specials(tokenizer: Any) -> None:
    assert 2000 <= len(tokenizer) <= 4000
    assert tokenizer.eos_token == "<|im_end|>"
    assert tokenizer.pad_token == "<|endoftext|>"
    assert tokenizer.bos_token is None
    ids = [tokenizer.convert_tokens_to_ids(tok) for tok in SPECIALS]
    assert len(set(ids)) == len(SPECIALS)
    for tok, tok_id in zip(SPECIALS, ids, strict=True):
        assert tokenizer.encode(tok, add_special_tokens=False) == [tok_id]
    assert tokenizer.eos_token_id == tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert set(ids) <= set(tokenizer.all_special_ids)
    # Specials inside text are matched as single tokens and skipped on request.
    text = "<|im_start|>user\n<think>hm</think><|im_end|>"
    enc = tokenizer.encode(text, add_special_tokens=False)
    assert enc[0] == ids[1] and enc[-1] == ids[2]
    assert tokenizer.decode(enc) == text
    assert tokenizer.decode(enc, skip_special_tokens=True) == "user\nhm"


@pytest.mark.parametrize(
    "text",
    [
        "Hello, world! The quick brown fox jumps over the lazy dog.",
        "def f(x):\n    return {'a': [1, 2, 3]}  # ok\n",
        "  leading and trailing spaces  \n\n\ttabs",
        "café naïve Zürich 日本語 🙂 ∑ 1,234.56%",
        "",
    ],
)
def test_encode_decode_round_trip(tokenizer: Any, text: str) -> None:
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert tokenizer.decode(ids) == text
    assert all(isinstance(i, int) and 0 <= i < len(tokenizer) for i in ids)


def test_bpe_merges_common_words(tokenizer: Any) -> None:
    text = "The president and the teacher went to the market."
    assert len(tokenizer.encode(text, add_special_tokens=False)) < len(text) // 2


def test_chat_template_full_conversation(tokenizer: Any) -> None:
    tools = [
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "description": "Current weather",
                "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
            },
        }
    ]
    out = tokenizer.apply_chat_template(
        _conversation(), tools=tools, tokenize=False, add_generation_prompt=True
    )
    assert isinstance(out, str)
    assert out.startswith("<|im_start|>system\nYou are terse.\n\n")
    assert '"name": "get_weather", "description": "Current weather"' in out
    assert "<|im_start|>user\nWeather in Paris?<|im_end|>\n" in out
    assert (
        "<|im_start|>assistant\nChecking.\n"
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "get_time", "arguments": {"tz": "CET"}}\n</tool_call><|im_end|>\n'
    ) in out
    # Consecutive tool messages share one user turn.
    assert (
        "<|im_start|>user\n<tool_response>\n18 C, sunny\n</tool_response>\n"
        "<tool_response>\n14:05\n</tool_response><|im_end|>\n"
        "<|im_start|>user\nThanks!<|im_end|>\n"
    ) in out
    # Reasoning of a turn before the last user message is dropped.
    assert "EARLIER-REASONING" not in out
    assert "<think>" not in out
    assert out.endswith("<|im_start|>assistant\n")
    assert out.count("<|im_start|>") == 6


def test_chat_template_exact_simple(tokenizer: Any) -> None:
    messages = [{"role": "system", "content": "S"}, {"role": "user", "content": "Hi"}]
    out = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert out == "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    out = tokenizer.apply_chat_template(messages[1:], tokenize=False)
    assert out == "<|im_start|>user\nHi<|im_end|>\n"
    out = tokenizer.apply_chat_template(
        messages[1:], tokenize=False, add_generation_prompt=True, enable_thinking=False
    )
    assert out.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")


def test_chat_template_keeps_reasoning_after_last_user(tokenizer: Any) -> None:
    messages = [
        *_conversation(),
        {
            "role": "assistant",
            "content": "Sunny, 18 C.",
            "reasoning_content": "LATEST-REASONING",
            "tool_calls": [{"function": {"name": "log", "arguments": {}}}],
        },
        {"role": "tool", "content": "logged"},
        {"role": "assistant", "content": "Done.", "reasoning_content": "\nAFTER-TOOL\n"},
    ]
    out = tokenizer.apply_chat_template(messages, tokenize=False)
    assert "EARLIER-REASONING" not in out
    assert (
        "<|im_start|>assistant\n<think>\nLATEST-REASONING\n</think>\n\nSunny, 18 C.\n"
        '<tool_call>\n{"name": "log", "arguments": {}}\n</tool_call><|im_end|>\n'
    ) in out
    assert out.endswith("<|im_start|>assistant\n<think>\nAFTER-TOOL\n</think>\n\nDone.<|im_end|>\n")


def test_chat_template_inline_think_and_tool_call_only(tokenizer: Any) -> None:
    messages = [
        {"role": "user", "content": "a"},
        {"role": "assistant", "content": "<think>\nold\n</think>\n\nfirst"},
        {"role": "user", "content": "b"},
        {"role": "assistant", "content": None, "tool_calls": [{"function": {"name": "f", "arguments": {}}}]},
    ]
    out = tokenizer.apply_chat_template(messages, tokenize=False)
    assert "<|im_start|>assistant\nfirst<|im_end|>\n" in out
    assert "old" not in out
    assert out.endswith(
        '<|im_start|>assistant\n<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call><|im_end|>\n'
    )


def test_chat_template_tokenizes_specials_as_single_ids(tokenizer: Any) -> None:
    messages = [{"role": "user", "content": "Hi"}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    ids = tokenizer.encode(text, add_special_tokens=False)
    start, end = tokenizer.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>"])
    assert ids.count(start) == 2 and ids.count(end) == 1
    assert tokenizer.decode(ids) == text


def test_model_forward(model_dir: Path, tokenizer: Any) -> None:
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    cfg = model.config
    assert (cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers) == (64, 128, 2)
    assert (cfg.num_attention_heads, cfg.num_key_value_heads) == (4, 2)
    assert cfg.vocab_size == len(tokenizer)
    assert cfg.eos_token_id == tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert cfg.pad_token_id == tokenizer.convert_tokens_to_ids("<|endoftext|>")
    assert cfg.bos_token_id is None
    assert not cfg.tie_word_embeddings
    assert model.dtype == torch.float32
    ids = tokenizer.encode("Hello there, how are you?", add_special_tokens=False)
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits
    assert tuple(logits.shape) == (1, len(ids), len(tokenizer))
    assert torch.isfinite(logits).all()
    assert logits.std().item() > 1e-3  # not degenerate


def test_build_is_deterministic_and_leaves_global_rng_alone(model_dir: Path, tmp_path: Path) -> None:
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    again = build_tiny_model(tmp_path / "again")
    assert torch.equal(torch.rand(3), expected)
    assert again == tmp_path / "again"
    for name in ("tokenizer.json", "model.safetensors", "config.json", "chat_template.jinja"):
        assert (again / name).read_bytes() == (model_dir / name).read_bytes(), name
    first, second = load_file(model_dir / "model.safetensors"), load_file(again / "model.safetensors")
    assert first.keys() == second.keys()
    assert all(torch.equal(first[k], second[k]) for k in first)


def test_seed_and_custom_chat_template_file(model_dir: Path, tmp_path: Path) -> None:
    template = tmp_path / "t.jinja"
    template.write_text("{% for m in messages %}[{{ m.role }}]{{ m.content }}{% endfor %}")
    other = build_tiny_model(tmp_path / "s1", seed=1, chat_template_file=template)
    # The seed changes the weights only; the tokenizer is shared by all seeds.
    assert (other / "tokenizer.json").read_bytes() == (model_dir / "tokenizer.json").read_bytes()
    a, b = load_file(model_dir / "model.safetensors"), load_file(other / "model.safetensors")
    assert not torch.equal(a["model.embed_tokens.weight"], b["model.embed_tokens.weight"])
    assert json.loads((other / "tokentrail.json").read_text())["seed"] == 1
    tok = AutoTokenizer.from_pretrained(other)
    assert tok.apply_chat_template([{"role": "user", "content": "x"}], tokenize=False) == "[user]x"
    assert tok.eos_token == "<|im_end|>"


def test_unknown_template(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="unknown tiny template"):
        build_tiny_model(tmp_path / "m", template="nope")


def test_resolve_model_builds_once(tmp_path: Path) -> None:
    path = resolve_model("tiny", cache_dir=tmp_path)
    expected = tmp_path / "models" / f"tiny-chatml-s0-v{BUILD_VERSION}"
    assert Path(path) == expected.absolute()
    assert (expected / "tokentrail.json").is_file()
    assert AutoTokenizer.from_pretrained(path).eos_token == "<|im_end|>"
    mtimes = {p.name: p.stat().st_mtime_ns for p in expected.iterdir()}
    assert resolve_model("tiny", cache_dir=tmp_path) == path
    assert resolve_model("tiny-chatml", cache_dir=tmp_path) == path
    assert {p.name: p.stat().st_mtime_ns for p in expected.iterdir()} == mtimes
    # No temporary build directories are left behind.
    assert [p.name for p in (tmp_path / "models").iterdir()] == [expected.name]


def test_resolve_model_passes_other_names_through(tmp_path: Path) -> None:
    assert resolve_model("/some/dir", cache_dir=tmp_path) == "/some/dir"
    assert resolve_model("Qwen/Qwen3-0.6B", cache_dir=tmp_path) == "Qwen/Qwen3-0.6B"
    assert resolve_model("tinyllama", cache_dir=tmp_path) == "tinyllama"
    existing = tmp_path / "tiny-local"
    existing.mkdir()
    assert resolve_model(str(existing), cache_dir=tmp_path) == str(existing)
    assert not (tmp_path / "models").exists()
    with pytest.raises(ValueError, match="unknown tiny template"):
        resolve_model("tiny-nope", cache_dir=tmp_path)


def test_default_cache_dir(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("TOKENTRAIL_CACHE_DIR", str(tmp_path / "c"))
    assert default_cache_dir() == tmp_path / "c"
    monkeypatch.delenv("TOKENTRAIL_CACHE_DIR")
    assert default_cache_dir() == Path.home() / ".cache" / "tokentrail"
