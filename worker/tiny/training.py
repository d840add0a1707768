"""The brief training that teaches the tiny model chat structure.

A model with random weights never closes its turn, reasons or calls tools, so multi-turn stitching could
not be exercised against it. ``train_tiny_model`` renders seeded synthetic conversations
(``worker.tiny.synthetic``) with the model's *own* chat template and trains the causal LM on all their
tokens for a fixed number of steps. Afterwards, sampled at temperature ~0.8 after a generation prompt, it
usually writes a short reply and closes the turn, often reasons first (if the template renders
reasoning), and often calls a tool when tools are offered. Nothing here knows a template's format: any
template that renders ``messages``/``tools`` works.
"""

from __future__ import annotations

import itertools
import math
import random
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

from worker.tiny.synthetic import synthetic_conversation

__all__ = ["DEFAULT_TRAIN_STEPS", "train_tiny_model"]

# Fixed training schedule. Measured on 2 CPU cores, it keeps a whole build (tokenizer + training) well
# under 90 s; see train_tiny_model for what is reproducible.
DEFAULT_TRAIN_STEPS = 300
_TOKENS_PER_STEP = 2048  # token budget of one batch (rows x padded length): many small steps learn faster
_MAX_LEN = 512  # longer renders are cut (rare: the generator keeps conversations short)
_CHUNK = 64  # conversations sorted by length together, so batches need little padding
_PEAK_LR = 5e-3
_WARMUP = 0.05
_FINAL_LR_FRACTION = 0.1


def _plain(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The user/assistant text turns only: a fallback for templates that reject system or tool messages."""
    return [
        {"role": m["role"], "content": m["content"]}
        for m in messages
        if m["role"] in ("user", "assistant") and not m.get("tool_calls")
    ]


def _render(
    tokenizer: Any, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None, documents: bool = False
) -> list[int]:
    # sanitize_control_tokens: control-token look-alikes in message text are tokenized as text, as the
    # service does for user content; only the template's own control tokens become control ids.
    extra: dict[str, Any] = {"documents": []} if documents else {}
    ids = tokenizer.apply_chat_template(
        messages, tools=tools, tokenize=True, return_dict=False, sanitize_control_tokens=True, **extra
    )
    return [int(i) for i in ids]


def _flat(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    """Tool schemas without the OpenAI ``function`` wrapper (what Command-R+'s template reads)."""
    return None if tools is None else [t.get("function", t) for t in tools]


def _render_any(tokenizer: Any, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> list[int]:
    """The first render the template accepts: as given, flat tool schemas, then text turns only, with
    empty ``tools``/``documents`` lists for templates that loop over them unguarded."""
    Schemas = list[dict[str, Any]] | None
    attempts: tuple[tuple[list[dict[str, Any]], Schemas, bool], ...] = (
        (messages, tools, False),
        (messages, _flat(tools), True),
        (_plain(messages), None, False),
        (_plain(messages), [], True),
    )
    first: Exception | None = None
    for msgs, schemas, documents in attempts:
        try:
            return _render(tokenizer, msgs, schemas, documents)
        except Exception as exc:  # a user's template may reject tools, system or tool turns: simplify
            first = first or exc
    assert first is not None
    raise first


def _sequences(tokenizer: Any, rng: random.Random) -> Iterator[list[int]]:
    """Token ids of endless synthetic conversations rendered by the tokenizer's own chat template."""
    usable = 0
    error: Exception | None = None
    for attempt in itertools.count(1):
        messages, tools = synthetic_conversation(rng)
        try:
            ids = _render_any(tokenizer, messages, tools)
        except Exception as exc:
            error, ids = exc, []
        if len(ids) >= 2:
            usable += 1
            yield ids[:_MAX_LEN]
        elif usable == 0 and attempt >= 20:
            raise ValueError(f"the chat template cannot render synthetic conversations: {error or 'no tokens'}")


def _batches(tokenizer: Any, rng: random.Random, pad_id: int) -> Iterator[tuple[Any, Any]]:
    """(input_ids, labels) batches of about _TOKENS_PER_STEP padded tokens; labels are -100 on padding."""
    import torch

    sequences = _sequences(tokenizer, rng)
    while True:
        chunk = sorted((next(sequences) for _ in range(_CHUNK)), key=len)
        groups: list[list[list[int]]] = [[]]
        for seq in chunk:  # ascending lengths: the newest sequence is the longest of its group
            if groups[-1] and (len(groups[-1]) + 1) * len(seq) > _TOKENS_PER_STEP:
                groups.append([])
            groups[-1].append(seq)
        rng.shuffle(groups)  # no short-to-long curriculum inside a chunk
        for group in groups:
            width = max(len(s) for s in group)
            ids = torch.full((len(group), width), pad_id, dtype=torch.long)
            labels = torch.full((len(group), width), -100, dtype=torch.long)
            for row, seq in enumerate(group):
                ids[row, : len(seq)] = torch.tensor(seq)
                labels[row, : len(seq)] = torch.tensor(seq)
            yield ids, labels


def _stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def train_tiny_model(
    model: Any,
    tokenizer: Any,
    *,
    seed: int,
    steps: int = DEFAULT_TRAIN_STEPS,
    log: Callable[[str], None] | None = _stderr,
) -> list[float]:
    """Train ``model`` in place on conversations rendered by ``tokenizer``'s chat template; return losses.

    Causal LM loss on every token of each conversation (right-padded, padding ignored), AdamW with a
    linear warm-up and cosine decay, ``steps`` steps. ``log`` gets a few progress lines.

    Reproducibility: the data come from ``random.Random`` seeded with ``seed`` and the step count is
    fixed; the model has no dropout, so training draws no random numbers (the global torch RNG is left
    untouched either way). On one machine with the same torch build and thread count, the same seed gives
    the same weights. Across machines (other CPUs, BLAS kernels or thread counts) float sums may be
    ordered differently, so weights, and hence sampled text, can differ slightly.
    """
    import torch

    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    rng = random.Random(f"tokentrail-tiny-train-{seed}")
    batches = _batches(tokenizer, rng, int(pad_id))
    optimizer = torch.optim.AdamW(model.parameters(), lr=_PEAK_LR, betas=(0.9, 0.95), weight_decay=0.01)
    warmup = max(1, int(steps * _WARMUP))
    losses: list[float] = []
    every = max(1, steps // 5)
    start = time.monotonic()
    if log is not None:
        log(f"tiny model: training {steps} steps on synthetic chats (about a minute on 2 CPU cores)")
    model.train()
    with torch.random.fork_rng(devices=[]):
        for step in range(steps):
            if step < warmup:
                scale = (step + 1) / warmup
            else:
                progress = (step - warmup) / max(1, steps - warmup)
                scale = _FINAL_LR_FRACTION + (1 - _FINAL_LR_FRACTION) * 0.5 * (1 + math.cos(math.pi * progress))
            for group in optimizer.param_groups:
                group["lr"] = _PEAK_LR * scale
            ids, labels = next(batches)
            loss = model(input_ids=ids, labels=labels).loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            losses.append(float(loss.item()))
            if log is not None and ((step + 1) % every == 0 or step + 1 == steps):
                recent = losses[-every:]
                log(
                    f"tiny model: training step {step + 1}/{steps}, loss {sum(recent) / len(recent):.3f}, "
                    f"{time.monotonic() - start:.0f} s"
                )
    model.eval()
    return losses
