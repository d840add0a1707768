"""Builds the tiny model's directory: a byte-level BPE tokenizer trained on ``worker.tiny.synthetic``'s
corpus, a chat template, generation_config.json, a seeded 4-layer ``LlamaForCausalLM`` briefly trained
(``worker.tiny.training``) unless ``train=False``, and ``tokentrail.json`` describing the build.
"""

from __future__ import annotations

import json
import stat
from importlib import resources
from pathlib import Path
from typing import Any

from worker.tiny.layout import TokenLayout, template_layout
from worker.tiny.synthetic import tokenizer_corpus
from worker.tiny.training import DEFAULT_TRAIN_STEPS, train_tiny_model

__all__ = ["BUILD_VERSION", "build_tiny_model", "build_tiny_tokenizer"]

# Bump whenever the output of build_tiny_model changes, so cached builds are not reused.
# 3: trained weights, 4 layers x 128, non-special think/tool tokens, llama3 template (2: its pre-release).
BUILD_VERSION = 3

_MAX_POSITIONS = 2048
VOCAB_SIZE = 3072  # target size of the BPE vocabulary, special tokens and 256 byte symbols included


def _builtin_template_text(template: str) -> str:
    return resources.files("worker.tiny").joinpath("templates", f"{template}.jinja").read_text(encoding="utf-8")


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

    ``template`` names a built-in template (see ``worker.tiny.layout``) and picks the special tokens;
    if ``chat_template_file`` is given its text is used as the chat template instead of the built-in one
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
    tokens = layout if layout is not None else template_layout(template)
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
