"""The models the benchmarks serve and the vLLM environment's python.

``prepare_model`` builds (once, then cached) a tiny model for a built-in template, a real template family
of ``benchmarks/template_zoo`` or a Jinja template file.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

from benchmarks.progress import say


def prepare_model(template: str, train_steps: int = 100) -> str:
    """The directory of the tiny model for a built-in template name or a Jinja template file."""
    from worker.tiny.build import BUILD_VERSION, build_tiny_model
    from worker.tiny.cache import build_cached, default_cache_dir, resolve_model
    from worker.tiny.layout import TINY_TEMPLATES

    if template in TINY_TEMPLATES:
        say(f"preparing tiny-{template} (built and trained once, then cached)...")
        return resolve_model(f"tiny-{template}")
    from benchmarks.template_zoo import FAMILIES, family, zoo_model

    if template in FAMILIES:  # a real template with its model's tokens, briefly trained (cached)
        say(f"preparing a tiny model with the {template} template and tokens ({train_steps} training steps)...")
        return zoo_model(family(template), train_steps=train_steps)
    path = Path(template)
    if not path.is_file():
        raise SystemExit(f"--template: {template!r} is neither a built-in template ({TINY_TEMPLATES}) nor a file")
    text = path.read_text(encoding="utf-8")
    # The special tokens come from a built-in layout: llama3's if the template uses its markers.
    tokens = "llama3" if "<|eot_id|>" in text or "<|start_header_id|>" in text else "chatml"
    digest = hashlib.sha256(text.encode()).hexdigest()[:16]
    models = default_cache_dir() / "models"
    final = (models / f"tiny-file-{tokens}-{digest}-s0-v{BUILD_VERSION}").absolute()
    if (final / "tokentrail.json").is_file():
        say(f"using the cached model for {path} ({final})")
        return str(final)
    say(f"building a tiny model trained on {path} ({tokens} tokens) into {final}; about a minute...")
    build_cached(final, lambda out: build_tiny_model(out, template=tokens, chat_template_file=path, seed=0))
    say(f"model ready: {final}")
    return str(final)


def vllm_python() -> str:
    """The python of the vLLM environment built by ``scripts/vllm_env.sh``."""
    venv = Path(os.environ.get("TOKENTRAIL_VLLM_VENV") or Path.home() / ".cache/tokentrail/vllm-venv")
    python = venv / "bin" / "python"
    if not python.is_file():
        raise SystemExit(f"--engine vllm: no vLLM environment at {venv}; build it with scripts/vllm_env.sh {venv}")
    return str(python)
