"""The OpenAI-compatible API through the official ``openai`` SDK, against a real server and worker.

Clients send only messages; the server matches them to stored paths and the worker stitches prompts
from stored tokens. Plumbing runs on the embedded stack (tiny random model); the agent loop runs on
the briefly trained tiny model, which calls tools, and ends in export + verify.
"""

from __future__ import annotations

import asyncio
import itertools
import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from server.admin import issue_user_key
from server.settings import ServerSettings
from tests.stack import MODEL, hf_stack
from tests.test_export import run_cli
from tokentrail.trajectory import Trajectory


@pytest.fixture(scope="module")
def api(embedded_stack: str, embedded_settings: ServerSettings) -> Callable[[str], openai.OpenAI]:
    """``api(user)``: an SDK client with a fresh API key of that user."""
    return lambda user: openai.OpenAI(
        base_url=f"{embedded_stack}/v1", api_key=issue_user_key(embedded_settings, user), max_retries=0
    )


def stored(url: str, key: str, chat_id: str, message_id: str) -> dict[str, Any]:
    resp = httpx.get(
        f"{url}/chats/{chat_id}/messages/{message_id}",
        params={"include": "tokens"},
        headers={"Authorization": f"Bearer {key}"},
    )
    assert resp.status_code == 200, resp.text
    return resp.json()


def extra(obj: Any) -> dict[str, Any]:
    return dict(obj.model_extra or {})


def test_models_and_errors_in_openai_shape(api: Callable[[str], openai.OpenAI], embedded_stack: str) -> None:
    client = api("oa-errors")
    assert [m.id for m in client.models.list().data] == [MODEL]
    user = [{"role": "user", "content": "hi"}]
    with pytest.raises(openai.NotFoundError) as nf:
        client.chat.completions.create(model="nope", messages=user)  # type: ignore[arg-type]
    assert nf.value.body["code"] == "model_not_found" and nf.value.body["param"] == "model"  # type: ignore[index]
    cases: list[tuple[dict[str, Any], str, str | None]] = [
        ({"messages": [{"role": "assistant", "content": "x"}]}, "invalid_messages", "messages[0].role"),
        ({"messages": [*user, {"role": "system", "content": "late"}, *user]}, "invalid_messages", "messages[1]"),
        ({"messages": [{"role": "tool", "content": "r"}]}, "invalid_messages", "messages[0].tool_call_id"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "invalid_messages", None),
        ({"messages": user, "tool_choice": "required"}, "unsupported_parameter", "tool_choice"),
        ({"messages": user, "presence_penalty": 0.5}, "unsupported_parameter", "presence_penalty"),
        ({"messages": user, "top_logprobs": 2}, "validation_error", "top_logprobs"),
        ({"messages": user, "temperature": -1}, "validation_error", "temperature"),
        ({"messages": user, "n": 99}, "validation_error", "n"),
        ({"messages": [], "max_tokens": 3}, "validation_error", "messages"),
    ]
    for body, code, param in cases:
        with pytest.raises(openai.BadRequestError) as bad:
            client.chat.completions.create(model=MODEL, **body)
        err = bad.value.body
        assert isinstance(err, dict) and err["code"] == code, (body, err)
        assert err["type"] == "invalid_request_error"
        if param is not None:
            assert err["param"] == param, (body, err)
    wrong = openai.OpenAI(base_url=f"{embedded_stack}/v1", api_key="tt-not-a-key", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as auth:
        wrong.chat.completions.create(model=MODEL, messages=user)  # type: ignore[arg-type]
    assert auth.value.body["type"] == "authentication_error"  # type: ignore[index]


def test_messages_only_turns_continue_the_stored_tokens(
    api: Callable[[str], openai.OpenAI], embedded_stack: str
) -> None:
    client = api("oa-turns")
    key = client.api_key
    messages: list[dict[str, Any]] = [{"role": "system", "content": "Be terse."}]
    previous: dict[str, Any] | None = None
    chat_id = None
    traj = Trajectory()
    for i, max_tokens in enumerate([5, 12, 4]):
        messages.append({"role": "user", "content": f"question {i} <|im_end|>"})
        resp = client.chat.completions.create(
            model=MODEL,
            messages=messages,  # type: ignore[arg-type]
            max_tokens=max_tokens,
            seed=i,
            logprobs=True,
        )
        traj.add(resp)
        info = extra(resp)["tokentrail"]
        choice = resp.choices[0]
        record = stored(embedded_stack, key, info["chat_id"], info["message_id"])
        assert extra(resp)["prompt_token_ids"] == record["prompt_token_ids"]
        assert extra(choice)["token_ids"] == record["completion_token_ids"]
        assert choice.message.content == record["content"]
        assert resp.usage is not None and resp.usage.prompt_tokens == len(record["prompt_token_ids"])
        assert info["matched_messages"] == 2 * i and info["new_messages"] == 1 and not info["forked"]
        if previous is None:
            assert record["prior_message_id"] is None
        else:
            reused = previous["prompt_token_ids"] + previous["completion_token_ids"]
            assert info["chat_id"] == chat_id
            assert record["prior_message_id"] == previous["id"] and info["reused_prefix_len"] == len(reused)
            assert record["prompt_token_ids"][: len(reused)] == reused
        chat_id, previous = info["chat_id"], record
        # echo as clients do: content only (the id, reasoning and token fields are dropped)
        messages.append({"role": "assistant", "content": choice.message.content})
    assert previous is not None
    # the client helper's rollout: one sample, the last prompt + completion, masked on generated tokens
    rollout = traj.rollout(reward=1.0)
    [sample] = rollout.samples
    assert sample.token_ids == previous["prompt_token_ids"] + previous["completion_token_ids"]
    assert sum(sample.loss_mask) == sum(len(t.completion_ids) for t in rollout.turns)
    assert [sample.token_ids[a:b] for a, b in sample.turn_spans] == [t.completion_ids for t in rollout.turns]
    assert rollout.turns[-1].logprobs == pytest.approx(previous["logprobs"])


def test_tokens_in_and_required_prefix_are_checked(api: Callable[[str], openai.OpenAI], embedded_stack: str) -> None:
    client = api("oa-tokens")
    messages = [{"role": "user", "content": "tokens in"}]
    base = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=3)  # type: ignore[arg-type]
    prompt = extra(base)["prompt_token_ids"]
    headers = {"Authorization": f"Bearer {client.api_key}"}

    def post(path: str, body: dict[str, Any]) -> dict[str, Any]:
        resp = httpx.post(f"{embedded_stack}{path}", json={"model": MODEL, "max_tokens": 3, **body}, headers=headers)
        assert resp.status_code == 200, resp.text
        return dict(resp.json())

    same = post("/v1/chat/completions/tokens", {"messages": messages, "tokens": prompt})
    assert same["tokentrail"]["prompt_check"] == "match" and same["prompt_token_ids"] == prompt
    altered = [*prompt[:-2], prompt[-2] + 1, prompt[-1]]
    other = post("/v1/chat/completions/tokens", {"messages": messages, "tokens": altered})
    info = other["tokentrail"]
    assert info["prompt_check"] == f"mismatch@{len(prompt) - 2}" and not info["prompt_matched"]
    assert other["prompt_token_ids"] == altered  # tokens in: generation used the client's prompt
    prefix = post("/v1/chat/completions", {"messages": messages, "required_prefix_token_ids": prompt[:4]})
    assert prefix["tokentrail"]["prompt_check"] == "prefix-match"
    wrong = post("/v1/chat/completions", {"messages": messages, "required_prefix_token_ids": [prompt[0] + 1]})
    assert wrong["tokentrail"]["prompt_check"] == "prefix-mismatch@0"


def test_streaming_chunks_add_up_to_the_stored_message(
    api: Callable[[str], openai.OpenAI], embedded_stack: str
) -> None:
    client = api("oa-stream")
    messages = [{"role": "user", "content": "stream please"}]
    chunks = list(
        client.chat.completions.create(
            model=MODEL,
            messages=messages,  # type: ignore[arg-type]
            max_tokens=9,
            stream=True,
            logprobs=True,
            top_logprobs=3,
            stream_options={"include_usage": True},
        )
    )
    first, last, usage_chunk = chunks[0], chunks[-2], chunks[-1]
    assert first.choices[0].delta.role == "assistant"
    prompt = extra(first)["prompt_token_ids"]
    ids = [t for c in chunks[:-1] for t in extra(c.choices[0])["token_ids"]]
    content = "".join(c.choices[0].delta.content or "" for c in chunks[:-1])
    lps = [e.logprob for c in chunks[:-1] if c.choices[0].logprobs for e in c.choices[0].logprobs.content or []]
    tops = [e.top_logprobs for c in chunks[:-1] if c.choices[0].logprobs for e in c.choices[0].logprobs.content or []]
    info = extra(last)["tokentrail"]
    record = stored(embedded_stack, client.api_key, info["chat_id"], info["message_id"])
    assert prompt == record["prompt_token_ids"] and ids == record["completion_token_ids"]
    assert content == record["content"]  # whitespace the parsed message strips is never streamed
    assert lps == pytest.approx([lp if lp is not None else -9999.0 for lp in record["logprobs"]])
    assert all(0 < len(t) <= 3 for t in tops)
    assert last.choices[0].finish_reason == "length" and len(ids) == 9
    assert usage_chunk.choices == [] and usage_chunk.usage is not None
    assert usage_chunk.usage.completion_tokens == 9 and usage_chunk.usage.prompt_tokens == len(prompt)


def test_n_siblings_then_the_echoed_one_is_continued(api: Callable[[str], openai.OpenAI], embedded_stack: str) -> None:
    client = api("oa-siblings")
    messages: list[dict[str, Any]] = [{"role": "user", "content": "two answers"}]
    resp = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=6, n=2, temperature=1.0)  # type: ignore[arg-type]
    assert [c.index for c in resp.choices] == [0, 1]
    picked = resp.choices[1]
    picked_id = extra(picked)["tokentrail"]["message_id"]
    assert picked_id != extra(resp.choices[0])["tokentrail"]["message_id"]
    messages += [{"role": "assistant", "content": picked.message.content}, {"role": "user", "content": "go on"}]
    nxt = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4)  # type: ignore[arg-type]
    info = extra(nxt)["tokentrail"]
    record = stored(embedded_stack, client.api_key, info["chat_id"], info["message_id"])
    if resp.choices[0].message.content != picked.message.content:  # identical siblings are interchangeable
        assert record["prior_message_id"] == picked_id
    assert info["chat_id"] == extra(resp)["tokentrail"]["chat_id"] and not info["forked"]


def test_an_edited_history_forks_and_is_recorded(api: Callable[[str], openai.OpenAI], embedded_stack: str) -> None:
    client = api("oa-edit")
    messages: list[dict[str, Any]] = [{"role": "user", "content": "original"}]
    first = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=5)  # type: ignore[arg-type]
    chat_id = extra(first)["tokentrail"]["chat_id"]
    edited = [*messages, {"role": "assistant", "content": "an answer I wrote myself"}, {"role": "user", "content": "?"}]
    resp = client.chat.completions.create(model=MODEL, messages=edited, max_tokens=4)  # type: ignore[arg-type]
    info = extra(resp)["tokentrail"]
    assert info["chat_id"] == chat_id and info["forked"] and info["matched_messages"] == 1
    record = stored(embedded_stack, client.api_key, chat_id, info["message_id"])
    assert record["fork"] and record["prompt_method"].startswith("full")
    tree = httpx.get(f"{embedded_stack}/chats/{chat_id}", headers={"Authorization": f"Bearer {client.api_key}"}).json()
    manual = [m for m in tree["messages"] if m["role"] == "assistant" and m["state"] == "manual"]
    assert [m["content"] for m in manual] == ["an answer I wrote myself"]
    # the original branch is untouched: both assistant answers hang off the first user message
    root = next(m for m in tree["messages"] if m["parent_id"] is None)
    assert {m["id"] for m in tree["messages"] if m["parent_id"] == root["id"]} >= {
        extra(first)["tokentrail"]["message_id"],
        manual[0]["id"],
    }


def _echo(message: Any) -> list[dict[str, Any]]:
    """A reply as an OpenAI client echoes it back, with a result for each tool call it made."""
    calls = [c.model_dump() for c in message.tool_calls or []]
    echoed: dict[str, Any] = {"role": "assistant", "content": message.content}
    if calls:
        echoed["tool_calls"] = calls
    return [echoed, *({"role": "tool", "tool_call_id": c["id"], "content": "ok"} for c in calls)]


def test_a_client_written_assistant_turn_keeps_the_stored_prefix(
    api: Callable[[str], openai.OpenAI], embedded_stack: str
) -> None:
    """An agent appends a tool call it made itself (content null), the tool's result and a question,
    as verifiers' agents do: the prompt is the stored turn's tokens, then the written turn rendered
    as a new message; later a plain-text reply the client typed does the same."""
    client = api("oa-written")
    tools = [{"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}]
    messages: list[dict[str, Any]] = [{"role": "user", "content": "what time is it?"}]
    first = client.chat.completions.create(model=MODEL, messages=messages, tools=tools, max_tokens=6)  # type: ignore[arg-type]
    first_info = extra(first)["tokentrail"]
    first_record = stored(embedded_stack, client.api_key, first_info["chat_id"], first_info["message_id"])
    call = {"id": "call_mine", "type": "function", "function": {"name": "get_time", "arguments": "{}"}}
    messages += [
        *_echo(first.choices[0].message),
        {"role": "user", "content": "use the tool"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_mine", "content": "12:00"},
    ]
    second = client.chat.completions.create(model=MODEL, messages=messages, tools=tools, max_tokens=6)  # type: ignore[arg-type]
    info = extra(second)["tokentrail"]
    assert info["chat_id"] == first_info["chat_id"] and not info["forked"]
    assert info["matched_messages"] == len(_echo(first.choices[0].message)) + 1
    record = stored(embedded_stack, client.api_key, info["chat_id"], info["message_id"])
    assert record["prior_message_id"] == first_info["message_id"] and not record["fork"]
    assert record["prompt_method"].startswith("stitch-written/")
    before = first_record["prompt_token_ids"] + first_record["completion_token_ids"]
    assert record["prompt_token_ids"][: len(before)] == before
    # a reply the client typed after the generated one: the next prompt extends the second turn
    messages += [
        *_echo(second.choices[0].message),
        {"role": "user", "content": "thanks"},
        {"role": "assistant", "content": "You are welcome <|im_end|> (typed by the client)"},
        {"role": "user", "content": "bye"},
    ]
    third = client.chat.completions.create(model=MODEL, messages=messages, tools=tools, max_tokens=4)  # type: ignore[arg-type]
    third_info = extra(third)["tokentrail"]
    third_record = stored(embedded_stack, client.api_key, third_info["chat_id"], third_info["message_id"])
    assert third_record["prior_message_id"] == info["message_id"]
    assert third_record["prompt_method"].startswith("stitch-written/")
    before = record["prompt_token_ids"] + record["completion_token_ids"]
    assert third_record["prompt_token_ids"][: len(before)] == before
    # verifiers' tokens route checks the client's prompt against the same stitched prompt
    checked = httpx.post(
        f"{embedded_stack}/v1/chat/completions/tokens",
        json={
            "model": MODEL,
            "messages": messages,
            "tools": tools,
            "max_tokens": 2,
            "tokens": third_record["prompt_token_ids"],
        },
        headers={"Authorization": f"Bearer {client.api_key}"},
    )
    assert checked.status_code == 200, checked.text
    assert checked.json()["tokentrail"]["prompt_check"] == "match"


def test_stop_strings_and_conversation_pinning(api: Callable[[str], openai.OpenAI], embedded_stack: str) -> None:
    client = api("oa-stop")
    messages = [{"role": "user", "content": "count"}]
    free = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=12, seed=3, temperature=0)  # type: ignore[arg-type]
    text = free.choices[0].message.content or ""
    words = text.split()
    if len(words) < 3:
        pytest.skip("the random model wrote too little to pick a stop string")
    stop = words[2]
    again = client.chat.completions.create(
        model=MODEL,
        messages=messages,  # type: ignore[arg-type]
        max_tokens=12,
        seed=3,
        temperature=0,
        stop=[stop],
        extra_body={"conversation_id": extra(free)["tokentrail"]["chat_id"]},
    )
    choice = again.choices[0]
    assert choice.finish_reason == "stop" and extra(choice)["stop_reason"] == stop
    assert stop not in (choice.message.content or "") and text.startswith((choice.message.content or "").strip())
    assert len(extra(choice)["token_ids"]) < 12
    assert extra(again)["tokentrail"]["chat_id"] == extra(free)["tokentrail"]["chat_id"]


def test_concurrent_agents_do_not_cross_match(api: Callable[[str], openai.OpenAI], embedded_stack: str) -> None:
    key = api("oa-swarm").api_key
    # 64 requests from one user can outrun the per-user rate limit (burst 60, 10/s) on a fast machine:
    # the SDK retries a 429 after its Retry-After, as agents do (a 429 stores nothing).
    client = openai.AsyncOpenAI(base_url=f"{embedded_stack}/v1", api_key=key, max_retries=4)

    async def agent(k: int) -> list[dict[str, Any]]:
        messages: list[dict[str, Any]] = [{"role": "user", "content": f"task {k}: shared preamble"}]
        infos = []
        for t in range(2):
            resp = await client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4, seed=k)  # type: ignore[arg-type]
            infos.append(extra(resp)["tokentrail"])
            messages += [
                {"role": "assistant", "content": resp.choices[0].message.content},
                {"role": "user", "content": f"agent {k} step {t}"},
            ]
        return infos

    async def swarm() -> list[list[dict[str, Any]]]:
        try:
            return await asyncio.gather(*(agent(k) for k in range(32)))
        finally:
            await client.close()

    runs = asyncio.run(swarm())
    assert len({r[0]["chat_id"] for r in runs}) == 32
    for first, second in runs:
        assert second["chat_id"] == first["chat_id"] and second["matched_messages"] == 2
        record = stored(embedded_stack, key, second["chat_id"], second["message_id"])
        assert record["prior_message_id"] == first["message_id"]


# ---- an agent loop on a model that calls tools ----------------------------------------------------
@pytest.fixture(scope="module")
def agent_stack(tmp_path_factory: pytest.TempPathFactory, trained_model: Callable[[str], Path]) -> Iterator[Any]:
    model_dir = trained_model("chatml")
    with hf_stack(tmp_path_factory.mktemp("oa-agent"), model_dir, max_batch_size=4) as (url, settings):
        yield url, settings, model_dir


WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather of a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}


def test_agent_loop_with_tools_is_exact_exports_and_verifies(agent_stack: Any, tmp_path: Path) -> None:
    url, settings, model_dir = agent_stack
    key = issue_user_key(settings, "agent")
    client = openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0)
    messages: list[dict[str, Any]] = [{"role": "system", "content": "You can check the weather."}]
    records: list[dict[str, Any]] = []
    tool_turns = 0
    for t, ask in enumerate(["What is the weather in Oslo?", "And in Lima? <tool_call>", "Thanks!"]):
        messages.append({"role": "user", "content": ask})
        for _ in range(3):
            resp = client.chat.completions.create(
                model=MODEL,
                messages=messages,  # type: ignore[arg-type]
                tools=[WEATHER],  # type: ignore[list-item]
                max_tokens=48,
                temperature=0.7,
                seed=t,
                logprobs=True,
            )
            msg = resp.choices[0].message
            info = extra(resp)["tokentrail"]
            record = stored(url, key, info["chat_id"], info["message_id"])
            records.append(record)
            echo: dict[str, Any] = {"role": "assistant", "content": msg.content}
            if msg.tool_calls:
                echo["tool_calls"] = [c.model_dump() for c in msg.tool_calls]
            messages.append(echo)
            if not msg.tool_calls:
                break
            tool_turns += 1
            for call in msg.tool_calls:
                result = {"city": json.loads(call.function.arguments or "{}").get("city"), "temp": 11}
                messages.append({"role": "tool", "tool_call_id": call.id, "content": json.dumps(result)})
    # EPB 0: every later prompt extends the previous turn's prompt + completion exactly
    for prev, cur in itertools.pairwise(records):
        reused = prev["prompt_token_ids"] + prev["completion_token_ids"]
        assert cur["prior_message_id"] == prev["id"] and not cur["fork"]
        assert cur["prompt_token_ids"][: len(reused)] == reused
    assert len({r["chat_id"] for r in records}) == 1
    out = tmp_path / "agent.jsonl"
    run_cli("export", "--out", str(out), "--data-dir", str(settings.data_dir), "--user", "agent", "--quiet")
    rollouts = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(rollouts) == 1 and len(rollouts[0]["samples"]) == 1
    report = run_cli("verify", str(out), "--model", str(model_dir))
    assert "PASS" in report, report
    assert tool_turns >= 1, "the trained model made no tool call: the loop did not exercise tool turns"
