"""Work done once per step, not once per token per layer: the worker joins a message's tokens frames that
wait behind a send (``merged_steps``), the server decodes a step's tokens frames with msgspec
(``decode_step``), the hub and readers join runs of batches once (``concatenated``), and the hub checks a
step's ids and logprobs with builtins (``token_problem``) — each the same as the way it replaces."""

from __future__ import annotations

import math

import msgspec
import orjson
from hypothesis import given
from hypothesis import strategies as st

from server.streams.protocol import TokenBatch, concatenated
from server.workers.ingest import token_problem
from shared.protocol import HeartbeatFrame, TokensFrame, worker_batch_adapter
from shared.step_frames import TokensStep, decode_step
from worker.frames import StepTokens, merged_steps

_SLACK = 1e-3


def _step(mid: str, start: int, ids: list[int], *, attempt: int = 1, channels: bool = True, **kw: object) -> StepTokens:
    n = len(ids)
    return StepTokens(
        mid, attempt, start, list(ids), [-0.5] * n, [f"<{i}>" for i in ids], "c" * n if channels else None, **kw
    )  # type: ignore[arg-type]


def _frames(frames: list[object]) -> list[object]:
    """The frames as the server parses the step message."""
    data = (
        b"[" + b",".join(f.json() if isinstance(f, StepTokens) else f.model_dump_json().encode() for f in frames) + b"]"
    )  # type: ignore[attr-defined]
    return list(worker_batch_adapter.validate_json(data))


def test_a_messages_waiting_frames_go_as_one_and_others_keep_their_order() -> None:
    a0 = _step("a", 0, [1, 2], prompt_ids=[7, 8])
    b0 = _step("b", 0, [5])
    a1, b1, a2 = _step("a", 2, [3]), _step("b", 1, [6]), _step("a", 3, [4])
    out = merged_steps([a0, b0, a1, b1, a2])
    assert [(f.message_id, f.start, f.token_ids) for f in out] == [("a", 0, [1, 2, 3, 4]), ("b", 0, [5, 6])]
    merged = out[0]
    assert merged.texts == ["<1>", "<2>", "<3>", "<4>"] and merged.channels == "cccc" and merged.prompt_ids == [7, 8]
    assert a0.token_ids == [1, 2] and a0.texts == ["<1>", "<2>"]  # the pipeline's own frames are untouched
    parsed = _frames(out)
    assert isinstance(parsed[0], TokensFrame) and parsed[0].token_ids == [1, 2, 3, 4]


def test_frames_that_cannot_join_stay_apart() -> None:
    end = HeartbeatFrame()
    frames: list[object] = [
        _step("a", 0, [1]),
        _step("a", 2, [3]),  # a gap
        _step("a", 3, [4], attempt=2),  # another attempt
        _step("a", 3, [4], channels=False),  # channels on one only
        _step("a", 4, [5], channels=False, policy_version=2),  # another weights version
        end,  # nothing joins across another kind of frame
        _step("a", 5, [6], channels=False, policy_version=2),
        _step("a", 0, [1], attempt=3, prompt_ids=[9]),
        _step("a", 0, [1], attempt=3, prompt_ids=[9]),  # an attempt's first frame starts a frame of its own
    ]
    assert merged_steps(frames) == frames


@given(st.lists(st.tuples(st.sampled_from("ab"), st.integers(1, 3)), max_size=20))
def test_merged_frames_carry_every_token_of_each_message_in_order(plan: list[tuple[str, int]]) -> None:
    starts = {"a": 0, "b": 0}
    frames: list[object] = []
    for mid, n in plan:
        frames.append(_step(mid, starts[mid], list(range(starts[mid], starts[mid] + n))))
        starts[mid] += n
    out = merged_steps(frames)
    for mid in "ab":
        mine = [f for f in out if isinstance(f, StepTokens) and f.message_id == mid]
        assert len(mine) <= 1
        assert [t for f in mine for t in f.token_ids] == list(range(starts[mid]))


def test_a_run_of_batches_joins_once_as_pairwise_joins_would() -> None:
    batches = [TokenBatch(i, [i], [-1.0], [f"{i}"], "c") for i in range(5)]
    joined = concatenated(batches)
    assert joined is not None and joined.start == 0 and joined.token_ids == [0, 1, 2, 3, 4]
    assert joined.texts == ["0", "1", "2", "3", "4"] and joined.channels == "ccccc"
    assert concatenated([batches[0], TokenBatch(1, [1], [-1.0], ["1"])]) is None  # channels on one only
    assert concatenated([batches[0], TokenBatch(1, [1], [-1.0], ["1"], "c", policy_version=3)]) is None


def _reference_problem(ids: list[int], logprobs: list[float | None], vocab: int | None) -> str | None:
    limit = vocab if vocab is not None else 2**31
    for t in ids:
        if not 0 <= t < limit:
            return f"token id {t} is outside the vocabulary [0, {limit})"
    for lp in logprobs:
        if lp is not None and not (math.isfinite(lp) and lp <= _SLACK):
            return f"logprob {lp} is not a finite log-probability"
    return None


_LOGPROB = st.one_of(
    st.floats(max_value=0, allow_nan=False, allow_infinity=False),
    st.sampled_from([math.inf, -math.inf, math.nan, 0.5, 1e-3, 2e-3, -1.7e308, None]),
)


@given(
    st.lists(st.integers(-3, 200), max_size=8),
    st.lists(_LOGPROB, max_size=8),
    st.one_of(st.none(), st.integers(1, 250)),
)
def test_the_step_checks_find_what_the_per_token_checks_find(
    ids: list[int], logprobs: list[float | None], vocab: int | None
) -> None:
    assert token_problem(ids, logprobs, vocab) == _reference_problem(ids, logprobs, vocab)


def test_the_fast_tokens_frame_has_the_protocols_fields() -> None:
    fields = {
        name: (f.is_required(), None if f.is_required() else f.default)
        for name, f in TokensFrame.model_fields.items()
        if name != "type"
    }
    info = msgspec.inspect.type_info(TokensStep)
    assert isinstance(info, msgspec.inspect.StructType)
    fast = {f.name: (f.required, None if f.default is msgspec.NODEFAULT else f.default) for f in info.fields}
    assert fast == fields


_SCALARS = [None, 0, 1, -1, 2**40, 1.0, -0.5, True, "", "x", "1"]
_JSON_VALUES = st.sampled_from([*_SCALARS, [], [1], [1.5], ["a"], [None], [[1, -0.5, "t"]], [[1, 0.5]], {}, {"a": 1}])
_FIELDS = ("message_id", "attempt", "start", "token_ids", "logprobs", "texts", "channels", "top_logprobs",
           "prompt_ids", "policy_version")  # fmt: skip


@given(st.dictionaries(st.sampled_from([*_FIELDS, "extra"]), _JSON_VALUES), st.booleans())
def test_what_the_fast_decoder_takes_pydantic_takes_the_same(fields: dict[str, object], tagged: bool) -> None:
    valid = orjson.loads(_step("a", 3, [7, 8], top_logprobs=[[(7, -0.1, "x")], [(8, -0.2, "y")]]).json())
    frame = {**valid, "type": "tokens" if tagged else "finished", **fields}  # a real frame, some fields changed
    raw = orjson.dumps([frame])
    fast = decode_step(raw)
    if fast is None:
        return  # left to pydantic (which may take it or refuse it)
    slow = worker_batch_adapter.validate_json(raw)  # must not raise
    assert len(fast) == len(slow) == 1 and isinstance(slow[0], TokensFrame)
    assert {f: getattr(fast[0], f) for f in _FIELDS} == {f: getattr(slow[0], f) for f in _FIELDS}


def test_steps_with_other_frames_or_bad_frames_go_to_pydantic() -> None:
    good = _step("a", 0, [1, 2]).json()
    assert decode_step(b"[" + good + b"]") is not None
    for other in (b'{"type":"heartbeat"}', good.replace(b'"start":0', b'"start":-1'), good[:-1] + b',"x":1}'):
        assert decode_step(b"[" + good + b"," + other + b"]") is None


def test_an_in_process_link_hands_the_server_every_field_of_a_step() -> None:
    """``serve --model``: the worker's frame reaches the hub as the step decoder's struct, weights version
    and all, exactly as its JSON would decode."""
    frame = _step(
        "a", 4, [7, 8], prompt_ids=[1, 2], policy_version=3, top_logprobs=[[(7, -0.1, "x")], [(8, -0.2, "y")]]
    )
    step = frame.step()
    decoded = decode_step(b"[" + frame.json() + b"]")
    assert decoded is not None
    assert {f: getattr(step, f) for f in _FIELDS} == {f: getattr(decoded[0], f) for f in _FIELDS}
    assert step.policy_version == 3 and step.prompt_ids == [1, 2]
