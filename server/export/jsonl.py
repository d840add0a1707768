"""Native rollouts (``path_rollout_parts``) as JSON lines: the records ``path_rollout`` gives, byte for byte.

orjson writes each turn's token arrays once, from numpy (no Python int or float per token; a float64
array prints the same text as the list of its floats, null where not finite), and a sample's
per-position fields are those texts laid end to end (``orjson.Fragment``): its ids the turns' prompt
deltas and completions, its logprobs the turns' (0.0 for null) after 0.0 for each prompt token, its
mask and versions runs of one repeated item. Formatting numbers is most of the work: each is formatted
once, however many fields hold it.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np
import orjson
from orjson import Fragment

from server.export.rollouts import TO_FILL
from shared.rollout import NO_VERSION, token_versions

_NUMPY = orjson.OPT_SERIALIZE_NUMPY


def rollout_line(rollout: dict[str, Any]) -> bytes:
    """One rollout of ``path_rollout_parts`` as a JSON line (its arrays are replaced by their text)."""
    texts = [_turn_text(turn) for turn in rollout["turns"]]
    for sample in rollout["samples"]:
        if sample["token_ids"] is TO_FILL:
            _fill_text(sample, texts)
    return orjson.dumps(rollout, option=_NUMPY | orjson.OPT_APPEND_NEWLINE)


class _TurnText(NamedTuple):
    """A turn's arrays as the items of JSON arrays (no brackets)."""

    delta: bytes
    n_delta: int
    completion: bytes
    n_completion: int
    zeroed: bytes  # its logprobs, 0.0 for null
    spans: list[list[int]]  # its [start, version] spans


def _turn_text(turn: dict[str, Any]) -> _TurnText:
    delta, completion = turn["prompt_delta_ids"], turn["completion_ids"]
    d = orjson.dumps(delta, option=_NUMPY)
    c = orjson.dumps(completion, option=_NUMPY)
    # the stored float32 widened: the text of today's float64 values (float32 would print shorter text)
    lp = orjson.dumps(turn["logprobs"].astype(np.float64), option=_NUMPY)
    turn["prompt_delta_ids"], turn["completion_ids"], turn["logprobs"] = Fragment(d), Fragment(c), Fragment(lp)
    zeroed = lp[1:-1].replace(b"null", b"0.0")
    return _TurnText(d[1:-1], len(delta), c[1:-1], len(completion), zeroed, turn["policy_versions"])


def _fill_text(sample: dict[str, Any], texts: list[_TurnText]) -> None:
    ids: list[bytes] = []
    mask: list[bytes] = []
    lps: list[bytes] = []
    versions: list[bytes] = []
    for i in sample["turn_indices"]:
        t = texts[i]
        ids += (t.delta, t.completion)
        mask += (_ZERO.repeat(t.n_delta), _ONE.repeat(t.n_completion))
        lps += (ZERO_LOGPROB.repeat(t.n_delta), t.zeroed)
        versions += (_NO_VERSION.repeat(t.n_delta), _versions_text(t.spans, t.n_completion))
    sample.update(token_ids=json_array(ids), loss_mask=json_array(mask))
    sample.update(logprobs=json_array(lps), policy_versions=json_array(versions))


class _Items:
    """One JSON item repeated: ``repeat(n)`` is n of them, comma-separated (a slice of a cached run)."""

    def __init__(self, item: bytes) -> None:
        self.item = item + b","
        self.run = self.item * 1024

    def repeat(self, n: int) -> bytes:
        if n * len(self.item) > len(self.run):
            self.run = self.item * (2 * n)
        return self.run[: n * len(self.item) - 1] if n else b""


_ZERO, _ONE, ZERO_LOGPROB, _NO_VERSION = _Items(b"0"), _Items(b"1"), _Items(b"0.0"), _Items(str(NO_VERSION).encode())
_VERSIONS: dict[int, _Items] = {}


def _versions_text(spans: list[list[int]], n: int) -> bytes:
    if len(spans) == 1 and not spans[0][0]:  # one version for the whole completion: the usual case
        version = spans[0][1]
        items = _VERSIONS.get(version)
        if items is None:
            items = _VERSIONS[version] = _Items(str(version).encode())
        return items.repeat(n)
    return orjson.dumps(token_versions(spans, n))[1:-1]


def json_array(items: list[bytes]) -> Fragment:
    return Fragment(b"[%b]" % b",".join([i for i in items if i]))


def version_runs(spans: list[list[int]], n: int, values: list[int], counts: list[int]) -> None:
    """A turn's per-token versions (``token_versions``) as (version, count) runs."""
    if len(spans) == 1 and not spans[0][0]:  # one version for the whole completion: the usual case
        values.append(spans[0][1])
        counts.append(n)
        return
    values.extend(token_versions(spans, n))
    counts.extend([1] * n)
