"""One message's generation without a websocket: ``Pipeline.frames`` over a scripted engine."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from shared.api import SamplingParameters
from shared.protocol import FinishedFrame, ResumeState, WorkFrame, WorkMessage
from worker.chat_format import ChatFormat
from worker.engines.contract import EngineInfo, GenerationParams, TokenStep
from worker.frames import StepTokens
from worker.generation import Pipeline


class ScriptedEngine:
    """Yields the given steps; records what it was asked."""

    def __init__(self, steps: list[TokenStep]) -> None:
        self.info = EngineInfo(name="scripted", max_context=256)
        self.steps = steps
        self.prompts: list[list[int]] = []
        self.params: list[GenerationParams] = []
        self.aborted: list[str] = []

    async def start(self) -> None: ...

    async def generate(
        self, request_id: str, prompt_ids: list[int], params: GenerationParams
    ) -> AsyncIterator[TokenStep]:
        self.prompts.append(prompt_ids)
        self.params.append(params)
        for step in self.steps:
            yield step

    async def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)

    async def close(self) -> None: ...


@pytest.fixture(scope="module")
def fmt(tiny_model_dir: Path) -> ChatFormat:
    return ChatFormat.load(str(tiny_model_dir))


def work(seed: int | None = 0, **sampling: object) -> WorkFrame:
    messages = [WorkMessage(id="u1", role="user", content="hi")]
    return WorkFrame(
        message_id="m",
        attempt=2,
        chat_id="c",
        model_name="tiny",
        messages=messages,
        sampling=SamplingParameters.model_validate(sampling),
        seed=seed,
    )


def run(engine: ScriptedEngine, fmt: ChatFormat, frame: WorkFrame) -> list[StepTokens | FinishedFrame]:
    async def collect() -> list[StepTokens | FinishedFrame]:
        return [out async for out in Pipeline(engine, fmt).frames(frame)]

    return asyncio.run(collect())


def test_one_tokens_frame_per_engine_step_then_the_record(fmt: ChatFormat) -> None:
    ids = fmt.tokenizer.encode("Hello there, friend")
    end = fmt.stop_token_ids[0]
    engine = ScriptedEngine(
        [
            TokenStep(ids[:2], [-0.5, -0.25], prompt_token_ids=None, num_cached_tokens=3),
            TokenStep([*ids[2:], end], [-1.0] * (len(ids) - 1), finish_reason="stop", stop_reason=end),
        ]
    )
    *tokens, finished = run(engine, fmt, work())
    assert all(isinstance(t, StepTokens) for t in tokens) and isinstance(finished, FinishedFrame)
    assert [t.start for t in tokens if isinstance(t, StepTokens)] == [0, 2]
    first, second = tokens
    assert isinstance(first, StepTokens) and isinstance(second, StepTokens)
    assert first.prompt_ids == engine.prompts[0] and second.prompt_ids is None
    record = finished.record
    assert record.completion_ids == [*ids, end] and record.prompt_ids == engine.prompts[0]
    assert record.content == "Hello there, friend" and "".join(first.texts + second.texts) == record.completion_text
    assert record.text_offsets[-1] == len(record.completion_text)
    assert (record.finish_reason, record.stop_reason, record.num_cached_tokens) == ("stop", end, 3)
    assert record.engine == "scripted" and record.tokenizer_hash == fmt.tokenizer_hash


def test_a_stop_string_ends_the_step_at_its_token_and_aborts(fmt: ChatFormat) -> None:
    ids = fmt.tokenizer.encode("one two three four")
    engine = ScriptedEngine([TokenStep(ids, [-1.0] * len(ids)), TokenStep([5], [-1.0], finish_reason="length")])
    *tokens, finished = run(engine, fmt, work(stop=["three"]))
    assert isinstance(finished, FinishedFrame) and len(tokens) == 1
    assert engine.aborted == ["m:2"]
    record = finished.record
    assert "three" in record.completion_text and not record.completion_text.endswith("four")
    assert (record.finish_reason, record.stop_reason, record.content) == ("stop", "three", "one two ")


def test_a_resumed_attempt_continues_after_the_streamed_tokens(fmt: ChatFormat) -> None:
    ids = fmt.tokenizer.encode("Resumed text here")
    texts = [fmt.tokenizer.decode(ids[:1])]
    resume = ResumeState(compat_hash=fmt.compat_hash, token_ids=ids[:1], logprobs=[-0.5], texts=texts)
    engine = ScriptedEngine([TokenStep(ids[1:], [-1.0] * (len(ids) - 1), finish_reason="length")])
    frame = work(max_new_tokens=len(ids)).model_copy(update={"resume": resume})
    tokens, finished = run(engine, fmt, frame)
    assert isinstance(tokens, StepTokens) and isinstance(finished, FinishedFrame)
    assert tokens.start == 1 and engine.prompts[0][-1] == ids[0]
    assert finished.record.completion_ids == ids and finished.record.resumed_at == [1]
    assert finished.record.completion_text == "Resumed text here"


@pytest.mark.parametrize("seed", [None, 0, 2**63 - 1])
def test_the_engine_gets_a_seed_only_when_the_work_has_one(fmt: ChatFormat, seed: int | None) -> None:
    engine = ScriptedEngine([TokenStep([5], [-1.0], finish_reason="length")])
    frame = WorkFrame.model_validate_json(work(seed=seed).model_dump_json())  # null on the wire: no seed
    assert frame.seed == seed
    run(engine, fmt, frame)
    assert engine.params[0].seed == seed


def test_a_stop_string_across_steps_and_after_a_resume(fmt: ChatFormat) -> None:
    ids = fmt.tokenizer.encode("one two three four five")
    steps = [TokenStep([t], [-1.0]) for t in ids] + [TokenStep([5], [-1.0], finish_reason="length")]
    *tokens, finished = run(ScriptedEngine(steps), fmt, work(stop=["two three", "zzz"]))
    assert isinstance(finished, FinishedFrame) and finished.record.stop_reason == "two three"
    assert finished.record.completion_text.endswith("two three") and finished.record.content == "one "
    # resumed after "one two": the first new token completes the stop string begun before
    cut = next(k for k in range(len(ids)) if fmt.tokenizer.decode(ids[:k]).endswith("two"))
    texts = [fmt.tokenizer.decode(ids[:cut])] + [""] * (cut - 1)
    resume = ResumeState(compat_hash=fmt.compat_hash, token_ids=ids[:cut], logprobs=[-0.5] * cut, texts=texts)
    frame = work(stop=["two three"]).model_copy(update={"resume": resume})
    *tokens, finished = run(ScriptedEngine([TokenStep([t], [-1.0]) for t in ids[cut:]]), fmt, frame)
    done = next(k for k in range(len(ids) + 1) if "two three" in fmt.tokenizer.decode(ids[:k]))
    assert len(tokens) == done - cut and isinstance(finished, FinishedFrame)
    assert finished.record.stop_reason == "two three" and finished.record.completion_ids == ids[:done]


def test_a_reply_that_stops_inside_a_character_streams_the_text_it_stores(fmt: ChatFormat) -> None:
    """Cut by its length inside a multi-byte character: the held-back bytes decode as U+FFFD, which the
    last token's text carries, so the streamed texts are the stored text."""
    ids = fmt.tokenizer.encode("Hello", add_special_tokens=False)
    lead = fmt.tokenizer.convert_tokens_to_ids("Ã")  # the byte 0xC3 alone: the first byte of "é"
    assert fmt.tokenizer.decode([lead]) == "\ufffd"
    engine = ScriptedEngine([TokenStep(ids, [-0.5] * len(ids)), TokenStep([lead], [-1.0], finish_reason="length")])
    *tokens, finished = run(engine, fmt, work())
    assert isinstance(finished, FinishedFrame)
    streamed = [text for step in tokens if isinstance(step, StepTokens) for text in step.texts]
    assert streamed[-1] == "\ufffd"
    record = finished.record
    assert "".join(streamed) == record.completion_text == "Hello\ufffd"
    assert record.text_offsets[-1] == len(record.completion_text)
