"""The offline tiny model: loadable by transformers, deterministic, with a working ChatML template."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from worker.tiny import build_tiny_model, cache, resolve_model
from worker.tiny.build import BUILD_VERSION
from worker.tiny.cache import default_cache_dir
from worker.tiny.layout import CHATML, LLAMA3_SPECIALS, TINY_TEMPLATES
from worker.tiny.training import DEFAULT_TRAIN_STEPS

SPECIALS = CHATML.specials
# Qwen3 layout: single ids, but not special (decode(skip_special_tokens=True) keeps them).
ADDED = CHATML.added
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # Untrained (seconds): these tests check files, tokenizer and template, not behaviour.
    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "model", train=False)


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
        "train_steps": 0,
    }
    gen = json.loads((model_dir / "generation_config.json").read_text())
    assert gen["eos_token_id"] == json.loads((model_dir / "config.json").read_text())["eos_token_id"]
    assert TINY_TEMPLATES == ("chatml", "llama3")


def test_tokenizer_specials(tokenizer: Any) -> None:
    assert 2000 <= len(tokenizer) <= 4000
    assert tokenizer.eos_token == "<|im_end|>"
    assert tokenizer.pad_token == "<|endoftext|>"
    assert tokenizer.bos_token is None
    ids = [tokenizer.convert_tokens_to_ids(tok) for tok in SPECIALS + ADDED]
    assert len(set(ids)) == len(SPECIALS + ADDED)
    for tok, tok_id in zip(SPECIALS + ADDED, ids, strict=True):
        assert tokenizer.encode(tok, add_special_tokens=False) == [tok_id]
    assert tokenizer.eos_token_id == tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert set(ids[: len(SPECIALS)]) <= set(tokenizer.all_special_ids)
    assert not set(ids[len(SPECIALS) :]) & set(tokenizer.all_special_ids)
    # Specials and added tokens inside text are matched as single tokens; only specials are skipped.
    text = "<|im_start|>user\n<think>hm</think><|im_end|>"
    enc = tokenizer.encode(text, add_special_tokens=False)
    assert enc[0] == ids[1] and enc[-1] == ids[2]
    assert ids[3] in enc and ids[4] in enc
    assert tokenizer.decode(enc) == text
    assert tokenizer.decode(enc, skip_special_tokens=True) == "user\n<think>hm</think>"
    # Encoding text with specials split (as user content is) still keeps the added tokens whole.
    split = tokenizer(text, add_special_tokens=False, split_special_tokens=True)["input_ids"]
    assert ids[1] not in split and ids[2] not in split and ids[3] in split


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
    out = tokenizer.apply_chat_template(_conversation(), tools=TOOLS, tokenize=False, add_generation_prompt=True)
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
    out = tokenizer.apply_chat_template(messages[1:], tokenize=False, add_generation_prompt=True, enable_thinking=False)
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
    assert out.endswith('<|im_start|>assistant\n<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call><|im_end|>\n')


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
    assert (cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers) == (128, 256, 4)
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
    again = build_tiny_model(tmp_path / "again", train=False)
    assert torch.equal(torch.rand(3), expected)
    assert again == tmp_path / "again"
    for name in ("tokenizer.json", "model.safetensors", "config.json", "chat_template.jinja"):
        assert (again / name).read_bytes() == (model_dir / name).read_bytes(), name
    first, second = load_file(model_dir / "model.safetensors"), load_file(again / "model.safetensors")
    assert first.keys() == second.keys()
    assert all(torch.equal(first[k], second[k]) for k in first)


def test_training_is_reproducible_and_leaves_global_rng_alone(model_dir: Path, tmp_path: Path) -> None:
    # A few steps stand in for the full schedule: same machine, same seed -> same weights.
    torch.manual_seed(7)
    expected = torch.rand(3)
    torch.manual_seed(7)
    a = build_tiny_model(tmp_path / "a", train_steps=6)
    b = build_tiny_model(tmp_path / "b", train_steps=6)
    assert torch.equal(torch.rand(3), expected)
    assert (a / "model.safetensors").read_bytes() == (b / "model.safetensors").read_bytes()
    assert (a / "tokenizer.json").read_bytes() == (model_dir / "tokenizer.json").read_bytes()
    trained, untrained = load_file(a / "model.safetensors"), load_file(model_dir / "model.safetensors")
    assert not torch.equal(trained["lm_head.weight"], untrained["lm_head.weight"])
    assert json.loads((a / "tokentrail.json").read_text())["train_steps"] == 6


def test_seed_and_custom_chat_template_file(model_dir: Path, tmp_path: Path) -> None:
    template = tmp_path / "t.jinja"
    template.write_text("{% for m in messages %}[{{ m.role }}]{{ m.content }}{% endfor %}")
    # Training renders its conversations with whatever template the model gets (here one that ignores
    # tools and tool calls); a few steps show it works.
    other = build_tiny_model(tmp_path / "s1", seed=1, chat_template_file=template, train_steps=3)
    # The seed changes the weights only; the tokenizer is shared by all seeds.
    assert (other / "tokenizer.json").read_bytes() == (model_dir / "tokenizer.json").read_bytes()
    a, b = load_file(model_dir / "model.safetensors"), load_file(other / "model.safetensors")
    assert not torch.equal(a["model.embed_tokens.weight"], b["model.embed_tokens.weight"])
    assert json.loads((other / "tokentrail.json").read_text())["seed"] == 1
    tok = AutoTokenizer.from_pretrained(other)
    assert tok.apply_chat_template([{"role": "user", "content": "x"}], tokenize=False) == "[user]x"
    assert tok.eos_token == "<|im_end|>"


def test_template_that_rejects_tools_falls_back_and_one_that_renders_nothing_fails(tmp_path: Path) -> None:
    picky = tmp_path / "picky.jinja"
    picky.write_text(
        "{% for m in messages %}{% if m.role not in ('user', 'assistant') or m.tool_calls %}"
        "{{ raise_exception('no') }}{% endif %}<{{ m.role }}>{{ m.content }}{% endfor %}"
    )
    build_tiny_model(tmp_path / "picky", chat_template_file=picky, train_steps=2)
    broken = tmp_path / "broken.jinja"
    broken.write_text("{{ raise_exception('never') }}")
    empty = tmp_path / "empty.jinja"
    empty.write_text("{# renders nothing #}")
    for bad in (broken, empty):
        with pytest.raises(ValueError, match="cannot render synthetic conversations"):
            build_tiny_model(tmp_path / bad.stem, chat_template_file=bad, train_steps=2)


def test_unknown_template(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="unknown tiny template"):
        build_tiny_model(tmp_path / "m", template="nope")


def test_resolve_model_builds_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    builds: list[tuple[Path, dict[str, Any]]] = []

    def untrained_build(out_dir: Path, **kwargs: Any) -> Path:
        builds.append((out_dir, kwargs))
        return build_tiny_model(out_dir, **kwargs, train=False)  # the real (trained) build takes a minute

    monkeypatch.setattr(cache, "build_tiny_model", untrained_build)
    path = resolve_model("tiny", cache_dir=tmp_path)
    expected = tmp_path / "models" / f"tiny-chatml-s0-v{BUILD_VERSION}"
    assert Path(path) == expected.absolute()
    assert (expected / "tokentrail.json").is_file()
    assert AutoTokenizer.from_pretrained(path).eos_token == "<|im_end|>"
    mtimes = {p.name: p.stat().st_mtime_ns for p in expected.iterdir()}
    assert resolve_model("tiny", cache_dir=tmp_path) == path
    assert resolve_model("tiny-chatml", cache_dir=tmp_path) == path
    assert {p.name: p.stat().st_mtime_ns for p in expected.iterdir()} == mtimes
    llama3 = resolve_model("tiny-llama3", cache_dir=tmp_path)
    assert Path(llama3) == (tmp_path / "models" / f"tiny-llama3-s0-v{BUILD_VERSION}").absolute()
    assert AutoTokenizer.from_pretrained(llama3).eos_token == "<|end_of_text|>"
    assert [kwargs for _, kwargs in builds] == [{"template": "chatml", "seed": 0}, {"template": "llama3", "seed": 0}]
    # No temporary build directories are left behind; the builds' lock files stay (empty).
    left = sorted((tmp_path / "models").iterdir())
    locks = [p for p in left if p.name.endswith(".lock")]
    assert [p.name for p in locks] == [f".{expected.name}.lock", f".{Path(llama3).name}.lock"]
    assert all(p.is_file() and p.stat().st_size == 0 for p in locks)
    assert [p.name for p in left if p not in locks] == [expected.name, Path(llama3).name]


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


# --------------------------------------------------------------------------------------------------
# llama3 template and tokens
# --------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def llama3_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny-llama3") / "model", template="llama3", train=False)


@pytest.fixture(scope="module")
def llama3_tok(llama3_dir: Path) -> Any:
    return AutoTokenizer.from_pretrained(llama3_dir)


def test_llama3_tokens(llama3_dir: Path, llama3_tok: Any) -> None:
    tok = llama3_tok
    assert (tok.bos_token, tok.eos_token, tok.pad_token) == (
        "<|begin_of_text|>",
        "<|end_of_text|>",
        "<|finetune_right_pad_id|>",
    )
    ids = {t: tok.convert_tokens_to_ids(t) for t in LLAMA3_SPECIALS}
    assert list(ids.values()) == list(range(len(LLAMA3_SPECIALS)))  # specials first, in this order
    for text, tok_id in ids.items():
        assert tok.encode(text, add_special_tokens=False) == [tok_id]
    assert set(ids.values()) <= set(tok.all_special_ids)
    assert len(tok.encode("<think>", add_special_tokens=False)) > 1  # chatml-only added tokens
    # The template writes <|begin_of_text|>; plain encoding never adds it.
    assert tok.encode("hi") == tok.encode("hi", add_special_tokens=False)
    config = json.loads((llama3_dir / "config.json").read_text())
    gen = json.loads((llama3_dir / "generation_config.json").read_text())
    assert config["eos_token_id"] == ids["<|end_of_text|>"]
    assert config["bos_token_id"] == ids["<|begin_of_text|>"]
    assert config["pad_token_id"] == ids["<|finetune_right_pad_id|>"]
    assert gen["eos_token_id"] == [ids["<|eot_id|>"], ids["<|eom_id|>"], ids["<|end_of_text|>"]]
    assert json.loads((llama3_dir / "tokentrail.json").read_text())["template"] == "llama3"


def test_llama3_template_exact_simple(llama3_tok: Any) -> None:
    messages = [{"role": "system", "content": "S"}, {"role": "user", "content": "Hi"}]
    out = llama3_tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert out == (
        "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nS<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n"
    )
    out = llama3_tok.apply_chat_template(messages[1:], tokenize=False)
    assert out == "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>"


def test_llama3_template_tools_and_tool_calls(llama3_tok: Any) -> None:
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": "",
            "reasoning_content": "NOT-RENDERED",
            "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "18 C"},
        {"role": "assistant", "content": "Sunny."},
        {"role": "user", "content": "Time and Oslo?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"type": "function", "function": {"name": "get_time", "arguments": '{"tz": "CET"}'}},
                {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}},
            ],
        },
    ]
    out = llama3_tok.apply_chat_template(messages, tools=TOOLS, tokenize=False)
    assert out.startswith("<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nYou are terse.\n\n")
    system = out.split("<|eot_id|>")[0]
    assert json.dumps(TOOLS[0]) in system
    assert (
        "<|start_header_id|>assistant<|end_header_id|>\n\n"
        '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}<|eom_id|>'
        "<|start_header_id|>ipython<|end_header_id|>\n\n18 C<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\nSunny.<|eot_id|>"
    ) in out
    assert out.endswith(
        '<|python_tag|>{"name": "get_time", "parameters": {"tz": "CET"}}; '
        '{"name": "get_weather", "parameters": {"city": "Oslo"}}<|eom_id|>'
    )
    assert "NOT-RENDERED" not in out
    with_prompt = llama3_tok.apply_chat_template(messages[:4], tools=TOOLS, tokenize=False, add_generation_prompt=True)
    assert with_prompt.endswith("18 C<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n")

    # Token level: bos first, every turn closed by exactly one eot/eom, eom exactly on tool-call turns.
    ids = llama3_tok.encode(out, add_special_tokens=False)
    bos, start, eot, eom, tag = llama3_tok.convert_tokens_to_ids(
        ["<|begin_of_text|>", "<|start_header_id|>", "<|eot_id|>", "<|eom_id|>", "<|python_tag|>"]
    )
    assert ids[0] == bos and ids.count(bos) == 1
    turns: list[list[int]] = []
    for i in ids[1:]:
        if i == start:
            turns.append([])
        turns[-1].append(i)
    assert len(turns) == 7
    for turn in turns:
        assert turn[-1] in (eot, eom) and turn.count(eot) + turn.count(eom) == 1
        assert (turn[-1] == eom) == (tag in turn)
    assert [turn[-1] == eom for turn in turns] == [False, False, True, False, False, False, True]


# --------------------------------------------------------------------------------------------------
# Trained models: they really emit closers, reasoning and tool calls
# --------------------------------------------------------------------------------------------------

# The closer that ends an assistant turn, and the tool-call opener, per template.
CLOSERS = {"chatml": ("<|im_end|>",), "llama3": ("<|eot_id|>", "<|eom_id|>")}
CALL_OPENERS = {"chatml": "<tool_call>", "llama3": "<|python_tag|>"}
SAMPLES = 20


def _sample(
    tok: Any, model: Any, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None
) -> list[list[int]]:
    """SAMPLES seeded completions after the generation prompt, each cut after its first stop token."""
    text = tok.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True)
    prompt = tok.encode(text, add_special_tokens=False)
    batch = torch.tensor([prompt] * SAMPLES)
    stops = model.generation_config.eos_token_id
    stops = set(stops) if isinstance(stops, list) else {stops}
    with torch.random.fork_rng(devices=[]), torch.no_grad():
        torch.manual_seed(0)
        out = model.generate(
            batch,
            attention_mask=torch.ones_like(batch),
            do_sample=True,
            temperature=0.8,
            max_new_tokens=80,
            pad_token_id=tok.pad_token_id,
        )
    completions = []
    for row in out[:, len(prompt) :].tolist():
        end = next((i for i, t in enumerate(row) if t in stops), len(row) - 1)
        completions.append(row[: end + 1])
    return completions


@pytest.mark.timeout(900)  # a first run builds and trains the model into the cache (about a minute, more if busy)
@pytest.mark.parametrize("template", TINY_TEMPLATES)
def test_trained_model_emits_chat_structure(trained_model: Callable[[str], Path], template: str) -> None:
    model_dir = trained_model(template)
    assert json.loads((model_dir / "tokentrail.json").read_text())["train_steps"] == DEFAULT_TRAIN_STEPS
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    closers = set(tok.convert_tokens_to_ids(list(CLOSERS[template])))
    system = {"role": "system", "content": "You are a helpful assistant."}
    plain = _sample(tok, model, [system, {"role": "user", "content": "Why did the teacher walk to Paris?"}], None)
    tools = _sample(tok, model, [system, {"role": "user", "content": "What is the weather in Oslo?"}], TOOLS)
    text = {"plain": [tok.decode(c) for c in plain], "tools": [tok.decode(c) for c in tools]}

    for completions in (plain, tools):
        closed = [c for c in completions if c[-1] in closers]
        assert len(closed) >= SAMPLES // 2, text
    # Without tools: short plain replies, rarely a tool call.
    closed_plain = sorted(len(c) for c in plain if c[-1] in closers)
    assert 3 <= closed_plain[len(closed_plain) // 2] <= 60, closed_plain
    opener = CALL_OPENERS[template]
    assert sum(opener in s for s in text["plain"]) <= SAMPLES // 4, text["plain"]
    # With tools offered: often a tool call.
    assert sum(opener in s for s in text["tools"]) >= 4, text["tools"]
    if template == "chatml":
        reasoned = [s for s in text["plain"] + text["tools"] if "<think>" in s and "</think>" in s]
        assert len(reasoned) >= 2, text
    else:
        eom = tok.convert_tokens_to_ids("<|eom_id|>")
        assert any(c[-1] == eom and tok.convert_tokens_to_ids("<|python_tag|>") in c for c in tools), text["tools"]
