"""A tiny Llama-style chat model built offline, for tests and demos.

``build_tiny_model`` writes a directory that ``AutoTokenizer.from_pretrained`` and
``AutoModelForCausalLM.from_pretrained`` load like any Hugging Face checkpoint: a byte-level BPE
tokenizer trained on text generated here, a chat template, a 4-layer ``LlamaForCausalLM`` and
``tokentrail.json`` describing the build. Its seeded random weights are then briefly trained on
synthetic chats (``worker.tiny_training``), so that sampled replies close their turn, often reason and
often call offered tools -- enough structure to exercise multi-turn stitching. Nothing is downloaded;
the tokenizer is byte-identical everywhere, the weights are reproducible on one machine (see
``train_tiny_model``), and with ``train=False`` they are byte-identical everywhere.

Token kinds, per template:

* chatml: special ``<|endoftext|>`` (pad), ``<|im_start|>``, ``<|im_end|>`` (eos, the turn closer);
  non-special added tokens ``<think>`` ``</think>`` ``<tool_call>`` ``</tool_call>`` ``<tool_response>``
  ``</tool_response>``: single ids that ``decode(skip_special_tokens=True)`` keeps, as in Qwen3.
* llama3: special ``<|begin_of_text|>`` (bos), ``<|end_of_text|>`` (eos, *not* the turn closer),
  ``<|start_header_id|>``, ``<|end_header_id|>``, ``<|eot_id|>`` (closes a turn), ``<|eom_id|>`` (closes
  an assistant turn that called a tool), ``<|python_tag|>``, ``<|finetune_right_pad_id|>`` (pad);
  generation_config.json stops on eot, eom and end_of_text.

``resolve_model("tiny")`` (or ``"tiny-<template>"``) builds such a model once into the cache directory
and returns its path; any other name is returned unchanged.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

from worker.tiny_training import DEFAULT_TRAIN_STEPS, tokenizer_corpus, train_tiny_model

__all__ = [
    "BUILD_VERSION",
    "LLAMA3_SPECIALS",
    "TINY_TEMPLATES",
    "TokenLayout",
    "build_tiny_model",
    "build_tiny_tokenizer",
    "default_cache_dir",
    "resolve_model",
]

# Bump whenever the output of build_tiny_model changes, so cached builds are not reused.
# 3: trained weights, 4 layers x 128, non-special think/tool tokens, llama3 template (2: its pre-release).
BUILD_VERSION = 3


@dataclass(frozen=True)
class TokenLayout:
    """The special and added tokens of a tokenizer (as its tokenizer_config.json lists them)."""

    specials: tuple[str, ...]  # special tokens, in id order (ids 0..)
    added: tuple[str, ...]  # non-special added tokens (single ids, kept by skip_special_tokens), next ids
    eos: str  # the tokenizer's eos_token and config.eos_token_id
    pad: str
    bos: str | None
    stop: tuple[str, ...]  # generation_config.json eos_token_id (a single id if only one)


_CHATML = TokenLayout(
    specials=("<|endoftext|>", "<|im_start|>", "<|im_end|>"),
    added=("<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"),
    eos="<|im_end|>",
    pad="<|endoftext|>",
    bos=None,
    stop=("<|im_end|>",),
)
LLAMA3_SPECIALS: tuple[str, ...] = (
    "<|begin_of_text|>",
    "<|end_of_text|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eot_id|>",
    "<|eom_id|>",
    "<|python_tag|>",
    "<|finetune_right_pad_id|>",
)
_LLAMA3 = TokenLayout(
    specials=LLAMA3_SPECIALS,
    added=(),
    eos="<|end_of_text|>",
    pad="<|finetune_right_pad_id|>",
    bos="<|begin_of_text|>",
    stop=("<|eot_id|>", "<|eom_id|>", "<|end_of_text|>"),
)
# Built-in chat templates (worker/templates/<name>.jinja) and the tokens each needs.
_TEMPLATE_TOKENS: dict[str, TokenLayout] = {"chatml": _CHATML, "llama3": _LLAMA3}
TINY_TEMPLATES: tuple[str, ...] = tuple(_TEMPLATE_TOKENS)

_MAX_POSITIONS = 2048
VOCAB_SIZE = 3072  # target size of the BPE vocabulary, special tokens and 256 byte symbols included

_MODEL_PREFIX = "tiny"


# --------------------------------------------------------------------------------------------------
# Building
# --------------------------------------------------------------------------------------------------


def _template_tokens(template: str) -> TokenLayout:
    try:
        return _TEMPLATE_TOKENS[template]
    except KeyError:
        raise ValueError(f"unknown tiny template {template!r}; known: {', '.join(TINY_TEMPLATES)}") from None


def _builtin_template_text(template: str) -> str:
    return resources.files("worker").joinpath("templates", f"{template}.jinja").read_text(encoding="utf-8")


def _train_tokenizer(tokens: TokenLayout) -> object:
    """Train the byte-level BPE; returns a ``tokenizers.Tokenizer``.

    Determinism: the BPE trainer counts words in parallel (rayon) into hash maps, but the merges it
    derives depend only on the counts (ties are broken by token ids, and the byte alphabet and special
    tokens get their ids in a fixed order), and the corpus comes from a fixed-seed ``random.Random``.
    Checked with tokenizers 0.23: identical ``tokenizer.json`` across processes and with
    RAYON_NUM_THREADS=1..16, so no single-threading is needed. tests/test_tiny_model.py re-checks it.
    """
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        min_frequency=2,
        show_progress=False,
        special_tokens=[AddedToken(s, special=True, normalized=False) for s in tokens.specials + tokens.added],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator(tokenizer_corpus(), trainer=trainer)
    if not tokens.added:
        return tokenizer
    # The trainer registers all its tokens as special; un-flag the added ones (Qwen3 layout) so that they
    # stay single ids but survive decode(skip_special_tokens=True) and split_special_tokens=True.
    data = json.loads(tokenizer.to_str())
    for entry in data["added_tokens"]:
        if entry["content"] in tokens.added:
            entry["special"] = False
    return Tokenizer.from_str(json.dumps(data))


def build_tiny_tokenizer(
    out_dir: Path, layout: TokenLayout, chat_template: str, max_positions: int = _MAX_POSITIONS
) -> Any:
    """Write a tokenizer with ``layout``'s tokens and ``chat_template``, plus a generation_config.json
    that stops on ``layout.stop``, to ``out_dir``: enough for ``ChatFormat.load`` (seconds, offline).
    Returns the ``PreTrainedTokenizerFast``."""
    import transformers

    hf: Any = transformers
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    named = (layout.eos, layout.pad, layout.bos)
    tokenizer = hf.PreTrainedTokenizerFast(
        tokenizer_object=_train_tokenizer(layout),
        eos_token=layout.eos,
        pad_token=layout.pad,
        bos_token=layout.bos,
        unk_token=None,
        # transformers 5.x: the other specials must be named here to appear in all_special_tokens/ids
        # (tokenizer.json marks them special either way, so decode(skip_special_tokens=True) drops them).
        extra_special_tokens=[t for t in layout.specials if t not in named],
        clean_up_tokenization_spaces=False,
        model_max_length=max_positions,
    )
    # transformers 5.x writes a string chat template to chat_template.jinja (not tokenizer_config.json).
    tokenizer.chat_template = chat_template
    tokenizer.save_pretrained(out_dir)
    _generation_config(tokenizer, layout).save_pretrained(out_dir)
    return tokenizer


def _token_id(tokenizer: Any, token: str | None) -> int | None:
    return None if token is None else int(tokenizer.convert_tokens_to_ids(token))


def _generation_config(tokenizer: Any, layout: TokenLayout) -> Any:
    import transformers

    hf: Any = transformers
    stop_ids = [_token_id(tokenizer, t) for t in layout.stop]
    return hf.GenerationConfig(
        bos_token_id=_token_id(tokenizer, layout.bos),
        eos_token_id=stop_ids[0] if len(stop_ids) == 1 else stop_ids,
        pad_token_id=_token_id(tokenizer, layout.pad),
    )


def build_tiny_model(
    out_dir: Path,
    *,
    template: str = "chatml",
    chat_template_file: Path | None = None,
    layout: TokenLayout | None = None,
    seed: int = 0,
    train: bool = True,
    train_steps: int | None = None,
    max_positions: int = _MAX_POSITIONS,
) -> Path:
    """Write tokenizer + config + weights + chat template to out_dir; return out_dir.

    ``template`` names a built-in template (see ``TINY_TEMPLATES``) and picks the special tokens; if
    ``chat_template_file`` is given its text is used as the chat template instead of the built-in one
    (and the training conversations are rendered with it); ``layout`` gives the tokenizer's special and
    added tokens instead of the built-in template's (for real templates: see ``benchmarks/template_zoo``).
    ``seed`` only affects the weights (the tokenizer is the same for every seed). ``train=False`` skips
    training and leaves the seeded random weights (a few seconds instead of about a minute);
    ``train_steps`` overrides the step count. ``max_positions`` is the context length (RoPE: no weights
    depend on it).
    """
    import torch
    import transformers

    # transformers ships partial annotations (untyped constructors, odd decorators); use it untyped here.
    hf: Any = transformers

    out_dir = Path(out_dir)
    tokens = layout if layout is not None else _template_tokens(template)
    if chat_template_file is not None:
        chat_template = Path(chat_template_file).read_text(encoding="utf-8")
    else:
        chat_template = _builtin_template_text(template)
    steps = (DEFAULT_TRAIN_STEPS if train_steps is None else train_steps) if train else 0

    tokenizer = build_tiny_tokenizer(out_dir, tokens, chat_template, max_positions)
    eos_id, pad_id = _token_id(tokenizer, tokens.eos), _token_id(tokenizer, tokens.pad)
    bos_id = _token_id(tokenizer, tokens.bos)
    config = hf.LlamaConfig(
        vocab_size=len(tokenizer),
        # Big enough to learn the chat structure in a few hundred CPU steps, small enough to train fast.
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=max_positions,
        initializer_range=0.02,
        tie_word_embeddings=False,
        bos_token_id=bos_id,
        eos_token_id=eos_id,
        pad_token_id=pad_id,
        dtype="float32",
    )
    # fork_rng keeps the caller's global RNG state untouched.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = hf.LlamaForCausalLM(config).float()
        if steps:
            train_tiny_model(model, tokenizer, seed=seed, steps=steps)
    model.generation_config = _generation_config(tokenizer, tokens)
    # transformers 5.x always writes safetensors (its safe_serialization argument is gone) and shows a
    # "Writing model shards" progress bar, silenced here.
    bars = hf.utils.logging.is_progress_bar_enabled()
    hf.utils.logging.disable_progress_bar()
    try:
        model.save_pretrained(out_dir)
    finally:
        if bars:
            hf.utils.logging.enable_progress_bar()

    info: dict[str, object] = {
        "builder": "tokentrail tiny",
        "template": template,
        "seed": seed,
        "build_version": BUILD_VERSION,
        "train_steps": steps,
    }
    if chat_template_file is not None:
        info["chat_template_file"] = str(chat_template_file)
    info_file = out_dir / "tokentrail.json"
    info_file.write_text(json.dumps(info, indent=2) + "\n", encoding="utf-8")
    # safetensors >= 0.8 creates its file with mode 0600; give it the mode of an ordinary new file.
    weights = out_dir / "model.safetensors"
    weights.chmod(stat.S_IMODE(info_file.stat().st_mode))
    return out_dir


# --------------------------------------------------------------------------------------------------
# Cache
# --------------------------------------------------------------------------------------------------


def default_cache_dir() -> Path:
    """$TOKENTRAIL_CACHE_DIR or ~/.cache/tokentrail"""
    env = os.environ.get("TOKENTRAIL_CACHE_DIR")
    if env:
        return Path(env).expanduser()
    return Path.home() / ".cache" / "tokentrail"


def _tiny_template(name: str) -> str | None:
    """The template a ``tiny``/``tiny-<template>`` name asks for, or None if it is not such a name."""
    if name == _MODEL_PREFIX:
        return "chatml"
    prefix = _MODEL_PREFIX + "-"
    if not name.startswith(prefix) or Path(name).exists():
        return None
    template = name[len(prefix) :]
    _template_tokens(template)  # "tiny-<unknown>" is a mistake, not a hub id: say so
    return template


def resolve_model(name_or_path: str, *, cache_dir: Path | None = None) -> str:
    """'tiny' or 'tiny-<template>' -> path of a tiny model built (once) into the cache; else unchanged.

    The model is built into ``<cache>/models/tiny-<template>-s0-v<BUILD_VERSION>``: first into a
    temporary sibling directory, which is then renamed into place, so a reader never sees a partial
    build and concurrent processes racing to build it both end up with the same complete directory.
    Anything else (a model directory, a hub id) is returned unchanged; so is an existing path named like
    ``tiny-...``. ``tiny-<unknown template>`` raises ValueError.
    """
    template = _tiny_template(name_or_path)
    if template is None:
        return name_or_path
    models_dir = Path(cache_dir if cache_dir is not None else default_cache_dir()).expanduser() / "models"
    final = (models_dir / f"{_MODEL_PREFIX}-{template}-s0-v{BUILD_VERSION}").absolute()
    return build_cached(final, lambda out: build_tiny_model(out, template=template, seed=0))


def build_cached(final: Path, build: Callable[[Path], object]) -> str:
    """Build a model directory once, atomically: ``build(tmp)`` into a temporary sibling, then rename
    it to ``final``. A reader never sees a partial build; processes racing to build it both end up
    with the same complete directory (the loser uses the winner's)."""
    if (final / "tokentrail.json").is_file():
        return str(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", suffix=".tmp", dir=final.parent))
    try:
        build(tmp)
        # mkdtemp made it 0700; give it the mode of the models directory it lands in.
        tmp.chmod(stat.S_IMODE(final.parent.stat().st_mode))
        try:
            os.rename(tmp, final)
        except OSError:
            # Another process finished first (the target exists and is not empty): use its build.
            if not (final / "tokentrail.json").is_file():
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return str(final)
