"""Pure metric functions of the exactness benchmark: token lists in, verdicts and numbers out.

Nothing here talks to a server, loads a tokenizer or runs a model; the benchmark renders and re-scores,
then hands plain token ids and floats to these functions. The metric definitions are in the package
docstring (``benchmarks/exactness/__init__.py``).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from shared.stitching import extends, merge_turns

__all__ = [
    "Agreement",
    "PrefixCache",
    "agreement",
    "aligned_prefix",
    "bridge_mismatch",
    "cache_block_size",
    "closer_mismatch",
    "expected_stitch_suffix",
    "extension_breaks",
    "logprob_deltas",
    "naive_training_view",
    "prefix_cache",
    "same_logprobs",
    "samples_per_rollout",
    "share",
    "tokens_exact",
    "turn_closed",
    "turn_end",
]

Ids = Sequence[int]
Logprobs = Sequence[float | None]  # None is -inf (JSON has no -inf)

TFLA_TOLERANCE = 1e-4


def _f32(values: Logprobs) -> np.ndarray:
    return np.array([-math.inf if v is None else v for v in values], dtype=np.float32)


def same_logprobs(a: Logprobs, b: Logprobs) -> bool:
    """Bit-for-bit equal as float32 (the stored width), ``None`` read as ``-inf``; NaN never equals."""
    if len(a) != len(b):
        return False
    return bool(np.array_equal(_f32(a), _f32(b)))


def tokens_exact(
    stored_prompt: Ids,
    stored_completion: Ids,
    stored_logprobs: Logprobs,
    engine_prompt: Ids,
    engine_completion: Ids,
    engine_logprobs: Logprobs,
) -> bool:
    """Is the stored (prompt, completion, logprobs) exactly what the engine consumed and produced?"""
    return (
        list(stored_prompt) == list(engine_prompt)
        and list(stored_completion) == list(engine_completion)
        and same_logprobs(stored_logprobs, engine_logprobs)
    )


def extension_breaks(turns: Sequence[tuple[Ids, Ids]]) -> list[bool]:
    """For each consecutive pair of turns ``(prompt, completion)``: does the later prompt fail to extend
    the earlier prompt + completion? One entry per pair (``len(turns) - 1``)."""
    return [not extends([*earlier[0], *earlier[1]], later[0]) for earlier, later in itertools.pairwise(turns)]


def samples_per_rollout(turns: Sequence[tuple[Ids, Ids]]) -> int:
    """Training samples after merging turns by prefix (``shared.stitching.merge_turns``)."""
    return len(merge_turns(turns))


def turn_end(ids: Ids, start: int, closers: frozenset[int]) -> int:
    """The index just after the first closer id at or after ``start`` (``len(ids)`` if none)."""
    for i in range(start, len(ids)):
        if ids[i] in closers:
            return i + 1
    return len(ids)


def naive_training_view(
    history_prompt: Ids, rendered_through_turn: Ids, closers: frozenset[int]
) -> tuple[list[int], list[int]] | None:
    """What a text pipeline trains on for one assistant turn, or None if it cannot be cut out.

    ``history_prompt`` is the template render of the messages before the turn with the generation
    prompt; ``rendered_through_turn`` the render of the messages up to and including the turn, without
    it. The view is (``history_prompt``, the tokens after it up to and including the turn's closer —
    the trailing separator is not part of the turn). If the second render does not start with the first,
    the turn has no consistent view (None): the text pipeline's prompt for it is not what the model saw.
    """
    if not extends(history_prompt, rendered_through_turn):
        return None
    start = len(history_prompt)
    return list(history_prompt), list(rendered_through_turn[start : turn_end(rendered_through_turn, start, closers)])


def turn_closed(
    completion: Ids, finish_reason: str | None, stop_reason: int | str | None, closers: frozenset[int]
) -> bool:
    """Did the model itself close its turn? Its last token is a closer it sampled: a stop on that token,
    or the last token allowed by ``max_new_tokens`` happening to be one. A stop on another token (a
    frequent word, a bare eos that is not a closer) or a cut elsewhere leaves the turn open."""
    if not completion or completion[-1] not in closers:
        return False
    if finish_reason == "stop":
        return stop_reason is None or stop_reason == completion[-1]
    return finish_reason == "length"


def _closer_index(
    full: Ids, prompt: Ids | None, history: Ids, closers: frozenset[int], anchor: int | None = None
) -> int | None:
    """Index in ``full`` of the closer of the prior assistant turn.

    Message text never holds a closer id (it is encoded with special tokens split), so the closer is
    the first closer id after a point known to lie inside the turn:
    - where ``full`` extends ``prompt`` (the render of the messages before that turn with the
      generation prompt), the turn's start ``len(prompt)``;
    - else ``anchor``, the end of the turn's own text in ``full`` (a template that writes text into its
      generation prompt but not into history, as Apriel's "Here are my reasoning steps:");
    - else the n-th closer, n the number of closers in ``history`` (the render up to and including the
      turn): that needs ``history`` to close its last turn, which not every template does (Apertus
      leaves it open for continuation)."""
    start = len(prompt) if prompt is not None and extends(prompt, full) else anchor
    if start is not None:
        end = turn_end(full, start, closers)
        return end - 1 if full[end - 1 : end] and full[end - 1] in closers else None
    n = sum(1 for t in history if t in closers)
    if n == 0:
        return None
    seen = 0
    for i, t in enumerate(full):
        if t in closers:
            seen += 1
            if seen == n:
                return i
    return None


def expected_stitch_suffix(
    full: Ids,
    history: Ids,
    closers: frozenset[int],
    specials: frozenset[int],
    prompt: Ids | None = None,
    anchor: int | None = None,
) -> tuple[list[int], list[int]] | None:
    """The template's own (closer, bridge) after the prior assistant turn, or None if not found.

    ``full`` renders history + new messages with the generation prompt, ``history`` the messages up to
    and including the prior assistant turn without it, ``prompt`` (optional) the messages before that
    turn with it, ``anchor`` (optional) the end of that turn's text in ``full``. The closer is the run of
    special tokens ending at that turn's closer id; the bridge is everything after it (separator, new
    messages, generation prompt).
    """
    at = _closer_index(full, prompt, history, closers, anchor)
    if at is None:
        return None
    # the run never reaches back past the turn's start (an empty turn: opener and closer adjacent)
    floor = len(prompt) if prompt is not None and extends(prompt, full) else 0
    begin = at
    while begin > floor and full[begin - 1] in specials:
        begin -= 1
    return list(full[begin : at + 1]), list(full[at + 1 :])


def bridge_mismatch(prompt: Ids, reused_prefix_len: int, synthetic_token_count: int, expected_bridge: Ids) -> bool:
    """Does the stored bridge (prompt minus reused prefix minus synthetic closer) differ from the
    template's rendering of the new messages?"""
    return list(prompt[reused_prefix_len + synthetic_token_count :]) != list(expected_bridge)


def closer_mismatch(
    prompt: Ids, reused_prefix_len: int, synthetic_token_count: int, expected_closer: Ids, prior_closed: bool
) -> bool:
    """Is the synthetic closer wrong: present although the prior turn closed itself, missing although
    it did not, or other tokens than the template's closer for that turn?"""
    stored = list(prompt[reused_prefix_len : reused_prefix_len + synthetic_token_count])
    return stored != ([] if prior_closed else list(expected_closer))


def aligned_prefix(a: Ids, b: Ids) -> int:
    """How many leading tokens ``a`` and ``b`` share."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def logprob_deltas(stored: Logprobs, rescored: Sequence[float]) -> list[float]:
    """``|stored - rescored|`` per position (float64 of float32 values); both ``-inf`` is 0, one ``-inf``
    or a NaN is ``inf``."""
    out: list[float] = []
    for s, r in zip(_f32(stored).tolist(), rescored, strict=True):
        if s == r:
            out.append(0.0)
            continue
        d = abs(s - r)
        out.append(math.inf if math.isnan(d) else d)
    return out


@dataclass(frozen=True)
class Agreement:
    positions: int = 0
    disagreements: int = 0  # positions with |delta| > tolerance
    max_delta: float = 0.0
    cut_ties: int = 0  # positions left out: the top-k cut fell on a near-tie (see ``top_k_cut_tied``)

    @property
    def share(self) -> float | None:
        return share(self.disagreements, self.positions)

    def __add__(self, other: Agreement) -> Agreement:
        return Agreement(
            self.positions + other.positions,
            self.disagreements + other.disagreements,
            max(self.max_delta, other.max_delta),
            self.cut_ties + other.cut_ties,
        )


def agreement(
    deltas: Iterable[float], tolerance: float = TFLA_TOLERANCE, tied: Sequence[bool] | None = None
) -> Agreement:
    """Agreement of the deltas; a position marked in ``tied`` whose delta exceeds the tolerance is
    counted as a cut tie instead of a disagreement (and left out of the positions)."""
    values = list(deltas)
    ties = 0
    if tied is not None:
        kept = [d for d, t in zip(values, tied, strict=True) if not (t and d > tolerance)]
        ties, values = len(values) - len(kept), kept
    return Agreement(len(values), sum(1 for d in values if d > tolerance), max(values, default=0.0), ties)


# Logits closer than this sit on a tie for the top-k cut: which side a token falls on is decided by
# the rounding of the kernel that computed them (the engine's batched pass or the re-scoring pass).
CUT_TIE_EPSILON = 1e-5


def top_k_cut_tied(sorted_scores: Sequence[float], top_k: int | None, epsilon: float = CUT_TIE_EPSILON) -> bool:
    """Do the k-th and (k+1)-th largest scores of a position (sorted descending) tie within
    ``epsilon``? Then a top-k cut keeps one more or one fewer token depending on fp rounding alone,
    and the sampled token's logprob moves by that token's share of the mass (a discontinuity that no
    tolerance on the logits themselves covers)."""
    if not top_k or top_k <= 0 or top_k >= len(sorted_scores):
        return False
    return abs(sorted_scores[top_k - 1] - sorted_scores[top_k]) <= epsilon


def share(numerator: int, denominator: int) -> float | None:
    """``numerator / denominator``, or None (printed as n/a) when there is nothing to count."""
    return numerator / denominator if denominator else None


def cache_block_size(cached: Iterable[int | None]) -> int | None:
    """The prefix cache's block size as far as the data shows: the greatest common divisor of the
    positive cached counts (a prefix cache serves whole blocks only), or None if none is positive."""
    positive = [c for c in cached if c]
    return math.gcd(*positive) if positive else None


@dataclass(frozen=True)
class PrefixCache:
    """How much of each later turn's reusable prefix a prefix cache served (sums over later turns).

    reusable: per later turn, the longest common prefix of its prompt and the previous turn's prompt +
    completion (for stitch that is ``reused_prefix_len``); cached: the engine's ``num_cached_tokens``;
    ideal: reusable rounded down to the block size (what a block cache can serve at best);
    prompt_share_sum: sum over later turns of cached / len(prompt) (its mean is the plain share).
    """

    turns: int = 0
    reusable: int = 0
    cached: int = 0
    ideal: int = 0
    prompt_share_sum: float = 0.0

    @property
    def served(self) -> float | None:
        """Cached tokens / reusable tokens."""
        return self.cached / self.reusable if self.reusable else None

    @property
    def ideal_served(self) -> float | None:
        """Block-rounded reusable tokens / reusable tokens: the best a block cache can do."""
        return self.ideal / self.reusable if self.reusable else None

    @property
    def mean_prompt_share(self) -> float | None:
        """Plain mean over later turns of cached / len(prompt)."""
        return self.prompt_share_sum / self.turns if self.turns else None


def prefix_cache(
    conversations: Iterable[Sequence[tuple[Ids, Ids, int | None]]], block: int | None
) -> PrefixCache | None:
    """The prefix-cache report over conversations of turns ``(prompt, completion, num_cached_tokens)``;
    None if any later turn has no cached count (the engine reports none). ``block`` None or 0 means
    no rounding (ideal = reusable)."""
    turns = reusable = cached = ideal = 0
    prompt_share = 0.0
    for convo in conversations:
        for (prev_prompt, prev_completion, _), (prompt, _, hit) in itertools.pairwise(convo):
            if hit is None:
                return None
            common = aligned_prefix(prompt, [*prev_prompt, *prev_completion])
            turns += 1
            reusable += common
            cached += hit
            ideal += common - common % block if block else common
            prompt_share += hit / len(prompt) if prompt else 0.0
    return PrefixCache(turns, reusable, cached, ideal, prompt_share)
