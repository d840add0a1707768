"""The vLLM adapter (no vLLM needed): its step builder over vLLM's two logprob shapes: ``FlatLogprobs``
(``flat_logprobs=True``) and a ``{token id: Logprob}`` dict per position; each position's entries are
the sampled token's, then the top-k by rank; and its reading of vLLM's stream (to the end, so that vLLM
aborts nothing that finished), against a fake at the engine boundary. The contract suite runs it against
a real vLLM."""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import pytest

from worker.engines.contract import EngineError
from worker.engines.vllm import _step

INF = float("inf")
# per position: (sampled id, its logprob, its rank), then the top-k (id, logprob), rank 1 first
POSITIONS = [
    ((7, -0.25, 1), [(7, -0.25), (9, -1.5), (3, -2.0)]),
    ((3, -2.0, 3), [(7, -0.5), (9, -1.0), (3, -2.0)]),
    ((11, -4.0, 40), [(7, -0.1), (9, -3.0), (5, -INF)]),
]


@dataclass
class Flat:  # the fields of vllm.logprobs.FlatLogprobs that the adapter reads
    start_indices: list[int] = field(default_factory=list)
    end_indices: list[int] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    ranks: list[int | None] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.start_indices)


def flat(top_k: int) -> Flat:
    out = Flat()
    for (tid, lp, rank), top in POSITIONS:
        out.start_indices.append(len(out.token_ids))
        for t, v, r in [(tid, lp, rank)] + [(t, v, k + 1) for k, (t, v) in enumerate(top[:top_k])]:
            out.token_ids.append(t)
            out.logprobs.append(v)
            out.ranks.append(r)
        out.end_indices.append(len(out.token_ids))
    return out


def dicts(top_k: int) -> list[dict[int, Any]]:
    out = []
    for (tid, lp, rank), top in POSITIONS:
        entry = {tid: SimpleNamespace(logprob=lp, rank=rank)}
        for k, (t, v) in enumerate(top[:top_k]):
            entry[t] = SimpleNamespace(logprob=v, rank=k + 1)
        out.append(entry)
    return out


def completion(logprobs: Any, finish: str | None = None, stop: int | str | None = None) -> SimpleNamespace:
    ids = tuple(p[0][0] for p in POSITIONS)  # vLLM may hand a non-list sequence
    return SimpleNamespace(token_ids=ids, logprobs=logprobs, finish_reason=finish, stop_reason=stop)


@pytest.mark.parametrize("shape", [flat, dicts])
@pytest.mark.parametrize("top_k", [0, 2, 3])
def test_sampled_logprobs_by_id_and_top_k_by_rank(shape: Any, top_k: int) -> None:
    step = _step(completion(shape(top_k)), top_k)
    assert step.token_ids == [7, 3, 11] and step.logprobs == [-0.25, -2.0, -4.0]
    if top_k == 0:
        assert step.top_logprobs is None
    else:
        expected = [[(t, v) for t, v in top[:top_k] if v != -INF] for _, top in POSITIONS]
        assert step.top_logprobs == expected


def test_a_flat_position_whose_first_entry_is_not_the_sampled_token_is_searched_by_id() -> None:
    logprobs = flat(2)
    first = logprobs.start_indices[1]
    logprobs.token_ids[first], logprobs.token_ids[first + 1] = logprobs.token_ids[first + 1], 3
    logprobs.logprobs[first], logprobs.logprobs[first + 1] = -0.5, -2.0
    assert _step(completion(logprobs), 0).logprobs == [-0.25, -2.0, -4.0]
    logprobs.token_ids[first + 1] = 99
    with pytest.raises(EngineError, match="no logprob for the sampled token 3"):
        _step(completion(logprobs), 0)


def test_finish_reasons_and_a_missing_logprob() -> None:
    step = _step(completion(flat(0), "stop", 11), 0)
    assert (step.finish_reason, step.stop_reason) == ("stop", 11)
    assert _step(completion(flat(0), "stop", "</s>"), 0).stop_reason is None
    assert _step(completion(flat(0), "length"), 0).finish_reason == "length"
    assert _step(completion(flat(0), "abort"), 0).finish_reason == "abort"
    short = flat(0)
    short.start_indices.pop()
    with pytest.raises(EngineError, match="2 logprobs for 3 tokens"):
        _step(completion(short), 0)
    with pytest.raises(EngineError, match="no logprobs for 3 tokens"):
        _step(completion(None), 0)


def test_a_merged_flat_position_keeps_the_sampled_token_once() -> None:
    """vLLM merges a consumer's pending outputs through a dict per position: a sampled token among the
    top-k then appears once, first, with its top-k rank; the row still has k entries, by rank."""
    merged = Flat([0], [3], [9, 7, 3], [-1.0, -0.5, -2.0], [2, 1, 3])
    comp = SimpleNamespace(token_ids=[9], logprobs=merged, finish_reason=None, stop_reason=None)
    step = _step(comp, 3)
    assert step.logprobs == [-1.0] and step.top_logprobs == [[(7, -0.5), (9, -1.0), (3, -2.0)]]


class _FakeAsyncLLM:
    """Engine-boundary fake of vLLM's ``AsyncLLM`` for the adapter's stream handling: ``generate`` yields
    the given outputs and then ends, as vLLM's does after a finished output; it records whether the
    adapter read it to its end or closed it early (vLLM aborts a request whose stream is closed)."""

    errored = False

    def __init__(self, outputs: list[Any]) -> None:
        self.outputs = outputs
        self.ran_to_end = False
        self.closed_early = False
        self.aborted: list[str] = []

    async def generate(self, prompt: Any, sampling: Any, request_id: str) -> Any:
        try:
            for out in self.outputs:
                yield out
            self.ran_to_end = True
        except GeneratorExit:
            self.closed_early = True
            raise

    async def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)


def _output(comp: SimpleNamespace) -> SimpleNamespace:
    return SimpleNamespace(outputs=[comp], prompt_token_ids=[1, 2], num_cached_tokens=0)


async def test_a_finished_request_reads_vllms_stream_to_its_end_so_vllm_sends_no_abort() -> None:
    import gc

    from worker.engines.contract import GenerationParams
    from worker.engines.vllm import VLLMEngine

    engine = VLLMEngine("/nonexistent", max_model_len=64)
    fake = _FakeAsyncLLM([_output(completion(flat(0))), _output(completion(flat(0), "stop", 11))])
    engine._llm, engine._vocab = fake, 100
    engine._sampling_params = lambda params, limit: None  # type: ignore[method-assign]
    steps = [s async for s in engine.generate("r1", [1, 2], GenerationParams(max_new_tokens=8))]
    gc.collect()
    assert [s.finish_reason for s in steps] == [None, "stop"]
    assert fake.ran_to_end and not fake.closed_early and fake.aborted == []
