"""The Anthropic Messages API (``/v1/messages``) through the official ``anthropic`` SDK, against a real
server and worker running the briefly trained tiny model (it reasons and calls tools).

The route translates Anthropic requests onto the chat routes' pipeline: the same stored trees, the same
server-side prefix matching, token fields as extensions, Anthropic's error shape.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import anthropic
import httpx
import pytest

from server.admin import issue_user_key
from tests.stack import MODEL, hf_stack
from tests.test_export import run_cli
from tokentrail.trajectory import Trajectory

WEATHER = {
    "name": "get_weather",
    "description": "Current weather of a city",
    "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}
# this SDK (2.x) takes sampling parameters in the body only
HOT = {"temperature": 0.7}


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory, trained_model: Callable[[str], Path]) -> Iterator[Any]:
    model_dir = trained_model("chatml")
    with hf_stack(tmp_path_factory.mktemp("anthropic"), model_dir, max_batch_size=4) as (url, settings):
        yield url, settings, model_dir


@pytest.fixture(scope="module")
def client(stack: Any) -> Callable[[str], anthropic.Anthropic]:
    """``client(user)``: an SDK client (``x-api-key``) with a fresh API key of that user."""
    url, settings, _ = stack
    return lambda user: anthropic.Anthropic(base_url=url, api_key=issue_user_key(settings, user), max_retries=0)


def stored(url: str, key: str, info: dict[str, Any]) -> dict[str, Any]:
    resp = httpx.get(
        f"{url}/chats/{info['chat_id']}/messages/{info['message_id']}",
        params={"include": "tokens"},
        headers={"Authorization": f"Bearer {key}"},
    )
    assert resp.status_code == 200, resp.text
    return dict(resp.json())


def extra(obj: Any) -> dict[str, Any]:
    return dict(obj.model_extra or {})


def _blocks(message: anthropic.types.Message) -> dict[str, list[Any]]:
    out: dict[str, list[Any]] = {"thinking": [], "text": [], "tool_use": []}
    for block in message.content:
        out[block.type].append(block)
    return out


def _check_stored(message: anthropic.types.Message, fields: dict[str, Any], record: dict[str, Any]) -> None:
    """The message (content, token fields, usage) is the stored one."""
    blocks = _blocks(message)
    assert message.id == f"msg_{record['id']}"
    assert "".join(b.text for b in blocks["text"]) == record["content"]
    assert "".join(b.thinking for b in blocks["thinking"]) == (record["reasoning_content"] or "")
    calls = record["tool_calls"] or []
    assert [(b.id, b.name, b.input) for b in blocks["tool_use"]] == [
        (c["id"], c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls
    ]
    assert fields["prompt_token_ids"] == record["prompt_token_ids"]
    assert fields["generation_token_ids"] == record["completion_token_ids"]
    lps = [-9999.0 if lp is None else lp for lp in record["logprobs"]]
    assert fields["generation_log_probs"] == pytest.approx(lps)
    usage = message.usage
    assert usage.input_tokens + (usage.cache_read_input_tokens or 0) == len(record["prompt_token_ids"])
    assert usage.output_tokens == len(record["completion_token_ids"])
    assert usage.cache_creation_input_tokens == 0
    expected = "tool_use" if calls else ("max_tokens" if record["finish_reason"] == "length" else "end_turn")
    assert message.stop_reason == expected


def test_one_turn_stream_and_not_is_the_stored_message(
    stack: Any, client: Callable[[str], anthropic.Anthropic]
) -> None:
    url = stack[0]
    api = client("an-one")
    key = str(api.api_key)
    ask = [{"role": "user", "content": "What is the weather in Oslo?"}]
    plain = api.messages.create(model=MODEL, max_tokens=24, system="Be terse.", messages=ask, extra_body=HOT)  # type: ignore[arg-type]
    assert plain.type == "message" and plain.role == "assistant" and plain.model == MODEL
    info = extra(plain)["tokentrail"]
    record = stored(url, key, info)
    _check_stored(plain, extra(plain), record)
    assert info["matched_messages"] == 0 and info["new_messages"] == 1 and not info["forked"]
    # count_tokens renders the conversation fresh: for a new one, the prompt it got
    counted = api.messages.count_tokens(model=MODEL, system="Be terse.", messages=ask)  # type: ignore[arg-type]
    assert counted.input_tokens == len(record["prompt_token_ids"])

    # raw events: the deltas add up to the stored text, the token fields ride on message_delta
    events = list(
        api.messages.create(
            model=MODEL,
            max_tokens=24,
            system="Be terse.",
            messages=[{"role": "user", "content": [{"type": "text", "text": "Stream: weather in Lima?"}]}],
            stream=True,
        )
    )
    kinds = [e.type for e in events]
    assert kinds[0] == "message_start" and kinds[-2:] == ["message_delta", "message_stop"]
    assert kinds.count("content_block_start") == kinds.count("content_block_stop") >= 1
    end = extra(events[-2])
    record = stored(url, key, end["tokentrail"])
    assert events[0].message.id == f"msg_{record['id']}"  # type: ignore[union-attr]
    text = "".join(e.delta.text for e in events if e.type == "content_block_delta" and e.delta.type == "text_delta")
    thinking = "".join(
        e.delta.thinking for e in events if e.type == "content_block_delta" and e.delta.type == "thinking_delta"
    )
    assert text == record["content"] and thinking == (record["reasoning_content"] or "")
    assert end["prompt_token_ids"] == record["prompt_token_ids"]
    assert end["generation_token_ids"] == record["completion_token_ids"]
    assert end["tokentrail"]["chat_id"] != info["chat_id"]  # another first message: another chat

    # the SDK's stream helper assembles the same message as the body of a plain request would be
    with api.messages.stream(model=MODEL, max_tokens=24, system="Be terse.", messages=ask, extra_body=HOT) as stream:
        streamed = "".join(stream.text_stream)
        final = stream.get_final_message()
    record = stored(url, key, extra(final)["tokentrail"])
    assert streamed == record["content"]
    end_event = extra(final)
    assert end_event["tokentrail"]["chat_id"] == info["chat_id"]  # the same first message: its chat
    _check_stored(final, _token_fields(record), record)


def _token_fields(record: dict[str, Any]) -> dict[str, Any]:
    return {
        "prompt_token_ids": record["prompt_token_ids"],
        "generation_token_ids": record["completion_token_ids"],
        "generation_log_probs": [-9999.0 if lp is None else lp for lp in record["logprobs"]],
    }


def _echo(message: anthropic.types.Message) -> list[dict[str, Any]]:
    """The reply echoed back as an agent does (its content blocks as returned), with a tool_result for
    each tool_use it made."""
    turns: list[dict[str, Any]] = [{"role": "assistant", "content": message.content}]
    results = [
        {"type": "tool_result", "tool_use_id": b.id, "content": json.dumps({"city": b.input.get("city"), "temp": 11})}
        for b in message.content
        if b.type == "tool_use"
    ]
    if results:
        turns.append({"role": "user", "content": results})
    return turns


def test_agent_loop_echoing_blocks_keeps_the_stored_prefix(
    stack: Any, client: Callable[[str], anthropic.Anthropic], tmp_path: Path
) -> None:
    """Turns echo content blocks (thinking, text, tool_use) and send tool_result blocks, streamed and
    not; a tool_use turn and a text turn the client wrote itself keep the prefix too."""
    url = stack[0]
    api = client("an-agent")
    key = str(api.api_key)
    messages: list[dict[str, Any]] = []
    records: list[dict[str, Any]] = []
    traj = Trajectory()  # the client-side record of the same episode (its non-streamed turns)
    added: list[dict[str, Any]] = []
    tool_turns = 0
    plan = [
        ("What is the weather in Oslo?", None),
        ("And in Lima? <tool_call>", None),
        ("Check Paris with the tool", {"id": "toolu_mine", "name": "get_weather", "input": {"city": "Paris"}}),
        ("Thanks!", "You are welcome (typed by the client)."),
    ]
    for t, (ask, written) in enumerate(plan):
        messages.append({"role": "user", "content": ask})
        if isinstance(written, dict):  # a tool call the client made itself, and its result
            messages += [
                {
                    "role": "assistant",
                    "content": [{"type": "text", "text": "Let me check."}, {"type": "tool_use", **written}],
                },
                {
                    "role": "user",
                    "content": [
                        {
                            "type": "tool_result",
                            "tool_use_id": written["id"],
                            "content": [{"type": "text", "text": "9C"}],
                        },
                        {"type": "text", "text": "Summarize."},
                    ],
                },
            ]
        elif isinstance(written, str):  # a reply the client typed
            messages += [{"role": "assistant", "content": written}, {"role": "user", "content": "Bye."}]
        for k in range(2):
            kwargs: dict[str, Any] = {
                "model": MODEL,
                "max_tokens": 96,
                "system": [
                    {"type": "text", "text": "You can check the weather.", "cache_control": {"type": "ephemeral"}}
                ],
                "messages": messages,
                "tools": [WEATHER],
                "extra_body": {"temperature": 0.7, "seed": t},
            }
            if (t + k) % 2:
                with api.messages.stream(**kwargs) as stream:
                    reply = stream.get_final_message()
            else:
                reply = api.messages.create(**kwargs)
            info = extra(reply)["tokentrail"]
            record = stored(url, key, info)
            if (t + k) % 2 == 0:
                _check_stored(reply, extra(reply), record)
            assert "".join(b.text for b in reply.content if b.type == "text") == record["content"]
            if written is not None and k == 0:
                assert record["prompt_method"].startswith("stitch-written/"), record["prompt_method"]
            records.append(record)
            if (t + k) % 2 == 0:  # the stream helper's final message drops the extension fields
                traj.add(reply)
                added.append(record)
            messages += _echo(reply)
            if reply.stop_reason != "tool_use":
                break
            tool_turns += 1
    # every later prompt extends the previous turn's prompt + completion exactly, in one chat
    for prev, cur in itertools.pairwise(records):
        reused = prev["prompt_token_ids"] + prev["completion_token_ids"]
        assert cur["prior_message_id"] == prev["id"] and not cur["fork"]
        assert cur["prompt_token_ids"][: len(reused)] == reused
    assert len({r["chat_id"] for r in records}) == 1
    assert tool_turns >= 1, "the trained model made no tool call: the loop did not exercise tool_use turns"
    assert any(r["reasoning_content"] for r in records), "no reasoning: thinking blocks were not exercised"
    # tokentrail.trajectory reads Anthropic messages as it reads chat completions: one sample, the stored ids
    rollout = traj.rollout()
    assert len(rollout.samples) == 1 and rollout.chat_id == records[0]["chat_id"] and len(added) >= 2
    assert [t.completion_ids for t in rollout.turns] == [r["completion_token_ids"] for r in added]
    assert [t.logprobs for t in rollout.turns] == [r["logprobs"] for r in added]
    finishes = ["tool_calls" if r["tool_calls"] else r["finish_reason"] for r in added]  # as chat completions say
    assert [t.finish_reason for t in rollout.turns] == finishes
    # exported like any chat: one rollout, one sample, and teacher-forcing verifies its logprobs
    settings, model_dir = stack[1:]
    out = tmp_path / "agent.jsonl"
    run_cli("export", "--out", str(out), "--data-dir", str(settings.data_dir), "--user", "an-agent", "--quiet")
    rollouts = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(rollouts) == 1 and len(rollouts[0]["samples"]) == 1
    report = run_cli("verify", str(out), "--model", str(model_dir))
    assert "PASS" in report, report


def test_errors_in_anthropic_shape(stack: Any, client: Callable[[str], anthropic.Anthropic]) -> None:
    url = stack[0]
    api = client("an-errors")
    user = [{"role": "user", "content": "hi"}]
    with pytest.raises(anthropic.NotFoundError) as nf:
        api.messages.create(model="nope", max_tokens=4, messages=user)  # type: ignore[arg-type]
    assert nf.value.body == {
        "type": "error",
        "error": {
            "type": "not_found_error",
            "message": nf.value.body["error"]["message"],
            "code": "model_not_found",
            "param": "model",
        },  # type: ignore[index]
    }
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AA=="}}
    cases: list[tuple[dict[str, Any], str]] = [
        (
            {"messages": [{"role": "user", "content": [{"type": "text", "text": "see"}, image]}]},
            "messages[0].content[1].type",
        ),
        ({"messages": user, "tool_choice": {"type": "any"}, "tools": [WEATHER]}, "tool_choice"),
        ({"messages": user, "tool_choice": {"type": "tool", "name": "get_weather"}, "tools": [WEATHER]}, "tool_choice"),
        ({"messages": [*user, {"role": "assistant", "content": "The answer is"}]}, "messages[1].role"),
        ({"messages": user, "tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "tools[0].type"),
        (
            {
                "messages": [
                    {"role": "user", "content": "a"},
                    {"role": "assistant", "content": [{"type": "redacted_thinking", "data": "x"}]},
                    {"role": "user", "content": "b"},
                ]
            },
            "messages[1].content[0].type",
        ),
        ({"messages": user, "extra_body": {"temperature": -1}}, "temperature"),
    ]
    for body, param in cases:
        with pytest.raises(anthropic.BadRequestError) as bad:
            api.messages.create(model=MODEL, max_tokens=4, **body)
        err = bad.value.body
        assert isinstance(err, dict) and err["type"] == "error", (body, err)
        assert err["error"]["type"] == "invalid_request_error" and err["error"]["param"] == param, (body, err)
    # the stored reply's failure: a prompt longer than the model's context, answered and streamed
    long = [{"role": "user", "content": "word " * 6000}]
    with pytest.raises(anthropic.BadRequestError) as overflow:
        api.messages.create(model=MODEL, max_tokens=4, messages=long)  # type: ignore[arg-type]
    assert overflow.value.body["error"]["code"] == "context_overflow"  # type: ignore[index]
    with pytest.raises(anthropic.APIStatusError) as in_stream:
        list(api.messages.create(model=MODEL, max_tokens=4, messages=long, stream=True))  # type: ignore[arg-type]
    assert in_stream.value.body["error"]["code"] == "context_overflow"  # type: ignore[index]
    # a body without max_tokens (the SDK requires it: send it raw), and Bearer auth on the same route
    raw = httpx.post(
        f"{url}/v1/messages",
        json={"model": MODEL, "messages": user},
        headers={"Authorization": f"Bearer {api.api_key}"},
    )
    assert raw.status_code == 400 and raw.json()["error"]["type"] == "invalid_request_error"
    assert raw.json()["error"]["param"] == "max_tokens"
    wrong = anthropic.Anthropic(base_url=url, api_key="tt-not-a-key", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError) as auth:
        wrong.messages.create(model=MODEL, max_tokens=4, messages=user)  # type: ignore[arg-type]
    assert auth.value.body["error"]["type"] == "authentication_error"  # type: ignore[index]
    none = httpx.post(f"{url}/v1/messages", json={"model": MODEL, "max_tokens": 4, "messages": user})
    assert none.status_code == 401 and none.json()["type"] == "error"
    # the other /v1 routes keep OpenAI's shape
    other = httpx.post(
        f"{url}/v1/chat/completions", json={"model": "nope", "messages": user}, headers={"x-api-key": str(api.api_key)}
    )
    assert (
        other.status_code == 404 and other.json()["error"]["type"] == "not_found_error" and "type" not in other.json()
    )


def test_stop_sequences_end_the_turn_with_stop_sequence(
    stack: Any, client: Callable[[str], anthropic.Anthropic]
) -> None:
    url = stack[0]
    api = client("an-stop")
    ask = [{"role": "user", "content": "Count the rooms"}]
    cold = {"temperature": 0, "seed": 3}
    free = api.messages.create(model=MODEL, max_tokens=24, messages=ask, extra_body=cold)  # type: ignore[arg-type]
    words = "".join(b.text for b in free.content if b.type == "text").split()
    if len(words) < 3:
        pytest.skip("the model wrote too little to pick a stop sequence")
    stop = words[2]
    pinned = {**cold, "conversation_id": extra(free)["tokentrail"]["chat_id"]}
    with api.messages.stream(
        model=MODEL, max_tokens=24, messages=ask, stop_sequences=[stop], extra_body=pinned
    ) as stream:
        streamed = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert final.stop_reason == "stop_sequence" and final.stop_sequence == stop
    record = stored(url, str(api.api_key), extra(final)["tokentrail"])
    assert streamed == record["content"] and stop not in streamed
    assert extra(final)["tokentrail"]["chat_id"] == extra(free)["tokentrail"]["chat_id"]
