"""The worker's hot-path tokens frame: ``StepTokens.json()`` is ``TokensFrame.model_dump_json()`` byte for
byte, so the server (which parses ``TokensFrame``) sees no difference, alone or in a batch."""

from __future__ import annotations

import math

import orjson
from hypothesis import given, settings
from hypothesis import strategies as st

from shared.packing import to_float32
from shared.protocol import TokensFrame, worker_batch_adapter, worker_frame_adapter
from worker.frames import StepTokens

ids = st.integers(min_value=0, max_value=2**31 - 1)
logprob = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True),
    st.floats(min_value=-100, max_value=0).map(lambda x: to_float32([x])[0]),
    st.sampled_from([0.0, -0.0, -1e-7, -1e-45, -1e16, -1e21, -1.5e300, -math.inf]),
    st.none(),
)
finite = st.floats(allow_nan=False, allow_infinity=False)  # engines leave -inf alternatives out of top logprobs
text = st.one_of(st.text(), st.sampled_from(["", "\x00", "\x7f\u2028\u2029", "\ufffd", '"\\/\b\f\n\r\t', "🙂 你好"]))


@st.composite
def step_tokens(draw: st.DrawFn) -> StepTokens:
    n = draw(st.integers(min_value=0, max_value=6))
    top = draw(st.booleans())
    return StepTokens(
        message_id=draw(st.text(min_size=1, max_size=40)),
        attempt=draw(st.integers(min_value=0, max_value=2**40)),
        start=draw(st.integers(min_value=0, max_value=2**31)),
        token_ids=draw(st.lists(ids, min_size=n, max_size=n)),
        logprobs=draw(st.lists(logprob, min_size=n, max_size=n)),
        texts=draw(st.lists(text, min_size=n, max_size=n)),
        channels=draw(st.one_of(st.none(), st.text(alphabet="crtx", min_size=n, max_size=n))),
        top_logprobs=draw(st.lists(st.lists(st.tuples(ids, finite, text), max_size=3), min_size=n, max_size=n))
        if top
        else None,
        prompt_ids=draw(st.one_of(st.none(), st.lists(ids, max_size=50))),
    )


@settings(max_examples=400, deadline=None)
@given(step_tokens())
def test_json_is_the_models_json_byte_for_byte(frame: StepTokens) -> None:
    model = frame.frame()
    assert frame.json() == model.model_dump_json().encode()
    parsed = worker_frame_adapter.validate_json(frame.json())
    assert isinstance(parsed, TokensFrame)
    assert parsed.model_dump_json() == model.model_dump_json()


@settings(max_examples=100, deadline=None)
@given(st.lists(step_tokens(), min_size=1, max_size=5))
def test_a_batch_of_them_parses_as_the_models(frames: list[StepTokens]) -> None:
    """The outbox joins one step's frames into a JSON array, as the server's batch parser reads it."""
    message = (b"[" + b",".join(f.json() for f in frames) + b"]").decode()
    parsed = worker_batch_adapter.validate_json(message)
    assert [p.model_dump_json() for p in parsed] == [f.frame().model_dump_json() for f in frames]


def test_a_numpy_scalar_is_encoded_as_pydantic_would() -> None:
    import numpy as np

    frame = StepTokens("m", 1, 0, [np.int64(5)], [np.float32(-0.5)], ["a"])  # type: ignore[list-item]
    assert orjson.loads(frame.json()) == orjson.loads(frame.frame().model_dump_json())


@settings(max_examples=300, deadline=None)
@given(st.lists(st.floats(allow_nan=True, allow_infinity=True, width=64), max_size=8))
def test_to_float32_rounds_as_numpy_does(values: list[float]) -> None:
    import numpy as np

    with np.errstate(over="ignore"):
        expected = np.asarray(values, dtype=np.float64).astype(np.float32).astype(np.float64)
    assert np.asarray(to_float32(values), dtype=np.float64).tobytes() == expected.tobytes()
