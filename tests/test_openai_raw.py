"""Raw prompts and tokenizer calls of the OpenAI-compatible API against a real server and worker:
``/v1/completions`` through the official SDK, vLLM's ``/inference/v1/generate``, ``/tokenize`` and
``/detokenize`` (answered by the worker over the websocket). Ends in export + verify of the stored
raw-prompt chats."""

from __future__ import annotations

import json
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from transformers import AutoTokenizer

from server.admin import issue_user_key
from server.settings import ServerSettings
from tests.stack import MODEL
from tests.test_export import run_cli
from tests.test_openai_api import extra, stored


@pytest.fixture(scope="module")
def user_key(embedded_settings: ServerSettings) -> Callable[[str], str]:
    return lambda user: issue_user_key(embedded_settings, user)


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir: Path) -> Any:
    return AutoTokenizer.from_pretrained(str(tiny_model_dir))


def post(url: str, key: str, path: str, body: dict[str, Any], status: int = 200) -> dict[str, Any]:
    resp = httpx.post(f"{url}{path}", json=body, headers={"Authorization": f"Bearer {key}"}, timeout=60)
    assert resp.status_code == status, resp.text
    return dict(resp.json())


def sse_events(url: str, key: str, path: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    events: list[dict[str, Any]] = []
    with httpx.stream(
        "POST", f"{url}{path}", json=body, headers={"Authorization": f"Bearer {key}"}, timeout=60
    ) as resp:
        assert resp.status_code == 200, resp.read()
        done = False
        for line in resp.iter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                done = True
                continue
            events.append(json.loads(line[len("data: ") :]))
    assert done, "the stream did not end with [DONE]"
    return events


def test_tokenize_and_detokenize_answered_by_the_worker(embedded_stack: str, user_key: Any, tokenizer: Any) -> None:
    url, key = embedded_stack, user_key("oa-tokenize")
    text = "Hello tokens, héllo"
    out = post(url, key, "/tokenize", {"prompt": text, "return_token_strs": True})  # model optional: one served
    assert out["tokens"] == tokenizer.encode(text) and out["count"] == len(out["tokens"])
    assert out["token_strs"] == tokenizer.convert_ids_to_tokens(out["tokens"])
    assert out["max_model_len"] and out["max_model_len"] > 0
    back = post(url, key, "/detokenize", {"model": MODEL, "tokens": out["tokens"]})
    assert back["prompt"] == tokenizer.decode(out["tokens"])
    # chat form: the same tokens the worker builds for a fresh chat completion of these messages
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "what is <|im_end|> 2+2?"},
        {"role": "assistant", "content": "four"},
        {"role": "user", "content": "and 3+3?"},
    ]
    chat = post(url, key, "/tokenize", {"model": MODEL, "messages": messages, "return_assistant_mask": True})
    client = openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0)
    resp = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2)  # type: ignore[arg-type]
    assert extra(resp)["prompt_token_ids"] == chat["tokens"]
    # the user's "<|im_end|>" is text, never the control token
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert chat["tokens"].count(im_end) == len(messages)
    # the mask covers exactly the assistant's generated turn: its text and its end-of-turn token
    mask = chat["assistant_mask"]
    assert len(mask) == len(chat["tokens"])
    generated = [t for t, m in zip(chat["tokens"], mask, strict=True) if m]
    assert tokenizer.decode(generated) == "four<|im_end|>"
    # continue_final_message: the prompt ends inside the assistant's message
    partial = [messages[1], {"role": "assistant", "content": "The answer is"}]
    cont = post(
        url,
        key,
        "/tokenize",
        {"messages": partial, "add_generation_prompt": False, "continue_final_message": True},
    )
    assert tokenizer.decode(cont["tokens"]).endswith("<|im_start|>assistant\nThe answer is")
    # a template override with template arguments
    override = "{% for m in messages %}{{ m.content }}{{ sep }}{% endfor %}"
    custom = post(
        url,
        key,
        "/tokenize",
        {"messages": messages[1:3], "chat_template": override, "chat_template_kwargs": {"sep": "|"}},
    )
    assert tokenizer.decode(custom["tokens"]) == "what is <|im_end|> 2+2?|four|"
    # documents reach the template; tools render in the model's own template
    docs = "{% for d in documents %}[{{ d.title }}]{% endfor %}{% for m in messages %}{{ m.content }}{% endfor %}"
    with_docs = post(
        url, key, "/tokenize", {"messages": messages[1:2], "chat_template": docs, "documents": [{"title": "Doc A"}]}
    )
    assert tokenizer.decode(with_docs["tokens"]) == "[Doc A]what is <|im_end|> 2+2?"
    tool = {"type": "function", "function": {"name": "lookup", "parameters": {"type": "object", "properties": {}}}}
    with_tools = post(url, key, "/tokenize", {"messages": messages[1:2], "tools": [tool]})
    assert '"name": "lookup"' in tokenizer.decode(with_tools["tokens"])
    # errors: a clear code and the right status, in OpenAI's shape
    err = post(url, key, "/tokenize", {"model": MODEL}, status=400)["error"]
    assert err["code"] == "validation_error"
    err = post(url, key, "/detokenize", {"tokens": [10**8]}, status=400)["error"]
    assert err["code"] == "bad_request" and "vocabulary" in err["message"]
    err = post(url, key, "/tokenize", {"model": "nope", "prompt": "x"}, status=404)["error"]
    assert err["code"] == "model_not_found"
    both = {"messages": partial, "add_generation_prompt": True, "continue_final_message": True}
    assert post(url, key, "/tokenize", both, status=400)["error"]["code"] == "bad_request"
    raises = "{{ raise_exception('no such chat') }}"
    err = post(url, key, "/tokenize", {"messages": messages, "chat_template": raises}, status=400)["error"]
    assert err["code"] == "template_rejected" and "no such chat" in err["message"]


def test_text_and_token_completions(embedded_stack: str, user_key: Any, tokenizer: Any) -> None:
    url, key = embedded_stack, user_key("oa-completions")
    client = openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0)
    prompt = "Once upon a time"
    resp = client.completions.create(model=MODEL, prompt=prompt, max_tokens=6, logprobs=2, seed=3, temperature=0.8)
    [choice] = resp.choices
    info = extra(choice)["tokentrail"]
    record = stored(url, key, info["chat_id"], info["message_id"])
    assert extra(choice)["prompt_token_ids"] == record["prompt_token_ids"] == tokenizer.encode(prompt)
    assert extra(choice)["token_ids"] == record["completion_token_ids"]
    assert choice.text == record["content"] and info["prompt_method"] == "raw"
    lp = choice.logprobs
    assert lp is not None and lp.token_logprobs == pytest.approx(record["logprobs"], abs=1e-6)
    assert lp.tokens is not None and "".join(lp.tokens) == choice.text
    assert lp.text_offset is not None and lp.text_offset[0] == 0
    assert lp.top_logprobs is not None and all(0 < len(t) <= 2 for t in lp.top_logprobs)
    assert resp.usage is not None and resp.usage.prompt_tokens == len(record["prompt_token_ids"])
    assert resp.usage.completion_tokens == len(record["completion_token_ids"])
    # a default of 16 tokens, as OpenAI and vLLM
    default = client.completions.create(model=MODEL, prompt=prompt, extra_body={"ignore_eos": True})
    assert len(extra(default.choices[0])["token_ids"]) == 16 and default.choices[0].finish_reason == "length"
    # echo puts the prompt before the completion
    echoed = client.completions.create(model=MODEL, prompt=prompt, max_tokens=3, echo=True)
    assert echoed.choices[0].text.startswith(prompt)
    # token prompt, n=2, streamed: the deltas add up to what is stored
    ids = tokenizer.encode("The cat sat")
    stream = client.completions.create(model=MODEL, prompt=ids, max_tokens=5, n=2, stream=True, seed=7)
    texts: dict[int, str] = {0: "", 1: ""}
    tokens: dict[int, list[int]] = {0: [], 1: []}
    prompts: dict[int, list[int]] = {}
    infos: dict[int, dict[str, Any]] = {}
    for chunk in stream:
        for c in chunk.choices:
            texts[c.index] += c.text
            tokens[c.index] += extra(c).get("token_ids") or []
            if "prompt_token_ids" in extra(c):
                prompts[c.index] = extra(c)["prompt_token_ids"]
        if "tokentrail" in extra(chunk):
            infos[chunk.choices[0].index] = extra(chunk)["tokentrail"]
    assert set(infos) == {0, 1} and prompts == {0: ids, 1: ids}
    for i in (0, 1):
        record = stored(url, key, infos[i]["chat_id"], infos[i]["message_id"])
        assert tokens[i] == record["completion_token_ids"] and texts[i] == record["content"]
        assert record["prompt_token_ids"] == ids
    # a batch of prompts: choices indexed prompt x n
    batch = client.completions.create(model=MODEL, prompt=["a b", "c d"], max_tokens=2, n=2)
    assert [c.index for c in batch.choices] == [0, 1, 2, 3]
    expected = [tokenizer.encode("a b"), tokenizer.encode("c d")]
    assert [extra(c)["prompt_token_ids"] for c in batch.choices[1:3]] == expected
    with pytest.raises(openai.BadRequestError) as bad:
        client.completions.create(model=MODEL, prompt=prompt, echo=True, logprobs=1)
    assert bad.value.body["code"] == "unsupported_parameter"  # type: ignore[index]


def test_generate_tokens_in_tokens_out(embedded_stack: str, user_key: Any, tokenizer: Any) -> None:
    url, key = embedded_stack, user_key("oa-generate")
    ids = tokenizer.encode("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
    body = {"model": MODEL, "token_ids": ids, "sampling_params": {"max_tokens": 8, "temperature": 0, "logprobs": 1}}
    out = post(url, key, "/inference/v1/generate", body)
    [choice] = out["choices"]
    info = choice["tokentrail"]
    record = stored(url, key, info["chat_id"], info["message_id"])
    assert record["prompt_token_ids"] == ids and choice["token_ids"] == record["completion_token_ids"]
    entries = choice["logprobs"]["content"]
    assert [e["logprob"] for e in entries] == pytest.approx(record["logprobs"], abs=1e-6)
    # vLLM's shape (output_mode "tokens"): integer ids, and the "token_id:<id>" names its clients check
    assert out["output_mode"] == "tokens" and out["model"] == MODEL and out["prompt_token_ids"] is None
    assert [e["token_id"] for e in entries] == choice["token_ids"]
    assert [e["token"] for e in entries] == [f"token_id:{t}" for t in choice["token_ids"]]
    assert all(len(e["top_logprobs"]) == 1 and e["top_logprobs"][0]["rank"] == 1 for e in entries)
    assert all(e["rank"] == 1 for e in entries)  # greedy: the sampled token is the top one
    assert out["usage"]["prompt_tokens"] == len(ids) and out["usage"]["completion_tokens"] == len(choice["token_ids"])
    # greedy: the streamed tokens are the same; the prompt ids come in the first chunk when asked for
    events = sse_events(
        url,
        key,
        "/inference/v1/generate",
        {**body, "stream": True, "return_token_ids": True, "stream_options": {"include_usage": True}},
    )
    streamed = [t for e in events for c in e["choices"] for t in c["token_ids"]]
    assert streamed == choice["token_ids"]
    assert events[0]["prompt_token_ids"] == ids and all("prompt_token_ids" not in e for e in events[1:])
    assert events[-2]["choices"][0]["finish_reason"] == choice["finish_reason"]
    assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] == len(streamed)
    streamed_lps = [e for ev in events for c in ev["choices"] if c["logprobs"] for e in c["logprobs"]["content"]]
    assert [e["token"] for e in streamed_lps] == [f"token_id:{t}" for t in streamed]
    # output_mode "text": the text, and logprob entries with token strings, as the chat route has them
    text = post(url, key, "/inference/v1/generate", {**body, "output_mode": "text", "return_token_ids": True})
    [tchoice] = text["choices"]
    assert tchoice["token_ids"] == choice["token_ids"] and text["prompt_token_ids"] == ids
    tinfo = tchoice["tokentrail"]
    trecord = stored(url, key, tinfo["chat_id"], tinfo["message_id"])
    assert tchoice["text"] == trecord["content"]
    assert "".join(e["token"] for e in tchoice["logprobs"]["content"]).startswith(tchoice["text"])
    tevents = sse_events(url, key, "/inference/v1/generate", {**body, "output_mode": "text", "stream": True})
    assert "".join(c["text"] for e in tevents for c in e["choices"]) == tchoice["text"]
    err = post(url, key, "/inference/v1/generate", {**body, "priority": 5}, status=400)["error"]
    assert err["code"] == "unsupported_parameter" and err["param"] == "priority"
    # ignore_eos: exactly max_tokens; n siblings
    many = post(
        url,
        key,
        "/inference/v1/generate",
        {"token_ids": ids, "sampling_params": {"max_tokens": 6, "ignore_eos": True, "n": 2, "seed": 1}},
    )
    assert [len(c["token_ids"]) for c in many["choices"]] == [6, 6]
    assert all(c["finish_reason"] == "length" and c["logprobs"] is None for c in many["choices"])
    bad = {"token_ids": ids, "sampling_params": {"prompt_logprobs": 1}}
    err = post(url, key, "/inference/v1/generate", bad, status=400)["error"]
    assert err["code"] == "unsupported_parameter" and err["param"] == "sampling_params.prompt_logprobs"
    err = post(url, key, "/inference/v1/generate", {"token_ids": []}, status=400)["error"]
    assert err["param"] == "token_ids"


def test_raw_prompt_chats_export_and_verify(
    embedded_stack: str, embedded_settings: ServerSettings, user_key: Any, tiny_model_dir: Path, tmp_path: Path
) -> None:
    url, key = embedded_stack, user_key("oa-raw-export")
    client = openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0)
    done = client.completions.create(model=MODEL, prompt="export me", max_tokens=4)
    record_ids = extra(done.choices[0])
    out = tmp_path / "raw.jsonl"
    data = str(embedded_settings.data_dir)
    run_cli("export", "--out", str(out), "--data-dir", data, "--user", "oa-raw-export", "--quiet")
    [rollout] = [json.loads(line) for line in out.read_text().splitlines()]
    [sample] = rollout["samples"]
    assert sample["token_ids"] == record_ids["prompt_token_ids"] + record_ids["token_ids"]
    report = run_cli("verify", str(out), "--model", str(tiny_model_dir))
    assert "PASS" in report, report


# Validates answers with vLLM's own protocol models (vllm/entrypoints/scale_out/token_in_token_out), in
# the vLLM environment: a field vLLM's clients read that is missing or of another type fails here.
_VLLM_PROTOCOL_CHECK = """
import json, sys
from pydantic import TypeAdapter
from vllm.entrypoints.scale_out.token_in_token_out.protocol import GenerateResponse, GenerateStreamResponse
data = json.load(sys.stdin)
for body in data["responses"]:
    parsed = TypeAdapter(GenerateResponse).validate_python(body)
    assert parsed.output_mode == body["output_mode"], parsed.output_mode
    for choice, sent in zip(parsed.choices, body["choices"], strict=True):
        assert choice.token_ids == sent["token_ids"]
        if body["output_mode"] == "tokens" and sent["logprobs"]:
            assert [e.token_id for e in choice.logprobs.content] == sent["token_ids"]
for chunk in data["chunks"]:
    TypeAdapter(GenerateStreamResponse).validate_python(chunk)
print("ok", len(data["responses"]), len(data["chunks"]))
"""


def test_generate_answers_are_vllms_protocol(embedded_stack: str, user_key: Any, tokenizer: Any) -> None:
    from tests.test_engine_contract import _vllm_python

    python = _vllm_python()
    if not python.exists():
        pytest.skip(f"no vLLM environment at {python.parent.parent} (scripts/vllm_env.sh builds it)")
    url, key = embedded_stack, user_key("oa-generate-protocol")
    ids = tokenizer.encode("<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\n")
    body: dict[str, Any] = {"model": MODEL, "token_ids": ids, "sampling_params": {"max_tokens": 6, "logprobs": 2}}
    responses, chunks = [], []
    for mode in ("tokens", "text"):
        asked = {**body, "output_mode": mode, "return_token_ids": True}
        responses.append(post(url, key, "/inference/v1/generate", asked))
        chunks += sse_events(
            url, key, "/inference/v1/generate", {**asked, "stream": True, "stream_options": {"include_usage": True}}
        )
    data = json.dumps({"responses": responses, "chunks": chunks})
    proc = subprocess.run(
        [str(python), "-c", _VLLM_PROTOCOL_CHECK], input=data, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.startswith("ok 2 ")
