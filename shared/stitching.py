"""The pure core of token-exact prompt stitching (DESIGN section 5), and prefix checks.

A later turn's prompt extends the previous assistant turn's exact tokens:

    prompt = A.prompt_ids + A.completion_ids + closer + bridge

``closer`` is added only when A's completion did not end on one of the template's turn closers
(it was cut by max_new_tokens, a stop string, or a stop token that is not a closer); ``bridge`` is
the rendering of the new messages, starting with the template's separator. Everything that needs
a tokenizer or a template (finding closers, rendering bridges) lives in the worker; this module
only decides and concatenates, so the server and exporters can use the same rules.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


def ends_with_closer(
    completion_ids: Sequence[int], finish_reason: str, stop_reason: int | str | None, closers: frozenset[int]
) -> bool:
    """Did generation end on a turn closer? Decided from the finish and stop reason: a completion
    cut by length whose last token happens to be a closer id still ended on it (the model sampled
    it), but a stop on a non-closer token (e.g. a bare eos) did not."""
    if not completion_ids or completion_ids[-1] not in closers:
        return False
    if finish_reason == "stop":
        return stop_reason is None or stop_reason == completion_ids[-1]
    return True


def synthetic_closer(
    completion_ids: Sequence[int],
    finish_reason: str,
    stop_reason: int | str | None,
    closers: frozenset[int],
    closer_for_turn: Sequence[int],
) -> list[int]:
    """The closer tokens to append as synthetic prompt tokens ([] when the turn already ended)."""
    if ends_with_closer(completion_ids, finish_reason, stop_reason, closers):
        return []
    return list(closer_for_turn)


@dataclass(frozen=True)
class TurnEnd:
    """How a completion ended, against the template's closers for its kind of turn.

    ``closed``: it ends on the history closer's last token: nothing to add.
    ``generation``: it ends with the generation closer (``keep`` tokens long) where the template writes
    another history closer (gpt-oss ``<|return|>`` vs ``<|end|>``): the closer policy decides.
    ``open``: it did not close its turn (cut by length, a stop string, a stop token that is not a
    closer); ``missing`` is what of the history closer must be added (a multi-token closer may already
    have begun: Command-R7B cut right after ``<|END_RESPONSE|>``).
    """

    kind: str  # "closed" | "generation" | "open"
    generation_len: int = 0
    missing: tuple[int, ...] = ()


def turn_end(
    completion_ids: Sequence[int],
    finish_reason: str,
    stop_reason: int | str | None,
    generation: Sequence[int],
    history: Sequence[int],
    other_closers: frozenset[int] = frozenset(),
) -> TurnEnd:
    """``other_closers``: last tokens of the template's closers for other kinds of turn (a plain
    llama3 turn that ended on ``<|eom_id|>`` ended all the same)."""
    history, generation = tuple(history), tuple(generation)
    if ends_with_closer(completion_ids, finish_reason, stop_reason, frozenset(history[-1:]) | other_closers):
        return TurnEnd("closed")
    if generation and generation != history and tuple(completion_ids[-len(generation) :]) == generation:
        return TurnEnd("generation", generation_len=len(generation))
    overlap = next(
        (
            k
            for k in range(min(len(history) - 1, len(completion_ids)), 0, -1)
            if tuple(completion_ids[-k:]) == history[:k]
        ),
        0,
    )
    return TurnEnd("open", missing=history[overlap:])


@dataclass(frozen=True)
class Stitched:
    prompt_ids: list[int]
    reused_prefix_len: int  # len(A.prompt_ids + A.completion_ids)
    synthetic_token_count: int  # closer tokens that the model did not generate


def stitch(
    prior_prompt: Sequence[int], prior_completion: Sequence[int], closer: Sequence[int], bridge: Sequence[int]
) -> Stitched:
    reused = [*prior_prompt, *prior_completion]
    return Stitched([*reused, *closer, *bridge], len(reused), len(closer))


def extends(prefix: Sequence[int], seq: Sequence[int]) -> bool:
    """Is ``seq`` an extension of ``prefix`` (``prefix`` == ``seq[:len(prefix)]``)?"""
    return len(seq) >= len(prefix) and list(seq[: len(prefix)]) == list(prefix)


def merge_turns(turns: Sequence[tuple[Sequence[int], Sequence[int]]]) -> list[list[int]]:
    """Group consecutive turns ``(prompt_ids, completion_ids)`` into samples: a turn joins the
    current sample when its prompt extends everything before it; otherwise it starts a new one.
    Returns, per sample, the indices of its turns."""
    samples: list[list[int]] = []
    seq: list[int] = []
    for i, (prompt, completion) in enumerate(turns):
        if samples and extends(seq, prompt):
            samples[-1].append(i)
        else:
            samples.append([i])
        seq = [*prompt, *completion]
    return samples
