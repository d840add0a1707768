"""Tokenizer calls the server forwards to a worker (``rpc`` frames): the server never loads a model.

- ``tokenize``: a text prompt to token ids (vLLM ``/tokenize`` with ``prompt``);
- ``render_chat``: chat messages rendered by the model's template (or a given one) and tokenized the
  way the worker renders prompts, forge-proof: message text never becomes control tokens. Optionally
  a mask of the tokens the model generated in assistant turns (vLLM ``/tokenize`` with ``messages``);
- ``detokenize``: token ids to text (vLLM ``/detokenize``).

Errors are ``RpcError`` with a machine-readable code; the client turns them into ``rpc_result`` frames.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from shared.chain import MessageFormatError, text_content
from shared.errors import ErrorCode
from shared.protocol import WorkMessage
from worker.chat_format import SENTINEL, ChatFormat, Rendered, RenderError, TemplateRejected

_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant", "tool": "tool"}
_REASONING_FIELDS = ("reasoning_content", "reasoning", "reasoning_text", "thinking")


class RpcError(Exception):
    def __init__(self, code: ErrorCode, message: str) -> None:
        super().__init__(message)
        self.code = code


def handle_rpc(fmt: ChatFormat, method: str, params: dict[str, Any]) -> dict[str, Any]:
    try:
        if method == "tokenize":
            return tokenize(fmt, params)
        if method == "render_chat":
            return render_chat(fmt, params)
        if method == "detokenize":
            return detokenize(fmt, params)
    except TemplateRejected as exc:
        raise RpcError(ErrorCode.template_rejected, f"the chat template refused the conversation: {exc}") from exc
    except RenderError as exc:
        raise RpcError(ErrorCode.bad_request, str(exc)) from exc
    except MessageFormatError as exc:
        raise RpcError(ErrorCode.invalid_messages, f"{exc.param}: {exc}" if exc.param else str(exc)) from exc
    raise RpcError(ErrorCode.bad_request, f"unknown method {method!r}")


def vocab_size(fmt: ChatFormat) -> int:
    return len(fmt.tokenizer)


def _strs(fmt: ChatFormat, ids: list[int]) -> list[str]:
    return [str(t) for t in fmt.tokenizer.convert_ids_to_tokens(ids)]


def _result(fmt: ChatFormat, ids: list[int], params: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {"tokens": ids}
    if params.get("return_token_strs"):
        out["token_strs"] = _strs(fmt, ids)
    return out


def tokenize(fmt: ChatFormat, params: dict[str, Any]) -> dict[str, Any]:
    prompt = params.get("prompt")
    if not isinstance(prompt, str):
        raise RpcError(ErrorCode.bad_request, "prompt must be a string")
    add_special = params.get("add_special_tokens")
    ids: list[int] = fmt.tokenizer.encode(prompt, add_special_tokens=True if add_special is None else add_special)
    return _result(fmt, ids, params)


def detokenize(fmt: ChatFormat, params: dict[str, Any]) -> dict[str, Any]:
    ids = params.get("tokens")
    if not isinstance(ids, list) or not all(isinstance(i, int) for i in ids):
        raise RpcError(ErrorCode.bad_request, "tokens must be a list of integers")
    size = vocab_size(fmt)
    bad = next((k for k, i in enumerate(ids) if not 0 <= i < size), None)
    if bad is not None:
        raise RpcError(ErrorCode.bad_request, f"tokens[{bad}] = {ids[bad]} is outside the vocabulary (0..{size - 1})")
    return {"prompt": fmt.tokenizer.decode(ids)}


# ---- chat ---------------------------------------------------------------------------------------
def work_messages(raw: Any) -> list[WorkMessage]:
    """OpenAI-shaped messages as the worker renders them."""
    if not isinstance(raw, list) or not raw:
        raise RpcError(ErrorCode.invalid_messages, "messages must be a non-empty list")
    out = []
    for i, m in enumerate(raw):
        param = f"messages[{i}]"
        if not isinstance(m, dict):
            raise RpcError(ErrorCode.invalid_messages, f"{param} must be an object")
        role = _ROLES.get(str(m.get("role")))
        if role is None:
            raise RpcError(ErrorCode.invalid_messages, f"{param}.role: unsupported role {m.get('role')!r}")
        content = text_content(m.get("content"), f"{param}.content")
        reasoning = next((m[k] for k in _REASONING_FIELDS if isinstance(m.get(k), str)), None)
        calls = m.get("tool_calls") or None
        if calls is not None and not (isinstance(calls, list) and all(isinstance(c, dict) for c in calls)):
            raise RpcError(ErrorCode.invalid_messages, f"{param}.tool_calls must be a list of objects")
        call_id = m.get("tool_call_id")
        out.append(
            WorkMessage(
                id=str(i),
                role=role,
                content=content,
                tool_calls=calls if role == "assistant" else None,
                reasoning_content=reasoning if role == "assistant" else None,
                tool_call_id=str(call_id) if role == "tool" and call_id is not None else None,
            )
        )
    return out


def _format(fmt: ChatFormat, params: dict[str, Any]) -> ChatFormat:
    """``fmt`` with this request's template override, template arguments and documents."""
    template = params.get("chat_template")
    kwargs = params.get("chat_template_kwargs")
    documents = params.get("documents")
    if template is None and not kwargs and documents is None:
        return fmt
    if template is not None and not isinstance(template, str):
        raise RpcError(ErrorCode.bad_request, "chat_template must be a string")
    if isinstance(fmt.template, dict) and isinstance(template, str) and template in fmt.template:
        template = fmt.template[template]  # a named template of the model ("tool_use")
    merged = {**fmt.template_kwargs, **(kwargs or {})}
    if documents is not None:
        merged["documents"] = documents
    return dataclasses.replace(fmt, template=template or fmt.template, template_kwargs=merged)


def _render(
    fmt: ChatFormat, messages: list[WorkMessage], tools: list[dict[str, Any]] | None, *, gen: bool, cont: bool
) -> list[int]:
    rendered = fmt.render_parts(list(messages), add_generation_prompt=gen, tools=tools)
    if cont:
        rendered = _cut_after_final(rendered, messages)
    return fmt.encode(rendered)


def _cut_after_final(rendered: Rendered, messages: list[WorkMessage]) -> Rendered:
    """The render up to the end of the final message's text (``continue_final_message``): the model
    continues that message instead of starting a new one."""
    final = messages[-1]
    if not final.content:
        raise RpcError(ErrorCode.bad_request, "continue_final_message needs a final message with content")
    if rendered.method == "masked":
        # render_parts masks non-empty contents and reasonings in message order, content first
        k = sum(bool(m.content) + bool(m.reasoning_content) for m in messages[:-1])
        marker = SENTINEL.format(k)
        at = rendered.text.find(marker)
        if at >= 0:
            return Rendered(rendered.text[: at + len(marker)], rendered.texts, rendered.escapes, rendered.method)
    else:
        at = rendered.text.rfind(final.content.strip())
        if at >= 0:
            end = at + len(final.content.strip())
            return Rendered(rendered.text[:end], rendered.texts, rendered.escapes, rendered.method)
    raise RpcError(ErrorCode.bad_request, "the chat template does not render the final message's text verbatim")


def render_chat(fmt: ChatFormat, params: dict[str, Any]) -> dict[str, Any]:
    messages = work_messages(params.get("messages"))
    tools = params.get("tools") or None
    gen = bool(params.get("add_generation_prompt", True))
    cont = bool(params.get("continue_final_message", False))
    if cont and gen:
        raise RpcError(ErrorCode.bad_request, "continue_final_message and add_generation_prompt cannot both be true")
    if cont and messages[-1].role != "assistant":
        raise RpcError(ErrorCode.bad_request, "continue_final_message needs a final assistant message")
    f = _format(fmt, params)
    ids = _render(f, messages, tools, gen=gen, cont=cont)
    offset = 0
    if params.get("add_special_tokens"):
        wrapped = list(f.tokenizer.build_inputs_with_special_tokens(ids))
        offset = next((k for k in range(len(wrapped) - len(ids) + 1) if wrapped[k : k + len(ids)] == ids), 0)
        ids = wrapped
    out = _result(f, ids, params)
    if params.get("return_assistant_mask"):
        mask, note = assistant_mask(f, messages, tools, ids[offset:], cont=cont)
        if mask is not None:
            mask = [0] * offset + mask + [0] * (len(ids) - offset - len(mask))
        out["assistant_mask"] = mask
        if note is not None:
            out["assistant_mask_note"] = note
    return out


def assistant_mask(
    fmt: ChatFormat, messages: list[WorkMessage], tools: list[dict[str, Any]] | None, full: list[int], *, cont: bool
) -> tuple[list[int] | None, str | None]:
    """1 for each token of an assistant turn that the model generates (its text, reasoning, tool-call
    markup and end-of-turn token), 0 for the rest; and a note where the mask is not exact.

    A turn starts where rendering it departs from the conversation before it with the generation
    prompt, and ends with its end-of-turn token. Where the template writes a history turn with
    another opening than its generation prompt (DeepSeek's ``<think></think>``, gpt-oss's channel),
    the turn starts where the two renders part, and the note names it. Where the template renders
    the turn itself differently once later messages follow (Qwen3 drops earlier reasoning), the
    tokens the model generated are not in this render: the mask is None rather than wrong."""
    mask = [0] * len(full)
    stops = set(fmt.stop_token_ids)
    last = len(messages) - 1
    parted: list[int] = []
    for i, m in enumerate(messages):
        if m.role != "assistant":
            continue
        try:
            before = _render(fmt, messages[:i], tools, gen=True, cont=False) if i else []
            upto = full if (i == last and cont) else _render(fmt, messages[: i + 1], tools, gen=False, cont=False)
        except RenderError as exc:
            return None, f"messages[{i}]: the turn cannot be rendered on its own: {exc}"
        start = next((k for k, (a, b) in enumerate(zip(before, upto, strict=False)) if a != b), len(before))
        start = min(start, len(upto))
        if start < len(before):
            parted.append(i)
        end = next((k + 1 for k in range(start, len(upto)) if upto[k] in stops), len(upto))
        # What follows the turn's end-of-turn token (a newline, a template that always appends the
        # next header) is template text: only the turn itself must render the same in the whole.
        if full[:end] != upto[:end]:
            return None, (
                f"messages[{i}]: the chat template renders this assistant turn differently once later "
                "messages follow, so the tokens the model generated in it are not in this render"
            )
        for k in range(start, end):
            mask[k] = 1
    note = None
    if parted:
        turns = ", ".join(f"messages[{i}]" for i in parted)
        note = (
            f"{turns}: the template opens history turns differently from its generation prompt; "
            "those turns start where the two renders part"
        )
    return mask, note
