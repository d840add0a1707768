"""OpenAI's Responses API (``/v1/responses``) through the official ``openai`` SDK, against a real server
and worker running the briefly trained tiny model (it reasons and calls tools).

The route is a translation layer over ``/v1/chat/completions``: the same stored trees and prefix
matching, checked here by reading the stored records back: token fields equal the stored ids,
streamed text equals the stored text, and each later prompt extends the previous prompt + completion
(echoing the whole input, or with ``previous_response_id``). Bodies and stream events are validated
with the SDK's own pydantic models (strict ``type`` literals).
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pydantic
import pytest
from openai.types.responses import Response, ResponseStreamEvent

from server.admin import issue_user_key
from tests.stack import MODEL, hf_stack
from tokentrail.trajectory import Trajectory

WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}
EVENTS = pydantic.TypeAdapter(ResponseStreamEvent)


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory, trained_model: Callable[[str], Path]) -> Iterator[Any]:
    model_dir = trained_model("chatml")
    with hf_stack(tmp_path_factory.mktemp("responses"), model_dir, max_batch_size=4) as (url, settings):
        yield url, settings


@pytest.fixture(scope="module")
def api(stack: Any) -> Callable[[str], openai.OpenAI]:
    url, settings = stack
    return lambda user: openai.OpenAI(base_url=f"{url}/v1", api_key=issue_user_key(settings, user), max_retries=0)


def stored(url: str, key: str, info: dict[str, Any]) -> dict[str, Any]:
    resp = httpx.get(
        f"{url}/chats/{info['chat_id']}/messages/{info['message_id']}",
        params={"include": "tokens"},
        headers={"Authorization": f"Bearer {key}"},
    )
    assert resp.status_code == 200, resp.text
    return dict(resp.json())


def create(client: openai.OpenAI, **kwargs: Any) -> dict[str, Any]:
    """A non-streamed response as JSON, after the SDK parsed it and its strict model validated it."""
    raw = client.responses.with_raw_response.create(model=MODEL, **kwargs)
    parsed = raw.parse()
    body = dict(raw.http_response.json())
    Response.model_validate(body)
    assert parsed.id == body["id"] and parsed.output_text == "".join(
        c["text"] for i in body["output"] if i["type"] == "message" for c in i["content"]
    )
    return body


def check_record(body: dict[str, Any], record: dict[str, Any]) -> None:
    """The response shows what is stored: token fields, text, reasoning, tool calls, usage."""
    last = body["output"][-1]
    assert last["prompt_token_ids"] == record["prompt_token_ids"]
    assert last["generation_token_ids"] == record["completion_token_ids"]
    assert last["generation_log_probs"] == pytest.approx(
        [lp if lp is not None else -9999.0 for lp in record["logprobs"]]
    )
    assert not any("prompt_token_ids" in i for i in body["output"][:-1])
    texts = [c["text"] for i in body["output"] if i["type"] == "message" for c in i["content"]]
    assert "".join(texts) == (record["content"] or "")
    summaries = [s["text"] for i in body["output"] if i["type"] == "reasoning" for s in i["summary"]]
    assert "".join(summaries) == (record["reasoning_content"] or "")
    calls = [(i["call_id"], i["name"], i["arguments"]) for i in body["output"] if i["type"] == "function_call"]
    assert calls == [(c["id"], c["function"]["name"], c["function"]["arguments"]) for c in record["tool_calls"] or []]
    usage = body["usage"]
    assert usage["input_tokens"] == len(record["prompt_token_ids"])
    assert usage["output_tokens"] == len(record["completion_token_ids"])
    assert body["status"] == ("incomplete" if record["finish_reason"] == "length" else "completed")


def test_single_turn_and_retrieve(api: Callable[[str], openai.OpenAI], stack: Any) -> None:
    url, _ = stack
    client = api("rs-single")
    body = create(client, input="What is the weather in Oslo?", instructions="Be terse.", max_output_tokens=24)
    info = body["tokentrail"]
    assert body["id"] == f"resp_{info['message_id']}" and body["object"] == "response"
    assert body["instructions"] == "Be terse." and body["model"] == MODEL
    record = stored(url, client.api_key, info)
    check_record(body, record)
    # GET: the same response, by its id or by the bare message id
    got = client.responses.retrieve(body["id"])
    assert got.id == body["id"] and got.status == body["status"] and len(got.output) == len(body["output"])
    raw = httpx.get(f"{url}/v1/responses/{info['message_id']}", headers={"Authorization": f"Bearer {client.api_key}"})
    assert raw.status_code == 200 and raw.json()["output"] == body["output"]
    Response.model_validate(raw.json())
    with pytest.raises(openai.NotFoundError):
        api("rs-other").responses.retrieve(body["id"])  # another user's response
    with pytest.raises(openai.NotFoundError) as nf:
        client.responses.retrieve("resp_nope")
    assert nf.value.body["type"] == "not_found_error"  # type: ignore[index]


def test_stream_adds_up_to_the_stored_reply(api: Callable[[str], openai.OpenAI], stack: Any) -> None:
    url, _ = stack
    client = api("rs-stream")
    seen: set[str] = set()
    for k in range(10):  # the trained model often reasons and calls tools: replies until both streamed
        if {"reasoning", "function_call", "message"} <= seen:
            break
        stream = client.responses.create(
            model=MODEL,
            input=[
                {"role": "developer", "content": "You can check the weather."},
                {"role": "user", "content": "What is the weather in Oslo?"},
            ],
            tools=[WEATHER],  # type: ignore[list-item]
            max_output_tokens=48,
            temperature=0.7,
            stream=True,
            extra_body={"seed": k},
        )
        events = [e.model_dump() for e in stream]
        for e in events:
            EVENTS.validate_python(e)
        kinds = [e["type"] for e in events]
        assert kinds[:2] == ["response.created", "response.in_progress"]
        assert kinds[-1] in ("response.completed", "response.incomplete")
        assert [e["sequence_number"] for e in events] == list(range(len(events)))
        final = events[-1]["response"]
        info = final["tokentrail"]
        record = stored(url, client.api_key, info)
        check_record(final, record)
        text = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
        reasoning = "".join(e["delta"] for e in events if e["type"] == "response.reasoning_summary_text.delta")
        assert text == (record["content"] or "") and reasoning == (record["reasoning_content"] or "")
        done = [e["item"] for e in events if e["type"] == "response.output_item.done"]
        assert done == final["output"]
        seen |= {i["type"] for i in done}
        added = [e["output_index"] for e in events if e["type"] == "response.output_item.added"]
        assert added == list(range(len(final["output"])))
        for e in events:
            if e["type"] == "response.function_call_arguments.done":
                call = final["output"][e["output_index"]]
                assert e["arguments"] == call["arguments"] and e["item_id"] == call["id"]
    assert {"reasoning", "function_call", "message"} <= seen, seen
    # the SDK's accumulating helper (it needs response.completed: a reply that closed its turn)
    with client.responses.stream(model=MODEL, input="Hello", max_output_tokens=200, extra_body={"seed": 1}) as helper:
        kinds = [e.type for e in helper]
        if kinds[-1] == "response.completed":
            final_response = helper.get_final_response()
            record = stored(url, client.api_key, (final_response.model_extra or {})["tokentrail"])
            assert final_response.output_text == (record["content"] or "")


def _echo(output: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The items of a response as a client echoes them (as returned, token fields included) and the
    results of its function calls."""
    calls = [i for i in output if i["type"] == "function_call"]
    results = [
        {"type": "function_call_output", "call_id": c["call_id"], "output": json.dumps({"temp": 11})} for c in calls
    ]
    return output, results


def turn(items: list[dict[str, Any]], seed: int, **kwargs: Any) -> dict[str, Any]:
    return {
        "input": items,
        "tools": [WEATHER],
        "max_output_tokens": 48,
        "temperature": 0.7,
        "extra_body": {"seed": seed},
        **kwargs,
    }


def first_tool_call(client: openai.OpenAI, items: list[dict[str, Any]], **kwargs: Any) -> dict[str, Any]:
    """The first turn, asked again (siblings) until the model calls a tool."""
    for seed in range(10):
        body = create(client, **turn(items, seed, **kwargs))
        if any(i["type"] == "function_call" for i in body["output"]):
            return body
    raise AssertionError("the trained model made no tool call")


def _assert_stitched(records: list[dict[str, Any]]) -> None:
    assert len({r["chat_id"] for r in records}) == 1
    for prev, cur in itertools.pairwise(records):
        reused = prev["prompt_token_ids"] + prev["completion_token_ids"]
        assert cur["prior_message_id"] == prev["id"] and not cur["fork"], cur["prompt_method"]
        assert cur["prompt_token_ids"][: len(reused)] == reused


def test_agent_loop_echoing_the_full_input(api: Callable[[str], openai.OpenAI], stack: Any) -> None:
    """The client sends the whole conversation each turn: the items it got back (token fields
    included, checked like NeMo RL's required_prefix_token_ids), its tool results, and once a tool
    call and reasoning item it wrote itself."""
    url, _ = stack
    client = api("rs-echo")
    items: list[dict[str, Any]] = [{"type": "message", "role": "developer", "content": "You can check the weather."}]
    records: list[dict[str, Any]] = []
    checks = []
    tool_turns = 0
    for t, ask in enumerate(["What is the weather in Oslo?", "And in Lima? <tool_call>"]):
        items.append({"type": "message", "role": "user", "content": [{"type": "input_text", "text": ask}]})
        for step in range(8):
            body = first_tool_call(client, items) if t == step == 0 else create(client, **turn(items, t))
            info = body["tokentrail"]
            checks.append(info.get("prompt_check"))
            record = stored(url, client.api_key, info)
            check_record(body, record)
            records.append(record)
            echoed, results = _echo(body["output"])
            items += echoed + results
            tool_turns += bool(results)
            if not results or step >= 2:
                break
    assert tool_turns >= 1
    # a turn the client writes itself: reasoning, a function call and its output, then a question
    items += [
        {"type": "reasoning", "id": "rs_mine", "summary": [{"type": "summary_text", "text": "I should check."}]},
        {"type": "function_call", "call_id": "call_mine", "name": "get_weather", "arguments": '{"city": "Oslo"}'},
        {"type": "function_call_output", "call_id": "call_mine", "output": '{"temp": 3}'},
        {"role": "user", "content": "Thanks!"},
    ]
    body = create(client, input=items, tools=[WEATHER], max_output_tokens=16)
    record = stored(url, client.api_key, body["tokentrail"])
    check_record(body, record)
    assert record["prompt_method"].startswith("stitch-written/")
    records.append(record)
    _assert_stitched(records)
    # every turn after the first echoed token ids: each equals the stored chain
    assert checks[0] is None and all(c == "prefix-match" for c in checks[1:]), checks
    assert body["tokentrail"]["prompt_check"] == "prefix-match"
    # the written turn is stored as one assistant message with its reasoning and call
    tree = httpx.get(f"{url}/chats/{record['chat_id']}", headers={"Authorization": f"Bearer {client.api_key}"})
    manual = [m for m in tree.json()["messages"] if m["role"] == "assistant" and m["state"] == "manual"]
    assert [(m["reasoning_content"], [c["id"] for c in m["tool_calls"]]) for m in manual] == [
        ("I should check.", ["call_mine"])
    ]
    # echoed token ids that differ from the stored chain are reported, never used
    tampered = [dict(i) for i in items]
    last = next(i for i in reversed(tampered) if "prompt_token_ids" in i)
    last["prompt_token_ids"] = [last["prompt_token_ids"][0] + 1, *last["prompt_token_ids"][1:]]
    body = create(client, input=tampered, tools=[WEATHER], max_output_tokens=4)
    assert body["tokentrail"]["prompt_check"] == "prefix-mismatch@0"
    assert body["output"][-1]["prompt_token_ids"][:1] != last["prompt_token_ids"][:1]


def test_previous_response_id_continues_the_stored_tree(api: Callable[[str], openai.OpenAI], stack: Any) -> None:
    url, _ = stack
    client = api("rs-previous")
    records: list[dict[str, Any]] = []
    traj = Trajectory()  # the client-side record of the same episode
    previous = None
    new_input: list[dict[str, Any]] = [{"role": "user", "content": "What is the weather in Oslo?"}]
    for t in range(4):
        kwargs: dict[str, Any] = {"previous_response_id": previous} if previous else {"instructions": "Be terse."}
        if t == 0:
            body = first_tool_call(client, new_input, **kwargs)
        else:
            body = create(client, **turn(new_input, t, **kwargs))
        assert body["previous_response_id"] == previous and body["instructions"] == "Be terse."
        record = stored(url, client.api_key, body["tokentrail"])
        check_record(body, record)
        records.append(record)
        traj.add(body)
        _, results = _echo(body["output"])
        new_input = results or [{"role": "user", "content": f"And now {t}?"}]
        previous = body["id"]
    _assert_stitched(records)
    # tokentrail.trajectory reads Responses objects as it reads chat completions: one sample, the stored ids
    rollout = traj.rollout()
    assert len(rollout.samples) == 1 and rollout.chat_id == records[0]["chat_id"]
    assert [t.completion_ids for t in rollout.turns] == [r["completion_token_ids"] for r in records]
    assert [t.logprobs for t in rollout.turns] == [r["logprobs"] for r in records]
    # a stream continues it too
    stream = client.responses.create(
        model=MODEL, input=new_input, previous_response_id=previous, max_output_tokens=8, stream=True
    )
    final = [e.model_dump() for e in stream][-1]["response"]
    records.append(stored(url, client.api_key, final["tokentrail"]))
    _assert_stitched(records)
    # unknown or another user's response: 404 in OpenAI's shape
    for rid in ("resp_00000000-0000-7000-8000-000000000000", previous):
        with pytest.raises(openai.NotFoundError) as nf:
            api("rs-stranger").responses.create(model=MODEL, input="hi", previous_response_id=rid)
        err = nf.value.body
        assert isinstance(err, dict) and err["param"] == "previous_response_id", err


def test_unsupported_input_is_refused_naming_the_field(api: Callable[[str], openai.OpenAI]) -> None:
    client = api("rs-errors")
    user = {"role": "user", "content": "hi"}
    cases: list[tuple[dict[str, Any], str, str]] = [
        ({"input": [user, {"type": "web_search_call", "id": "ws_1"}]}, "invalid_messages", "input[1].type"),
        ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "invalid_messages", "input[0].type"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x/y.png"}]}]},
            "invalid_messages",
            "input[0].content[0]",
        ),
        ({"input": [user, {"type": "function_call_output", "output": "x"}]}, "invalid_messages", "input[1].call_id"),
        ({"input": [user, {"role": "assistant", "content": "x"}]}, "invalid_messages", "input[1].role"),
        ({"input": [user, {"role": "system", "content": "late"}, user]}, "invalid_messages", "input[1]"),
        ({"input": "hi", "tool_choice": "required"}, "unsupported_parameter", "tool_choice"),
        ({"input": "hi", "tools": [{"type": "web_search"}]}, "unsupported_parameter", "tools[0].type"),
        ({"input": "hi", "text": {"format": {"type": "json_object"}}}, "unsupported_parameter", "text.format"),
        ({"input": "hi", "background": True}, "unsupported_parameter", "background"),
        ({"input": "hi", "temperature": -1}, "validation_error", "temperature"),
    ]
    for body, code, param in cases:
        with pytest.raises(openai.BadRequestError) as bad:
            client.responses.create(model=MODEL, **body)
        err = bad.value.body
        assert isinstance(err, dict) and err["code"] == code and err["param"] == param, (body, err)
        assert err["type"] == "invalid_request_error", err
        assert param in err["message"] or code == "validation_error", err
    with pytest.raises(openai.NotFoundError) as nf:
        client.responses.create(model="nope", input="hi")
    assert nf.value.body["code"] == "model_not_found"  # type: ignore[index]


def test_a_failed_reply_is_an_error_or_response_failed(api: Callable[[str], openai.OpenAI]) -> None:
    client = api("rs-failed")
    long_input = "Oslo weather " * 1500  # more tokens than the model's 2048 positions
    with pytest.raises(openai.BadRequestError) as bad:
        client.responses.create(model=MODEL, input=long_input, max_output_tokens=4)
    assert bad.value.body["code"] == "context_overflow"  # type: ignore[index]
    stream = client.responses.create(model=MODEL, input=long_input, max_output_tokens=4, stream=True)
    events = [e.model_dump() for e in stream]
    for e in events:
        EVENTS.validate_python(e)
    assert [e["type"] for e in events] == ["response.created", "response.in_progress", "response.failed"]
    failed = events[-1]["response"]
    assert failed["status"] == "failed" and "context_overflow" in failed["error"]["message"]
    got = client.responses.retrieve(failed["id"])
    assert got.status == "failed" and got.error is not None and got.output == []


def test_items_of_one_turn_merge_into_one_assistant_message() -> None:
    """Translation alone (no server): Responses splits an assistant turn into reasoning, message and
    function-call items; they become one chat message again, and errors name the input item."""
    from server.errors import ApiError
    from server.openai.responses import conversation, translate
    from shared.responses_api import ResponsesRequest

    call = {"type": "function_call", "name": "get_weather", "arguments": "{}"}
    items: list[dict[str, Any]] = [
        {"role": "developer", "content": "Check the weather."},
        {"role": "user", "content": [{"type": "input_text", "text": "Oslo and Lima?"}]},
        {"type": "reasoning", "id": "rs_1", "summary": [{"type": "summary_text", "text": "two calls"}]},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Checking."}]},
        {**call, "call_id": "c1"},
        {**call, "call_id": "c2", "prompt_token_ids": [1, 2], "generation_token_ids": [3]},
        {"type": "function_call_output", "call_id": "c1", "output": "3C"},
        {"type": "function_call_output", "call_id": "c2", "output": [{"type": "input_text", "text": "20C"}]},
        {"type": "message", "role": "assistant", "content": "Oslo 3C."},
        {"type": "reasoning", "summary": [], "encrypted_content": "opaque"},  # a new turn: reasoning comes first
        {**call, "call_id": "c3"},
        {"type": "function_call_output", "call_id": "c3", "output": "ok"},
    ]
    tr = translate(ResponsesRequest(model="m", input=items, instructions="Be terse."))
    assert tr.required_prefix == [1, 2, 3]
    roles = ["system", "user", "assistant", "tool", "tool", "assistant", "assistant", "tool"]
    assert [m["role"] for m in tr.messages] == roles
    assert tr.messages[0]["content"] == "Be terse.\n\nCheck the weather."
    merged = tr.messages[2]
    assert merged["reasoning_content"] == "two calls" and [c["id"] for c in merged["tool_calls"]] == ["c1", "c2"]
    conv = conversation(tr)
    assert conv.system_prompt == "Be terse.\n\nCheck the weather."
    assert [m.role for m in conv.path] == roles[1:]
    assert conv.path[4].content == "Oslo 3C." and conv.path[4].tool_calls is None
    assert conv.path[5].content == "" and [c["id"] for c in conv.path[5].tool_calls or []] == ["c3"]
    bad = [
        *items[:4],
        {**call, "call_id": "c1", "arguments": "{}"},
        {"role": "user", "content": [{"type": "input_file"}]},
    ]
    with pytest.raises(ApiError) as err:
        conversation(translate(ResponsesRequest(model="m", input=bad)))
    assert err.value.param == "input[5].content[0]", err.value.detail
