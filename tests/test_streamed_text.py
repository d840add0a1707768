"""Streamed = non-streamed = stored text (DESIGN D19), end to end: a real server and worker whose engine
(the only fake, at the engine boundary) replies from a script, so that the model writes exactly the
malformed tool call, the reasoning that never closes or the reply cut inside a tool call under test.

A streaming client assembles content, reasoning and tool calls from the deltas, as it would echo them
back; that must equal the non-streamed response and the stored message character for character, and
echoing it must continue the stored conversation (no fork, stitched from stored tokens).
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from server.admin import issue_user_key
from server.settings import ServerSettings
from tests.stack import MODEL, ServerThread, WorkerThread, worker_key
from tests.test_openai_api import stored
from tests.test_openai_raw import sse_events
from tokentrail.launcher import free_port
from worker.chat_format import ChatFormat
from worker.engines.contract import EngineInfo, GenerationParams, TokenStep

MALFORMED = (
    "Let me look that up.\n<tool_call>\n"
    '{"name": "get_weather", "arguments": {"city": "Paris", "unit": celsius}}\n'
    "</tool_call>\nOne moment while I check the forecast for you."
)
VALID = 'Checking.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
SCRIPTS = {
    "case-malformed": MALFORMED,
    "case-unclosed-call": 'Sure.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par',
    "case-cut-call": 'On it.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
    "case-unclosed-think": "Hmm.\n<think>\nThe user wants the weather in Paris. I should check the",
    "case-think-malformed": "<think>\nplan it\n</think>\n\n" + MALFORMED,
    "case-valid": VALID,
    "case-two-blocks": MALFORMED + "\n" + VALID,
    "case-stop": "The forecast says rain. Then sun.",
    "case-plain": "Here you are.",
}


class ScriptedReplyEngine:
    """Fake engine: the reply is the script whose key the prompt's last user turn names, one token per
    step, ended by the turn closer (finish "stop") or cut at ``max_new_tokens`` (finish "length")."""

    def __init__(self, tokenizer: Any, closer: int) -> None:
        self.info = EngineInfo(name="scripted", max_context=4096)
        self.tok = tokenizer
        self.closer = closer

    async def start(self) -> None: ...

    async def close(self) -> None: ...

    async def abort(self, request_id: str) -> None: ...

    async def generate(
        self, request_id: str, prompt_ids: list[int], params: GenerationParams
    ) -> AsyncIterator[TokenStep]:
        prompt = self.tok.decode(prompt_ids)
        key = max(SCRIPTS, key=prompt.rfind)
        ids = [*self.tok.encode(SCRIPTS[key], add_special_tokens=False), self.closer]
        for k, tid in enumerate(ids[: params.max_new_tokens]):
            last_of_script, last_allowed = k == len(ids) - 1, k + 1 == params.max_new_tokens
            yield TokenStep(
                [tid],
                [-0.5],
                finish_reason="stop" if last_of_script else "length" if last_allowed else None,
                stop_reason=tid if last_of_script else None,
                prompt_token_ids=prompt_ids if k == 0 else None,
            )


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> Iterator[tuple[str, ServerSettings]]:
    settings = ServerSettings(data_dir=tmp_path_factory.mktemp("streamed-text"), port=free_port())
    server = ServerThread(settings).start()
    fmt = ChatFormat.load(str(tiny_model_dir))
    closer = fmt.tokenizer.convert_tokens_to_ids("<|im_end|>")
    worker = WorkerThread(
        server.url, worker_key(settings), MODEL, fmt, lambda: ScriptedReplyEngine(fmt.tokenizer, closer)
    ).start()
    yield server.url, settings
    worker.stop()
    server.stop()


@pytest.fixture(scope="module")
def key(stack: tuple[str, ServerSettings]) -> Callable[[str], str]:
    return lambda user: issue_user_key(stack[1], user)


def assembled(events: list[dict[str, Any]]) -> tuple[dict[str, Any], dict[str, Any]]:
    """The assistant message a streaming client assembles (what it echoes back), and the last chunk."""
    content, reasoning, calls = "", "", []
    choice_chunks = [e for e in events if e.get("choices")]
    for event in choice_chunks:
        delta = event["choices"][0]["delta"]
        content += delta.get("content") or ""
        reasoning += delta.get("reasoning_content") or ""
        calls += [{k: v for k, v in c.items() if k != "index"} for c in delta.get("tool_calls") or []]
    return {"content": content, "reasoning": reasoning, "tool_calls": calls}, choice_chunks[-1]


def view(message: dict[str, Any]) -> dict[str, Any]:
    """A stored or non-streamed message in the shape ``assembled`` gives."""
    return {
        "content": message.get("content") or "",
        "reasoning": message.get("reasoning_content") or "",
        "tool_calls": message.get("tool_calls") or [],
    }


def chat(url: str, key: str, body: dict[str, Any]) -> dict[str, Any]:
    resp = httpx.post(
        f"{url}/v1/chat/completions", json={"model": MODEL, **body}, headers={"Authorization": f"Bearer {key}"}
    )
    assert resp.status_code == 200, resp.text
    return dict(resp.json())


def three_views(url: str, key: str, body: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    """(streamed as assembled, non-streamed, stored) for the same request."""
    events = sse_events(url, key, "/v1/chat/completions", {"model": MODEL, **body, "stream": True})
    streamed, last = assembled(events)
    info = last["tokentrail"]
    kept = stored(url, key, info["chat_id"], info["message_id"])
    plain = chat(url, key, body)["choices"][0]["message"]
    return streamed, view(plain), view(kept)


CASES = [
    ("case-malformed", {}),
    ("case-unclosed-call", {}),
    ("case-cut-call", {"max_tokens": 12}),
    ("case-unclosed-think", {}),
    ("case-think-malformed", {}),
    ("case-valid", {}),
    ("case-two-blocks", {}),
    ("case-stop", {"stop": ["Then"]}),
]


@pytest.mark.parametrize(("case", "params"), CASES, ids=[c for c, _ in CASES])
def test_streamed_equals_non_streamed_equals_stored(
    stack: tuple[str, ServerSettings], key: Callable[[str], str], case: str, params: dict[str, Any]
) -> None:
    body = {"messages": [{"role": "user", "content": case}], **params}
    streamed, plain, kept = three_views(stack[0], key(f"views-{case}"), body)
    assert streamed == plain == kept
    assert streamed["content"] or streamed["reasoning"] or streamed["tool_calls"]


def test_what_each_case_keeps(stack: tuple[str, ServerSettings], key: Callable[[str], str]) -> None:
    """Parsing is a view: a call that does not parse stays text, cut or unclosed, in every view."""
    url, user = stack[0], key("views-kept")

    def message(case: str, **params: Any) -> dict[str, Any]:
        body = {"messages": [{"role": "user", "content": case}], **params}
        return view(chat(url, user, body)["choices"][0]["message"])

    assert message("case-malformed") == {"content": MALFORMED, "reasoning": "", "tool_calls": []}
    assert message("case-unclosed-call")["content"] == SCRIPTS["case-unclosed-call"]
    assert message("case-cut-call", max_tokens=12)["content"].startswith("On it.\n<tool_call>\n{")
    assert message("case-unclosed-think") == {
        "content": "Hmm.",
        "reasoning": "The user wants the weather in Paris. I should check the",
        "tool_calls": [],
    }
    valid = message("case-valid")
    assert valid["content"] == "Checking." and valid["tool_calls"][0]["function"]["name"] == "get_weather"
    assert message("case-stop", stop=["Then"])["content"] == "The forecast says rain. "


def test_text_after_a_malformed_call_streams_before_the_end(
    stack: tuple[str, ServerSettings], key: Callable[[str], str]
) -> None:
    """The held block is released as soon as it fails to parse: the text after it is not all held to
    the final chunk."""
    url = stack[0]
    body = {"model": MODEL, "messages": [{"role": "user", "content": "case-malformed"}], "stream": True}
    events = sse_events(url, key("views-early"), "/v1/chat/completions", body)
    middle = "".join(
        e["choices"][0]["delta"].get("content") or ""
        for e in events
        if e.get("choices") and e["choices"][0]["finish_reason"] is None
    )
    assert middle.startswith(MALFORMED.split("One moment")[0]) and "forecast" in middle


def test_echoing_the_streamed_reply_continues_the_stored_chat(
    stack: tuple[str, ServerSettings], key: Callable[[str], str]
) -> None:
    """The client echoes what it streamed; the next turn matches the stored reply (no fork, no
    client-written assistant message) and its prompt is stitched from the stored tokens."""
    url, user = stack[0], key("views-echo")
    first = [{"role": "user", "content": "case-malformed"}]
    events = sse_events(url, user, "/v1/chat/completions", {"model": MODEL, "messages": first, "stream": True})
    streamed, _ = assembled(events)
    echo = {"role": "assistant", "content": streamed["content"]}
    nxt = chat(url, user, {"messages": [*first, echo, {"role": "user", "content": "case-plain"}]})
    info = nxt["tokentrail"]
    assert info["matched_messages"] == 2 and info["new_messages"] == 1, json.dumps(info)
    assert not info["forked"] and info["reused_prefix_len"] > 0
    assert nxt["choices"][0]["message"]["content"] == "Here you are."


def test_text_completion_streams_the_stored_text(stack: tuple[str, ServerSettings], key: Callable[[str], str]) -> None:
    """Raw prompts too: the stop string the stored text is cut at is never streamed."""
    url, user = stack[0], key("views-raw")
    body = {"model": MODEL, "prompt": "case-stop", "stop": ["Then"], "max_tokens": 40}
    events = sse_events(url, user, "/v1/completions", {**body, "stream": True})
    text = "".join(e["choices"][0]["text"] for e in events if e.get("choices"))
    info = events[-1]["tokentrail"]
    plain = httpx.post(f"{url}/v1/completions", json=body, headers={"Authorization": f"Bearer {user}"}).json()
    assert text == plain["choices"][0]["text"] == stored(url, user, info["chat_id"], info["message_id"])["content"]
    assert text == "The forecast says rain. "
