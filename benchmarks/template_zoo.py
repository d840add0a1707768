"""Real chat templates, each with the special and added tokens of its model's tokenizer.

Origin of the templates (``SOURCES``), neither copied into this repository:
- ``llama.cpp``: llama.cpp's ``models/templates`` folder, which llama.cpp fills with the templates that
  model repositories ship (its README lists the model id of each file), taken from the source
  distribution of the PyPI package ``llama-cpp-python`` (pinned), which vendors llama.cpp whole.
- ``vllm``: the ``examples/*.jinja`` templates of the vLLM source distribution (pinned): the templates
  vLLM users pass with ``--chat-template``, mostly tool-calling variants of model templates (Gemma 3 and
  Phi-4-mini among them, which the llama.cpp folder lacks).
``fetch_templates(source)`` downloads the sdist once from PyPI (checking PyPI's sha256) and keeps the
``.jinja`` files, with a ``SOURCE.json`` naming package, version, path and digest, in
``<cache>/templates/<source>-<version>/``.

Tokens: ``LAYOUTS`` holds, for the families we check by name, the special tokens (``special: true``
in ``tokenizer_config.json``), non-special added tokens (single ids that ``decode`` keeps, such as
Qwen's ``<tool_call>``), bos/eos/pad, and the stop ids of ``generation_config.json``, written down
from the model repositories' files. Every other template gets a layout derived from the markers its
own text writes (``derived_layout``): ``<|...|>``, ``<｜...｜>``, ``[UPPER]`` and ``<start_of_...>``-
style strings become special tokens, ``<think>``-style tags added ones. A derived layout is a guess;
the report marks it.
"""

# DeepSeek's tokens are spelled with FULLWIDTH VERTICAL LINE (U+FF5C): the real tokens, not typos.
# ruff: noqa: RUF001, RUF002

from __future__ import annotations

import hashlib
import json
import re
import sys
import tarfile
import tempfile
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from worker.chat_format import ChatFormat
from worker.tiny.build import BUILD_VERSION, build_tiny_model, build_tiny_tokenizer
from worker.tiny.cache import build_cached, default_cache_dir
from worker.tiny.layout import LLAMA3_SPECIALS, TokenLayout


@dataclass(frozen=True)
class Source:
    package: str  # on PyPI
    version: str
    path: str  # the folder of templates inside the sdist (below its top directory)


SOURCES: dict[str, Source] = {
    "llama.cpp": Source("llama-cpp-python", "0.3.36", "vendor/llama.cpp/models/templates"),
    "vllm": Source("vllm", "0.33.0", "examples"),
}

# The 18 families of issue 9: short name -> (source, file stem).
FAMILIES: dict[str, tuple[str, str]] = {
    "qwen3": ("llama.cpp", "Qwen-Qwen3-0.6B"),
    "qwen2.5": ("llama.cpp", "Qwen-Qwen2.5-7B-Instruct"),
    "hermes3-tool-use": ("llama.cpp", "NousResearch-Hermes-3-Llama-3.1-8B-tool_use"),
    "deepseek-r1-distill": ("llama.cpp", "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B"),
    "deepseek-v3.1": ("llama.cpp", "deepseek-ai-DeepSeek-V3.1"),
    "llama3.1": ("llama.cpp", "meta-llama-Llama-3.1-8B-Instruct"),
    "llama3.2": ("llama.cpp", "meta-llama-Llama-3.2-3B-Instruct"),
    "mistral-nemo": ("llama.cpp", "mistralai-Mistral-Nemo-Instruct-2407"),
    "mistral-small-3.2": ("llama.cpp", "Mistral-Small-3.2-24B-Instruct-2506"),
    "gemma2": ("llama.cpp", "google-gemma-2-2b-it"),
    "gemma3": ("vllm", "tool_chat_template_gemma3_pythonic"),
    "phi3.5": ("llama.cpp", "microsoft-Phi-3.5-mini-instruct"),
    "phi4-mini": ("vllm", "tool_chat_template_phi4_mini"),
    "granite3.3": ("llama.cpp", "ibm-granite-granite-3.3-2B-Instruct"),
    "command-r-plus-tool-use": ("llama.cpp", "CohereForAI-c4ai-command-r-plus-tool_use"),
    "command-r7b": ("llama.cpp", "CohereForAI-c4ai-command-r7b-12-2024-tool_use"),
    "gpt-oss": ("llama.cpp", "openai-gpt-oss-120b"),
}

# Variables a template requires that only its model's own client passes (the worker's
# --chat-template-kwargs): firefunction-v2 writes ``functions`` (a JSON string) and ``datetime`` into its
# system prompt.
TEMPLATE_KWARGS: dict[str, dict[str, object]] = {
    "fireworks-ai-llama-3-firefunction-v2": {"functions": "[]", "datetime": "2026-01-01"}
}

_QWEN_SPECIALS = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|object_ref_start|>",
    "<|object_ref_end|>",
    "<|box_start|>",
    "<|box_end|>",
    "<|quad_start|>",
    "<|quad_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|vision_pad|>",
    "<|image_pad|>",
    "<|video_pad|>",
)
_QWEN_ADDED = (
    "<tool_call>",
    "</tool_call>",
    "<|fim_prefix|>",
    "<|fim_middle|>",
    "<|fim_suffix|>",
    "<|fim_pad|>",
    "<|repo_name|>",
    "<|file_sep|>",
)
_QWEN25 = TokenLayout(
    specials=_QWEN_SPECIALS,
    added=_QWEN_ADDED,
    eos="<|im_end|>",
    pad="<|endoftext|>",
    bos=None,
    stop=("<|im_end|>", "<|endoftext|>"),
)
_QWEN3 = TokenLayout(
    specials=_QWEN_SPECIALS,
    added=(*_QWEN_ADDED, "<tool_response>", "</tool_response>", "<think>", "</think>"),
    eos="<|im_end|>",
    pad="<|endoftext|>",
    bos=None,
    stop=("<|im_end|>", "<|endoftext|>"),
)
_LLAMA31 = TokenLayout(
    specials=LLAMA3_SPECIALS,
    added=(),
    eos="<|eot_id|>",
    pad="<|finetune_right_pad_id|>",
    bos="<|begin_of_text|>",
    stop=("<|end_of_text|>", "<|eom_id|>", "<|eot_id|>"),
)
_HERMES3 = TokenLayout(
    specials=(*LLAMA3_SPECIALS, "<|im_start|>", "<|im_end|>"),
    added=("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"),
    eos="<|im_end|>",
    pad="<|finetune_right_pad_id|>",
    bos="<|begin_of_text|>",
    stop=("<|im_end|>", "<|end_of_text|>"),
)
_DS_TOOLS = (
    "<｜tool▁calls▁begin｜>",
    "<｜tool▁calls▁end｜>",
    "<｜tool▁call▁begin｜>",
    "<｜tool▁call▁end｜>",
    "<｜tool▁outputs▁begin｜>",
    "<｜tool▁outputs▁end｜>",
    "<｜tool▁output▁begin｜>",
    "<｜tool▁output▁end｜>",
    "<｜tool▁sep｜>",
)
_DEEPSEEK = TokenLayout(
    specials=("<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜▁pad▁｜>", "<｜User｜>", "<｜Assistant｜>"),
    added=(*_DS_TOOLS, "<think>", "</think>"),
    eos="<｜end▁of▁sentence｜>",
    pad="<｜▁pad▁｜>",
    bos="<｜begin▁of▁sentence｜>",
    stop=("<｜end▁of▁sentence｜>",),
)
_MISTRAL_TEKKEN = TokenLayout(
    specials=(
        "<unk>",
        "<s>",
        "</s>",
        "[INST]",
        "[/INST]",
        "[AVAILABLE_TOOLS]",
        "[/AVAILABLE_TOOLS]",
        "[TOOL_RESULTS]",
        "[/TOOL_RESULTS]",
        "[TOOL_CALLS]",
        "[IMG]",
        "<pad>",
        "[IMG_BREAK]",
        "[IMG_END]",
        "[PREFIX]",
        "[MIDDLE]",
        "[SUFFIX]",
        "[SYSTEM_PROMPT]",
        "[/SYSTEM_PROMPT]",
        "[TOOL_CONTENT]",
        "[ARGS]",
        "[CALL_ID]",
        "[THINK]",
        "[/THINK]",
    ),
    added=(),
    eos="</s>",
    pad="<pad>",
    bos="<s>",
    stop=("</s>",),
)
_GEMMA2 = TokenLayout(
    specials=("<pad>", "<eos>", "<bos>", "<unk>", "<mask>", "<start_of_turn>", "<end_of_turn>"),
    added=(),
    eos="<eos>",
    pad="<pad>",
    bos="<bos>",
    stop=("<eos>", "<end_of_turn>"),
)
_GEMMA3 = TokenLayout(
    specials=(
        "<pad>",
        "<eos>",
        "<bos>",
        "<unk>",
        "<mask>",
        "[@BOS@]",
        "<start_of_turn>",
        "<end_of_turn>",
        "<start_of_image>",
        "<end_of_image>",
        "<image_soft_token>",
    ),
    added=(),
    eos="<eos>",
    pad="<pad>",
    bos="<bos>",
    stop=("<eos>", "<end_of_turn>"),
)
_PHI4_MINI = TokenLayout(
    specials=(
        "<|endoftext|>",
        "<|endofprompt|>",
        "<|assistant|>",
        "<|end|>",
        "<|user|>",
        "<|system|>",
        "<|tool|>",
        "<|/tool|>",
        "<|tool_call|>",
        "<|/tool_call|>",
        "<|tool_response|>",
        "<|tag|>",
    ),
    added=(),
    eos="<|endoftext|>",
    pad="<|endoftext|>",
    bos="<|endoftext|>",
    stop=("<|end|>", "<|endoftext|>"),
)
_PHI35 = TokenLayout(
    specials=(
        "<unk>",
        "<s>",
        "</s>",
        "<|endoftext|>",
        "<|assistant|>",
        "<|placeholder1|>",
        "<|placeholder2|>",
        "<|placeholder3|>",
        "<|placeholder4|>",
        "<|system|>",
        "<|end|>",
        "<|placeholder5|>",
        "<|placeholder6|>",
        "<|user|>",
    ),
    added=(),
    eos="<|endoftext|>",
    pad="<|endoftext|>",
    bos="<s>",
    stop=("<|end|>", "<|assistant|>", "<|endoftext|>"),
)
_GRANITE = TokenLayout(
    specials=(
        "<|end_of_text|>",
        "<fim_prefix>",
        "<fim_middle>",
        "<fim_suffix>",
        "<fim_pad>",
        "<filename>",
        "<gh_stars>",
        "<issue_start>",
        "<issue_comment>",
        "<issue_closed>",
        "<jupyter_start>",
        "<jupyter_text>",
        "<jupyter_code>",
        "<jupyter_output>",
        "<empty_output>",
        "<commit_before>",
        "<commit_msg>",
        "<commit_after>",
        "<reponame>",
        "<|start_of_role|>",
        "<|end_of_role|>",
        "<|tool_call|>",
        "<|start_of_cite|>",
        "<|end_of_cite|>",
        "<|start_of_plugin|>",
        "<|end_of_plugin|>",
        "<|pad|>",
    ),
    added=(),
    eos="<|end_of_text|>",
    pad="<|pad|>",
    bos="<|end_of_text|>",
    stop=("<|end_of_text|>",),
)
_COMMAND_R = TokenLayout(
    specials=(
        "<PAD>",
        "<UNK>",
        "<CLS>",
        "<SEP>",
        "<MASK_TOKEN>",
        "<BOS_TOKEN>",
        "<EOS_TOKEN>",
        "<EOP_TOKEN>",
        "<|START_OF_TURN_TOKEN|>",
        "<|END_OF_TURN_TOKEN|>",
        "<|USER_TOKEN|>",
        "<|CHATBOT_TOKEN|>",
        "<|SYSTEM_TOKEN|>",
    ),
    added=(),
    eos="<|END_OF_TURN_TOKEN|>",
    pad="<PAD>",
    bos="<BOS_TOKEN>",
    stop=("<|END_OF_TURN_TOKEN|>",),
)
_COMMAND_R7B = TokenLayout(
    specials=(
        *_COMMAND_R.specials,
        "<|START_THINKING|>",
        "<|END_THINKING|>",
        "<|START_RESPONSE|>",
        "<|END_RESPONSE|>",
        "<|START_ACTION|>",
        "<|END_ACTION|>",
        "<|START_TOOL_RESULT|>",
        "<|END_TOOL_RESULT|>",
    ),
    added=(),
    eos="<|END_OF_TURN_TOKEN|>",
    pad="<PAD>",
    bos="<BOS_TOKEN>",
    stop=("<|END_OF_TURN_TOKEN|>",),
)
_GPT_OSS = TokenLayout(
    specials=(
        "<|startoftext|>",
        "<|endoftext|>",
        "<|return|>",
        "<|constrain|>",
        "<|channel|>",
        "<|start|>",
        "<|end|>",
        "<|message|>",
        "<|call|>",
    ),
    added=(),
    eos="<|return|>",
    pad="<|endoftext|>",
    bos="<|startoftext|>",
    stop=("<|return|>", "<|endoftext|>", "<|call|>"),
)

LAYOUTS: dict[str, TokenLayout] = {
    "Qwen-Qwen3-0.6B": _QWEN3,
    "Qwen-QwQ-32B": _QWEN3,
    "Qwen-Qwen2.5-7B-Instruct": _QWEN25,
    "NousResearch-Hermes-3-Llama-3.1-8B-tool_use": _HERMES3,
    "NousResearch-Hermes-2-Pro-Llama-3-8B-tool_use": _HERMES3,
    "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B": _DEEPSEEK,
    "deepseek-ai-DeepSeek-R1-Distill-Llama-8B": _DEEPSEEK,
    "llama-cpp-deepseek-r1": _DEEPSEEK,
    "deepseek-ai-DeepSeek-V3.1": _DEEPSEEK,
    "meta-llama-Llama-3.1-8B-Instruct": _LLAMA31,
    "meta-llama-Llama-3.2-3B-Instruct": _LLAMA31,
    "meta-llama-Llama-3.3-70B-Instruct": _LLAMA31,
    "fireworks-ai-llama-3-firefunction-v2": _LLAMA31,
    "meetkai-functionary-medium-v3.1": _LLAMA31,
    "meetkai-functionary-medium-v3.2": _LLAMA31,
    "mistralai-Mistral-Nemo-Instruct-2407": _MISTRAL_TEKKEN,
    "Mistral-Small-3.2-24B-Instruct-2506": _MISTRAL_TEKKEN,
    "unsloth-mistral-Devstral-Small-2507": _MISTRAL_TEKKEN,
    "mistralai-Ministral-3-14B-Reasoning-2512": _MISTRAL_TEKKEN,
    "google-gemma-2-2b-it": _GEMMA2,
    "microsoft-Phi-3.5-mini-instruct": _PHI35,
    "tool_chat_template_gemma3_pythonic": _GEMMA3,
    "tool_chat_template_phi4_mini": _PHI4_MINI,
    "ibm-granite-granite-3.3-2B-Instruct": _GRANITE,
    "CohereForAI-c4ai-command-r-plus-tool_use": _COMMAND_R,
    "CohereForAI-c4ai-command-r7b-12-2024-tool_use": _COMMAND_R7B,
    "openai-gpt-oss-120b": _GPT_OSS,
}

# Marker shapes that real tokenizers register as single tokens.
_SPECIAL_SHAPES = re.compile(
    r"<\|[A-Za-z0-9_.:/\- ]{1,40}\|>|<｜[^｜<>\n]{1,40}｜>|\[/?[A-Z][A-Z_]{1,30}\]|<(?:start|end)_of_[a-z_]{1,20}>"
    r"|<\|?[A-Za-z_]{1,20}\|?>(?=\{)|<(?:bos|eos|BOS_TOKEN|EOS_TOKEN)>|<[a-z]{1,12}:(?:bos|eos|pad)>"
)
_ADDED_SHAPES = re.compile(r"</?(?:think|tool_call|tool_response|tool_calls|tools|response|answer|seed:think)>")
_EOS_GUESSES = ("<|im_end|>", "<|eot_id|>", "<end_of_turn>", "<|END_OF_TURN_TOKEN|>", "<|end|>", "</s>")


def _literals(template: str) -> str:
    """Where a Jinja template's markers live, joined: its string literals and its raw text (outside
    ``{% %}``, ``{{ }}`` and ``{# #}``; Cohere2's turn tokens are written there)."""
    literals = (m.group(2) for m in re.finditer(r"(['\"])((?:\\.|(?!\1).)*)\1", template))
    raw = re.sub(r"\{([%{#]).*?[%}#]\}", "\n", template, flags=re.DOTALL)
    return "\n".join([*literals, raw])


def derived_layout(template: str) -> TokenLayout:
    """A plausible token layout for a template whose tokenizer we have not written down."""
    text = _literals(template)
    specials = list(dict.fromkeys(m.group(0) for m in _SPECIAL_SHAPES.finditer(text)))
    added = [t for t in dict.fromkeys(m.group(0) for m in _ADDED_SHAPES.finditer(text)) if t not in specials]
    eos = next((t for t in _EOS_GUESSES if t in specials), None)
    eos = eos or next((t for t in specials if t.endswith(":eos>")), "</s>")
    for token in ("<s>", "</s>", "<pad>", eos):
        if token not in specials:
            specials.append(token)
    # Stop on eos and on every marker that reads as an end (``<|assistant_end|>``, ``<|eot|>``...).
    ends = [t for t in specials if re.search(r"end|eot|eos|return|call\|", t, re.I) and t not in ("<s>", "<pad>")]
    stop = tuple(dict.fromkeys([eos, *ends]))
    return TokenLayout(specials=tuple(specials), added=tuple(added), eos=eos, pad="<pad>", bos="<s>", stop=stop)


@dataclass(frozen=True)
class ZooTemplate:
    name: str  # the file stem, as in its source's folder
    path: Path
    layout: TokenLayout
    derived: bool  # layout guessed from the template text (not written down from the tokenizer)
    source: str = ""  # a key of SOURCES, or "" for a user's folder

    @property
    def kwargs(self) -> dict[str, object]:
        return TEMPLATE_KWARGS.get(self.name, {})

    @property
    def text(self) -> str:
        return self.path.read_text(encoding="utf-8")


def templates_dir(source: str = "llama.cpp", cache_dir: Path | None = None) -> Path:
    return (cache_dir or default_cache_dir()) / "templates" / f"{source}-{SOURCES[source].version}"


def _sdist(source: Source, into: Path) -> tuple[Path, str]:
    """Download the pinned sdist from PyPI into ``into``; (file, sha256), checked against PyPI's digest.

    PyPI's simple index (JSON form) rather than ``pip download``: pip would build the package's
    metadata, which for vLLM means its whole build system."""
    index = urllib.request.Request(
        f"https://pypi.org/simple/{source.package}/", headers={"Accept": "application/vnd.pypi.simple.v1+json"}
    )
    with urllib.request.urlopen(index, timeout=60) as resp:
        files = json.load(resp)["files"]
    sdist = next(f for f in files if f["filename"].endswith(f"-{source.version}.tar.gz"))
    out = into / sdist["filename"]
    digest = hashlib.sha256()
    with urllib.request.urlopen(sdist["url"], timeout=300) as resp, out.open("wb") as f:
        while chunk := resp.read(1 << 20):
            digest.update(chunk)
            f.write(chunk)
    if digest.hexdigest() != sdist["hashes"]["sha256"]:
        raise RuntimeError(f"{out.name}: sha256 {digest.hexdigest()} differs from PyPI's {sdist['hashes']['sha256']}")
    return out, digest.hexdigest()


def fetch_templates(source: str = "llama.cpp", cache_dir: Path | None = None) -> Path:
    """The folder of one source's real templates, downloading its pinned sdist from PyPI the first time
    (llama.cpp: ~75 MB, vllm: ~47 MB)."""
    final = templates_dir(source, cache_dir)
    if (final / "SOURCE.json").is_file():
        return final
    src = SOURCES[source]
    final.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=final.parent) as tmp:
        print(f"fetching chat templates from the {src.package}=={src.version} sdist (PyPI)...", file=sys.stderr)
        sdist, sha256 = _sdist(src, Path(tmp))
        out = Path(tmp) / "templates"
        out.mkdir()
        names = []
        with tarfile.open(sdist) as tar:
            for member in tar.getmembers():
                parts = member.name.split("/", 1)
                # only the folder itself, not its subfolders (vLLM keeps pooling templates below examples/)
                if len(parts) == 2 and str(Path(parts[1]).parent) == src.path and member.isfile():
                    name = Path(member.name).name
                    if name.endswith(".jinja"):
                        data = tar.extractfile(member)
                        assert data is not None
                        (out / name).write_bytes(data.read())
                        names.append(name)
        record = {
            "package": src.package,
            "version": src.version,
            "sdist": sdist.name,
            "sha256": sha256,
            "path": src.path,
            "files": sorted(names),
        }
        (out / "SOURCE.json").write_text(json.dumps(record, indent=1) + "\n")
        try:
            out.rename(final)
        except OSError:
            if not (final / "SOURCE.json").is_file():
                raise
    return final


def load_folder(folder: Path, source: str = "") -> list[ZooTemplate]:
    """Every ``.jinja`` file of ``folder``, with its layout (written down, or derived from its text)."""
    out = []
    for path in sorted(folder.glob("*.jinja")):
        layout = LAYOUTS.get(path.stem)
        derived = layout is None
        text = path.read_text(encoding="utf-8")
        out.append(ZooTemplate(path.stem, path, layout or derived_layout(text), derived, source))
    return out


def load_zoo(sources: tuple[str, ...] = tuple(SOURCES)) -> list[ZooTemplate]:
    """The real templates of ``sources`` (default: all), fetched on first use."""
    return [t for source in sources for t in load_folder(fetch_templates(source), source)]


def family(name: str) -> ZooTemplate:
    """One of ``FAMILIES`` by short name (``"gpt-oss"``), from the fetched templates."""
    source, stem = FAMILIES[name]
    return next(t for t in load_folder(fetch_templates(source), source) if t.name == stem)


ZOO_CONTEXT = 8192  # long tool preambles (Command-R's) tokenize long with the tiny BPE vocabulary


def zoo_model(template: ZooTemplate, *, train_steps: int = 0, cache_dir: Path | None = None) -> str:
    """A tiny model (cached) with this template and its tokens: random weights unless ``train_steps``."""
    key = hashlib.sha256((template.text + repr(template.layout)).encode()).hexdigest()[:12]
    name = f"zoo-{template.name}-{key}-t{train_steps}-c{ZOO_CONTEXT}-v{BUILD_VERSION}"
    return build_cached(
        ((cache_dir or default_cache_dir()) / "models" / name).absolute(),
        lambda out: build_tiny_model(
            out,
            chat_template_file=template.path,
            layout=template.layout,
            train=bool(train_steps),
            train_steps=train_steps or None,
            max_positions=ZOO_CONTEXT,
        ),
    )


def zoo_format(template: ZooTemplate, *, cache_dir: Path | None = None) -> ChatFormat:
    """The ChatFormat of a template with its tokens: a tokenizer only (no weights), built once, cached."""
    key = hashlib.sha256((template.text + repr(template.layout)).encode()).hexdigest()[:12]
    final = ((cache_dir or default_cache_dir()) / "zoo-tokenizers" / f"{template.name}-{key}").absolute()

    def build(out: Path) -> None:
        build_tiny_tokenizer(out, template.layout, template.text)
        (out / "tokentrail.json").write_text("{}\n")

    return ChatFormat.load(build_cached(final, build), template_kwargs=template.kwargs)
