"""A tiny, randomly initialised Llama-style chat model built offline, for tests and demos.

``build_tiny_model`` writes a directory that ``AutoTokenizer.from_pretrained`` and
``AutoModelForCausalLM.from_pretrained`` load like any Hugging Face checkpoint: a byte-level BPE
tokenizer trained on text generated here, a chat template, a 2-layer ``LlamaForCausalLM`` with seeded
random weights, and ``tokentrail.json`` describing the build. Nothing is downloaded, and the same
arguments always give byte-identical ``tokenizer.json`` and ``model.safetensors``.

``resolve_model("tiny")`` (or ``"tiny-<template>"``) builds such a model once into the cache directory
and returns its path; any other name is returned unchanged.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import stat
import tempfile
from collections.abc import Iterator
from importlib import resources
from pathlib import Path
from typing import Any

__all__ = [
    "BUILD_VERSION",
    "TINY_TEMPLATES",
    "build_tiny_model",
    "default_cache_dir",
    "resolve_model",
]

# Bump whenever the output of build_tiny_model changes, so cached builds are not reused.
BUILD_VERSION = 1

# Built-in chat templates (worker/templates/<name>.jinja) and the special tokens each needs.
TINY_TEMPLATES: tuple[str, ...] = ("chatml",)

_CHATML_SPECIALS: tuple[str, ...] = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
# Special tokens every tiny model has whatever its template (later work teaches the model to use them).
_EXTRA_SPECIALS: tuple[str, ...] = (
    "<think>",
    "</think>",
    "<tool_call>",
    "</tool_call>",
    "<tool_response>",
    "</tool_response>",
)
# template -> (special tokens in id order, eos token, pad token)
_TEMPLATE_TOKENS: dict[str, tuple[tuple[str, ...], str, str]] = {
    "chatml": (_CHATML_SPECIALS, "<|im_end|>", "<|endoftext|>"),
}

_MAX_POSITIONS = 2048
VOCAB_SIZE = 3072  # target size of the BPE vocabulary, special tokens and 256 byte symbols included
# The tokenizer does not depend on the model seed: every tiny model of a template shares one tokenizer.
_CORPUS_SEED = 20240229
_CORPUS_SENTENCES = 6000

_MODEL_PREFIX = "tiny"


# --------------------------------------------------------------------------------------------------
# Training text: a deterministic mix of English-like prose, made-up words, numbers, code and chat.
# --------------------------------------------------------------------------------------------------


def _words(text: str) -> tuple[str, ...]:
    return tuple(text.split())


_NOUNS = _words(
    "time year people way day man woman child world life hand part place case week company system "
    "program question work government number night point home water room mother area money story fact "
    "month lot right study book eye job word business issue side kind head house service friend father "
    "power hour game line end member law car city community name president team minute idea kid body "
    "information back parent face others level office door health person art war history party result "
    "change morning reason research girl guy moment air teacher force education model server token "
    "river mountain garden window table kitchen letter music picture market bridge island forest train "
    "computer file function value list string message answer problem data network engine weather road"
)
_VERBS = _words(
    "is was has had makes made says said goes went takes took sees saw knows knew gets got gives gave "
    "finds found thinks thought tells told becomes became leaves left feels felt brings brought begins "
    "began keeps kept holds held writes wrote stands stood hears heard lets meant sets met runs ran pays "
    "paid sits sat speaks spoke reads learns changes leads understands watches follows stops creates "
    "opens walks wins offers remembers loves considers appears buys waits serves dies sends expects "
    "builds stays falls cuts reaches kills remains suggests raises passes sells requires reports decides "
    "returns explains hopes develops carries breaks receives agrees supports hits produces eats covers "
    "catches draws chooses computes parses sorts streams encodes decodes loads saves"
)
_ADJECTIVES = _words(
    "good new first last long great little own other old right big high different small large next "
    "early young important few public bad same able local sure free better true whole clear certain "
    "hard open special easy strong possible recent late simple quiet bright dark warm cold quick slow "
    "happy careful empty full heavy light short tall green blue red yellow ancient modern tiny exact"
)
_ADVERBS = _words(
    "also very often however too usually really early never always sometimes together likely simply "
    "generally instead actually again rather almost especially ever quickly probably already below "
    "directly therefore else thus easily eventually exactly certainly normally currently extremely"
)
_FUNCTION_WORDS = _words(
    "the the the a a an this that these those my your his her its our their some every no any"
)
_PREPOSITIONS = _words(
    "in on at by for with about against between into through during before after above below to from "
    "up down of off over under near behind beyond across"
)
_CONJUNCTIONS = ("and", "but", "or", "so", "because", "while", "although", "when", "if", "since")
_PRONOUNS = ("I", "you", "he", "she", "it", "we", "they")
_QUESTION_WORDS = ("What", "Why", "How", "Where", "When", "Who", "Which")
_NAMES = _words(
    "Alice Bob Carol Dave Erin Frank Grace Heidi Ivan Judy Mallory Niaj Olivia Peggy Rupert Sybil "
    "Trent Victor Walter Paris London Berlin Tokyo Lagos Lima Oslo Cairo Delhi Sydney Toronto Madrid"
)
_ACCENTED = ("café", "naïve", "über", "façade", "jalapeño", "résumé", "Zürich", "São Paulo", "smörgåsbord")
_SYLLABLES = _words(
    "ka ri to ne mo la shi pe du vo ra ti en al or ex st ing ion er ly th qu ve ba go zu mi no re fa"
)
_IDENTIFIERS = _words(
    "value count index result items data config path name text buffer offset length total token_ids "
    "request response user_id session cache logits prompt state queue worker engine batch step"
)
_TOOL_NAMES = ("get_weather", "search_web", "read_file", "run_python", "lookup_user", "convert_units")


def _made_up_word(rng: random.Random) -> str:
    return "".join(rng.choice(_SYLLABLES) for _ in range(rng.randint(2, 4)))


def _noun_phrase(rng: random.Random) -> str:
    words = [rng.choice(_FUNCTION_WORDS)]
    if rng.random() < 0.4:
        words.append(rng.choice(_ADJECTIVES))
    words.append(rng.choice(_NOUNS) if rng.random() < 0.93 else _made_up_word(rng))
    return " ".join(words)


def _number(rng: random.Random) -> str:
    kind = rng.randrange(8)
    if kind == 0:
        return str(rng.randint(0, 100))
    if kind == 1:
        return str(rng.randint(100, 1_000_000))
    if kind == 2:
        return f"{rng.uniform(0, 1000):.{rng.randint(1, 3)}f}"
    if kind == 3:
        return f"{rng.randint(1990, 2030)}-{rng.randint(1, 12):02d}-{rng.randint(1, 28):02d}"
    if kind == 4:
        return f"{rng.randint(0, 23):02d}:{rng.randint(0, 59):02d}"
    if kind == 5:
        return f"{rng.randint(1, 99)}%"
    if kind == 6:
        return f"${rng.randint(1, 999)}.{rng.randint(0, 99):02d}"
    return f"{rng.randint(1, 9)},{rng.randint(0, 999):03d}"


def _sentence(rng: random.Random) -> str:
    kind = rng.randrange(10)
    if kind < 5:
        subject = _noun_phrase(rng) if rng.random() < 0.6 else rng.choice(_PRONOUNS + _NAMES)
        parts = [subject]
        if rng.random() < 0.3:
            parts.append(rng.choice(_ADVERBS))
        parts += [rng.choice(_VERBS), _noun_phrase(rng)]
        if rng.random() < 0.5:
            parts += [rng.choice(_PREPOSITIONS), _noun_phrase(rng)]
        if rng.random() < 0.3:
            parts += [rng.choice(_CONJUNCTIONS), rng.choice(_PRONOUNS), rng.choice(_VERBS), _number(rng)]
        text = " ".join(parts)
        text = text[0].upper() + text[1:]
        return text + rng.choice((".", ".", ".", "!", "...", ";"))
    if kind < 7:
        noun = _noun_phrase(rng)
        return f"{rng.choice(_QUESTION_WORDS)} {rng.choice(('does', 'did', 'can', 'will'))} {noun} " + (
            f"{rng.choice(_VERBS)} {rng.choice(_PREPOSITIONS)} {rng.choice(_NAMES)}?"
        )
    if kind == 7:
        return (
            f'"{rng.choice(_NAMES)}, {rng.choice(_ADJECTIVES)} {rng.choice(_NOUNS)}!" '
            f"({_number(rng)} {rng.choice(_NOUNS)}s, {rng.choice(_ACCENTED)})"
        )
    if kind == 8:
        return (
            f"- {rng.choice(_ADJECTIVES).capitalize()} {rng.choice(_NOUNS)}: {_number(rng)} ({_number(rng)})"
        )
    return (
        f"On {_number(rng)}, {rng.choice(_NAMES)} {rng.choice(_VERBS)} {_number(rng)} {rng.choice(_NOUNS)}s."
    )


def _code(rng: random.Random) -> str:
    a, b = rng.choice(_IDENTIFIERS), rng.choice(_IDENTIFIERS)
    fn = f"{rng.choice(_VERBS).rstrip('s')}_{rng.choice(_NOUNS)}"
    kind = rng.randrange(6)
    if kind == 0:
        return (
            f"def {fn}({a}: int, {b}: str = None) -> dict:\n"
            f'    """{rng.choice(_VERBS).capitalize()} the {rng.choice(_NOUNS)}."""\n'
            f"    if {a} > {rng.randint(0, 99)}:\n"
            f"        return {{'{b}': {b}, 'n': len({a})}}\n"
            f"    for i in range({a}):\n"
            f"        {b} += str(i)\n"
            f"    return None\n"
        )
    if kind == 1:
        return (
            f"function {fn}({a}, {b}) {{\n"
            f"  const x = {a}.map((v) => v * {rng.randint(2, 9)});\n"
            f"  if (x.length === 0 && !{b}) {{ return null; }}\n"
            f"  return [...x, {b}];\n"
            f"}}\n"
        )
    if kind == 2:
        obj = {a: rng.randint(0, 500), b: rng.choice(_NOUNS), "ok": rng.random() < 0.5, "items": [1, 2, 3]}
        return json.dumps(obj, indent=rng.choice((None, 2)))
    if kind == 3:
        flag = f"--{rng.choice(_IDENTIFIERS)}={rng.randint(1, 64)}"
        return f"$ python -m {rng.choice(_IDENTIFIERS)} {flag} ./{b}.txt"
    if kind == 4:
        return f"SELECT {a}, {b} FROM {rng.choice(_NOUNS)}s WHERE {a} >= {rng.randint(0, 999)} ORDER BY {b};"
    return f"{a}[{rng.randint(0, 9)}] = ({b} + {rng.randint(1, 9)}) * {a}  # {rng.choice(_ADJECTIVES)}"


def _chat(rng: random.Random) -> str:
    question = _sentence(rng)
    tool = rng.choice(_TOOL_NAMES)
    args = json.dumps({"city": rng.choice(_NAMES), "units": rng.choice(("metric", "imperial"))})
    kind = rng.randrange(3)
    if kind == 0:
        return f"system\nYou are a helpful assistant.\nuser\n{question}\nassistant\n{_sentence(rng)}\n"
    if kind == 1:
        return (
            f"user\n{question}\nassistant\nthink\nThe user asks about {_noun_phrase(rng)}. "
            f"{_sentence(rng)}\n/think\n\n{_sentence(rng)}\n"
        )
    return (
        f'assistant\ntool_call\n{{"name": "{tool}", "arguments": {args}}}\n/tool_call\n'
        f'user\ntool_response\n{{"result": "{_number(rng)}", "status": "ok"}}\n/tool_response\n'
    )


def _training_text() -> Iterator[str]:
    """Yield the training corpus (a few hundred KB) in a fixed order from a fixed seed."""
    rng = random.Random(_CORPUS_SEED)
    for _ in range(_CORPUS_SENTENCES):
        roll = rng.random()
        if roll < 0.12:
            yield _code(rng)
        elif roll < 0.24:
            yield _chat(rng)
        else:
            yield " ".join(_sentence(rng) for _ in range(rng.randint(1, 4)))


# --------------------------------------------------------------------------------------------------
# Building
# --------------------------------------------------------------------------------------------------


def _template_tokens(template: str) -> tuple[tuple[str, ...], str, str]:
    try:
        return _TEMPLATE_TOKENS[template]
    except KeyError:
        raise ValueError(f"unknown tiny template {template!r}; known: {', '.join(TINY_TEMPLATES)}") from None


def _builtin_template_text(template: str) -> str:
    return resources.files("worker").joinpath("templates", f"{template}.jinja").read_text(encoding="utf-8")


def _train_tokenizer(specials: tuple[str, ...]) -> object:
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
        special_tokens=[AddedToken(s, special=True, normalized=False) for s in specials],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator(_training_text(), trainer=trainer)
    return tokenizer


def build_tiny_model(
    out_dir: Path,
    *,
    template: str = "chatml",
    chat_template_file: Path | None = None,
    seed: int = 0,
) -> Path:
    """Write tokenizer + config + random weights + chat template to out_dir; return out_dir.

    ``template`` names a built-in template (see ``TINY_TEMPLATES``) and picks the special tokens; if
    ``chat_template_file`` is given its text is used as the chat template instead of the built-in one.
    ``seed`` only affects the weights (the tokenizer is the same for every seed).
    """
    import torch
    import transformers

    # transformers ships partial annotations (untyped constructors, odd decorators); use it untyped here.
    hf: Any = transformers

    out_dir = Path(out_dir)
    specials, eos_token, pad_token = _template_tokens(template)
    all_specials = specials + _EXTRA_SPECIALS
    if chat_template_file is not None:
        chat_template = Path(chat_template_file).read_text(encoding="utf-8")
    else:
        chat_template = _builtin_template_text(template)

    out_dir.mkdir(parents=True, exist_ok=True)

    tokenizer = hf.PreTrainedTokenizerFast(
        tokenizer_object=_train_tokenizer(all_specials),
        eos_token=eos_token,
        pad_token=pad_token,
        bos_token=None,
        unk_token=None,
        # transformers 5.x: the other specials must be named here to appear in all_special_tokens/ids
        # (tokenizer.json marks them special either way, so decode(skip_special_tokens=True) drops them).
        extra_special_tokens=[t for t in all_specials if t not in (eos_token, pad_token)],
        clean_up_tokenization_spaces=False,
        model_max_length=_MAX_POSITIONS,
    )
    # transformers 5.x writes a string chat template to chat_template.jinja (not tokenizer_config.json).
    tokenizer.chat_template = chat_template
    tokenizer.save_pretrained(out_dir)

    eos_id = int(tokenizer.convert_tokens_to_ids(eos_token))
    pad_id = int(tokenizer.convert_tokens_to_ids(pad_token))
    config = hf.LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=_MAX_POSITIONS,
        initializer_range=0.02,
        tie_word_embeddings=False,
        bos_token_id=None,
        eos_token_id=eos_id,
        pad_token_id=pad_id,
        dtype="float32",
    )
    # fork_rng keeps the caller's global RNG state untouched.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = hf.LlamaForCausalLM(config).float()
    model.generation_config = hf.GenerationConfig(bos_token_id=None, eos_token_id=eos_id, pad_token_id=pad_id)
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
    if (final / "tokentrail.json").is_file():
        return str(final)
    models_dir.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", suffix=".tmp", dir=models_dir))
    try:
        build_tiny_model(tmp, template=template, seed=0)
        # mkdtemp made it 0700; give it the mode of the models directory it lands in.
        tmp.chmod(stat.S_IMODE(models_dir.stat().st_mode))
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
