"""Third-party RL clients against a real server and worker, unmodified, each run by a driver under
tests/clients/ that talks HTTP only:

- verifiers 0.4.0's ``TrainClient`` (prime-rl's way: the prompt rendered client-side with
  ``renderers``' DefaultRenderer from the tokenizer's chat template, then ``POST
  /inference/v1/generate``) runs a multi-turn conversation (tests/clients/verifiers_train.py);
- verifiers 0.3.1's legacy clients run a real legacy ``MultiTurnEnv`` rollout
  (tests/clients/verifiers_legacy.py): the token client (``/tokenize`` + ``/v1/chat/completions/tokens``,
  plain ``/v1/chat/completions`` where it cannot stitch), the plain chat client, and ``RendererClient``
  (``renderers`` + ``/inference/v1/generate``);
- verifiers 0.4.0's v1 ``EvalClient`` runs the same script as an agent loop
  (tests/clients/verifiers_eval.py).

The scripted conversations hold assistant turns the client wrote itself: a tool call with content
null followed by its result and a user message, and a plain-text reply followed by a user message.
Every turn must be served, the ids and logprobs the client got must be the ones tokentrail stored,
the logprobs must match a float32 teacher-forced forward pass within 1e-4, and on the chat routes
every turn's stored prompt must extend the previous turn's prompt and completion (0 prefix breaks:
the written turns are stitched after the stored tokens, ``prompt_method`` ``stitch-written/...``).
They run on the trained tiny chatml model (a Qwen-style template: tool calls, earlier reasoning
dropped) and on a tiny model with Qwen3's real chat template (benchmarks/template_zoo).

The clients live in environments of their own (their pins are not the server's), built by
scripts/clients_env.sh: verifiers 0.4.0 at $TOKENTRAIL_CLIENTS_VENV or ~/.cache/tokentrail/clients-venv,
verifiers 0.3.1 at $TOKENTRAIL_CLIENTS_VENV_031 or ~/.cache/tokentrail/clients-venv-031. A test is
skipped when its environment does not exist (CI builds them: there they fail instead).
"""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from server.admin import issue_user_key
from server.settings import ServerSettings
from tests.stack import MODEL, serving

ROOT = Path(__file__).resolve().parents[1]
DRIVER = ROOT / "tests" / "clients" / "verifiers_train.py"
LEGACY_DRIVER = ROOT / "tests" / "clients" / "verifiers_legacy.py"
EVAL_DRIVER = ROOT / "tests" / "clients" / "verifiers_eval.py"
TURNS = 4
# The driver's conversation (tests/clients/verifiers_train.py): its system prompt and user turns.
SYSTEM = "You are a terse assistant."
USERS = [
    "Hello there. Tell me about the sea.",
    "And what about rivers?",
    "Say something about mountains.",
    "Last one: the sky?",
]


def _venv_python(variable: str, default: str) -> Path:
    venv = os.environ.get(variable) or str(Path.home() / ".cache" / "tokentrail" / default)
    python = Path(venv) / "bin" / "python"
    if not python.exists():
        message = f"no clients environment at {venv}: build it with scripts/clients_env.sh"
        if os.environ.get("CI"):  # CI builds it (.ci/run): the tests must really run there
            pytest.fail(message)
        pytest.skip(message)
    return python


@pytest.fixture(scope="session")
def clients_python() -> Path:
    """The clients environment's python (verifiers 0.4.0); requested first, so a test without it skips
    before any server starts."""
    return _venv_python("TOKENTRAIL_CLIENTS_VENV", "clients-venv")


@pytest.fixture(scope="session")
def clients_python_031() -> Path:
    """The verifiers 0.3.1 clients environment's python (the legacy clients)."""
    return _venv_python("TOKENTRAIL_CLIENTS_VENV_031", "clients-venv-031")


def _drive(python: Path, url: str, key: str, model_dir: Path, max_tokens: int) -> list[dict[str, Any]]:
    """Runs the driver; its JSON line per turn. The client's failure (a MalformedGenerateResponseError
    on a shape it rejects, an HTTP error) fails the test with the driver's output."""
    env = {
        **{k: v for k, v in os.environ.items() if k != "PYTHONPATH"},  # nothing of tokentrail's
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_VERBOSITY": "error",
    }
    proc = subprocess.run(
        [str(python), str(DRIVER), "--base-url", url, "--api-key", key, "--model", MODEL,
         "--tokenizer-dir", str(model_dir), "--turns", str(TURNS), "--max-tokens", str(max_tokens)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    assert proc.returncode == 0, f"the client failed:\n{proc.stdout[-6000:]}\n{proc.stderr[-6000:]}"
    turns = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert [t.get("turn") for t in turns] == list(range(TURNS)), proc.stdout[-6000:]
    for t in turns:
        print(
            f"turn {t['turn']}: {len(t['prompt_ids'])} prompt + {len(t['completion_ids'])} completion tokens,",
            f"finish {t['finish_reason']}; wire {t['wire_keys']}, choice {t['wire_choice_keys']}",
        )
    return turns


def _stored(url: str, key: str, chat_id: str, message_id: str) -> dict[str, Any]:
    resp = httpx.get(
        f"{url}/chats/{chat_id}/messages/{message_id}",
        params={"include": "tokens"},
        headers={"Authorization": f"Bearer {key}"},
        timeout=30,
    )
    assert resp.status_code == 200, resp.text
    return dict(resp.json())


def _check_turns(url: str, key: str, model_dir: Path, turns: list[dict[str, Any]]) -> None:
    """Each turn: the client sent the chat template's render of the conversation so far, and the prompt,
    completion ids, logprobs and finish reason it got are what tokentrail stored for that request."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    messages: list[dict[str, str]] = [{"role": "system", "content": SYSTEM}]
    chats = set()
    for i, turn in enumerate(turns):
        if i:  # the driver echoes the previous reply's parsed content, as an agent loop does
            messages.append({"role": "assistant", "content": turns[i - 1]["content"] or ""})
        messages.append({"role": "user", "content": USERS[i]})
        rendered = list(
            tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
        )
        assert turn["sent_token_ids"] == rendered, f"turn {i}: the client did not send the template's render"
        assert turn["prompt_ids"] == rendered, f"turn {i}"
        info = turn["tokentrail"]
        assert info and info["chat_id"] and info["message_id"], turn
        stored = _stored(url, key, info["chat_id"], info["message_id"])
        assert stored["prompt_token_ids"] == rendered, f"turn {i}"
        assert turn["completion_ids"] and turn["completion_ids"] == stored["completion_token_ids"], f"turn {i}"
        assert turn["completion_logprobs"] == pytest.approx(stored["logprobs"], abs=1e-6), f"turn {i}"
        assert turn["finish_reason"] == stored["finish_reason"], f"turn {i}"
        assert turn["response_id"] and turn["response_id"] == turn["wire_request_id"]
        assert turn["usage"]["prompt_tokens"] == len(rendered)
        assert turn["usage"]["completion_tokens"] == len(turn["completion_ids"])
        chats.add(info["chat_id"])
    assert len(chats) == TURNS  # raw prompts: each request is a chat of its own


@pytest.fixture(scope="module")
def user_key(embedded_settings: ServerSettings) -> Callable[[str], str]:
    return lambda user: issue_user_key(embedded_settings, user)


@pytest.mark.timeout(300)
def test_verifiers_train_client_multi_turn(
    clients_python: Path, embedded_stack: str, user_key: Any, tiny_model_dir: Path
) -> None:
    """The tiny model with random weights: each turn runs to max_tokens (finish ``length``)."""
    url, key = embedded_stack, user_key("verifiers-train")
    turns = _drive(clients_python, url, key, tiny_model_dir, max_tokens=12)
    assert all(t["finish_reason"] == "length" and len(t["completion_ids"]) == 12 for t in turns)
    _check_turns(url, key, tiny_model_dir, turns)


@pytest.mark.timeout(300)
def test_verifiers_train_client_stops_on_the_renderers_stop_ids(
    clients_python: Path, trained_model: Callable[[str], Path], tmp_path: Path
) -> None:
    """The trained tiny chatml model ends its turns with <|im_end|>, the renderer's stop id (sent as
    ``stop_token_ids``): finish ``stop`` with the stop token in the completion ids, as vLLM returns
    them and as tokentrail stores them."""
    model_dir = trained_model("chatml")
    with serving(tmp_path, MODEL, str(model_dir)) as url:
        port = int(url.rsplit(":", 1)[1])
        key = issue_user_key(ServerSettings(data_dir=tmp_path, port=port), "verifiers-train-stop")
        turns = _drive(clients_python, url, key, model_dir, max_tokens=96)
        stops = [t for t in turns if t["finish_reason"] == "stop"]
        assert stops, [t["finish_reason"] for t in turns]
        _check_turns(url, key, model_dir, turns)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    assert tokenizer.eos_token == "<|im_end|>"  # DefaultRenderer's stop ids: [eos_token_id]
    assert all(t["completion_ids"][-1] == tokenizer.eos_token_id for t in stops)
    assert all(t["sent_sampling_params"]["stop_token_ids"] == [tokenizer.eos_token_id] for t in turns)


# ---- agent rollouts with client-written assistant turns: verifiers 0.3.1's legacy clients, 0.4.0's eval client ----

AGENT_TURNS = 6
# What the drivers' script writes before each model turn (tests/clients/verifiers_legacy.py, verifiers_eval.py).
AGENT_KINDS = ["user", "user", "written-tool-call", "user", "written-text", "user"]
AGENT_SEED = 11
AGENT_MAX_TOKENS = 48
WRITTEN_TOOL_CALL_ID = "call_env_1"
WRITTEN_TEXT = "Let me add something myself: rivers run to the sea."
TEACHER_FORCED_TOLERANCE = 1e-4  # teacher-forced logprobs (issue 24): float32 forward pass on CPU


@dataclass(frozen=True)
class AgentStack:
    template: str
    url: str
    data_dir: Path
    model_dir: Path
    renderer: str  # the renderers config RendererClient uses for this template (the driver's --renderer)
    template_kwargs: dict[str, Any] | None  # sent as chat_template_kwargs (prime-rl: in extra_body)

    def key(self, user: str) -> str:
        port = int(self.url.rsplit(":", 1)[1])
        return issue_user_key(ServerSettings(data_dir=self.data_dir, port=port), f"{user}-{self.template}")


def _agent_model(template: str, trained_model: Callable[[str], Path]) -> tuple[Path, str, dict[str, Any] | None]:
    """chatml: the trained tiny chatml model (Qwen-style template that drops earlier turns' reasoning;
    renderers' DefaultRenderer with its qwen3 tool parser). qwen3: a tiny model with Qwen3's real chat
    template and tokens, trained 100 steps so that it ends its turns (cached; the exactness benchmark
    builds the same one), renderers' Qwen3Renderer (thinking_retention "all": it bridges user turns from
    the sampled ids), and ``enable_thinking: false``: each generation prompt ends with the empty think
    block the template writes, which its render of the same turn in history drops (the reasoning-
    stripping case: a full re-render never extends the stored turn)."""
    if template == "chatml":
        return trained_model("chatml"), "default", None
    from benchmarks.template_zoo import family, zoo_model

    return Path(zoo_model(family("qwen3"), train_steps=100)), "qwen3", {"enable_thinking": False}


@pytest.fixture(scope="module", params=["chatml", "qwen3"])
def agent_stack(
    request: pytest.FixtureRequest, trained_model: Callable[[str], Path], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[AgentStack]:
    model_dir, renderer, kwargs = _agent_model(request.param, trained_model)
    data_dir = tmp_path_factory.mktemp(f"agent-{request.param}")
    with serving(data_dir, MODEL, str(model_dir)) as url:
        yield AgentStack(request.param, url, data_dir, model_dir, renderer, kwargs)


def _run_driver(python: Path, driver: Path, stack: AgentStack, key: str, *extra: str) -> list[dict[str, Any]]:
    """Runs a driver; its JSON line per model turn. The client's failure (an error it raised on a shape
    it rejects, an HTTP error, a rollout error) fails the test with the driver's output."""
    env = {
        **{k: v for k, v in os.environ.items() if k != "PYTHONPATH"},  # nothing of tokentrail's
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_VERBOSITY": "error",
    }
    proc = subprocess.run(
        [str(python), str(driver), *extra, "--base-url", stack.url, "--api-key", key, "--model", MODEL,
         "--tokenizer-dir", str(stack.model_dir), "--turns", str(AGENT_TURNS),
         "--max-tokens", str(AGENT_MAX_TOKENS), "--seed", str(AGENT_SEED),
         *(["--chat-template-kwargs", json.dumps(stack.template_kwargs)] if stack.template_kwargs else [])],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    assert proc.returncode == 0, f"the client failed:\n{proc.stdout[-6000:]}\n{proc.stderr[-6000:]}"
    turns = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert [t.get("turn") for t in turns] == list(range(AGENT_TURNS)), proc.stdout[-6000:]
    assert [t["kind"] for t in turns] == AGENT_KINDS
    return turns


def _finish_reasons(stored: dict[str, Any]) -> set[str]:
    """The finish reasons a client may report for a stored turn: OpenAI's ``tool_calls`` for a turn that
    stopped after a tool call (tokentrail's chat routes say so; renderers' client promotes ``stop``)."""
    reasons = {stored["finish_reason"]}
    if stored["finish_reason"] == "stop":
        reasons.add("tool_calls")
    return reasons


def _check_served(turn: dict[str, Any], stored: dict[str, Any]) -> None:
    """Served, and the client got exactly what tokentrail stored: prompt ids, completion ids, logprobs."""
    i = turn["turn"]
    assert turn["wire_status"] == 200, turn
    assert stored["state"] == "complete" and stored["role"] == "assistant", f"turn {i}: {stored}"
    assert turn["prompt_ids"] == stored["prompt_token_ids"], f"turn {i}: returned prompt ids != stored"
    assert turn["completion_ids"] and turn["completion_ids"] == stored["completion_token_ids"], f"turn {i}"
    assert turn["completion_logprobs"] == pytest.approx(stored["logprobs"], abs=1e-6), f"turn {i}"
    assert turn["finish_reason"] in _finish_reasons(stored), f"turn {i}: {turn['finish_reason']} vs {stored}"


def _teacher_forced(model_dir: Path, spans: list[tuple[list[int], dict[str, Any]]]) -> float:
    """Re-scores stored turns with the model (``benchmarks.exactness.scorer``: one float32 forward pass
    on CPU per distinct sequence, each turn's positions processed under its stored sampling parameters);
    returns the largest |stored - re-scored| logprob. ``spans``: (sequence, stored message) with the
    message's prompt and completion at the sequence's start (a later turn's prompt holds the earlier
    turns, so one pass over the last turn re-scores a whole rollout)."""
    from benchmarks.exactness.scorer import Scorer

    scorer = Scorer(str(model_dir))
    logits: dict[tuple[int, ...], Any] = {}
    worst = 0.0
    for seq, stored in spans:
        prompt, completion = stored["prompt_token_ids"], stored["completion_token_ids"]
        assert seq[: len(prompt) + len(completion)] == prompt + completion
        if tuple(seq) not in logits:
            logits[tuple(seq)] = scorer.logits(seq)
        sampling = stored["work_parameters"]["sampling_parameters"]
        fresh = scorer.rescored(logits[tuple(seq)], seq, len(prompt), len(completion), sampling)
        worst = max([worst, *(abs(a - b) for a, b in zip(stored["logprobs"], fresh, strict=True))])
    return worst


def _naive_breaks(stack: AgentStack, turns: list[dict[str, Any]], stored: list[dict[str, Any]]) -> list[int]:
    """The turns whose prompt, rendered whole from the messages the client sent (the tokenizer's chat
    template, as a server without stored tokens would; content null as "", as vLLM passes it), would
    not extend the previous stored turn."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(stack.model_dir))
    breaks = []
    for i in range(1, len(turns)):
        messages = [{**m, "content": m.get("content") or ""} for m in turns[i]["sent_messages"]]
        rendered = tokenizer.apply_chat_template(
            messages,
            tools=turns[i]["sent_tools"],
            add_generation_prompt=True,
            tokenize=True,
            return_dict=False,
            **(stack.template_kwargs or {}),
        )
        before = stored[i - 1]["prompt_token_ids"] + stored[i - 1]["completion_token_ids"]
        if list(rendered[: len(before)]) != before:
            breaks.append(i)
    return breaks


def _check_chat_rollout(stack: AgentStack, key: str, turns: list[dict[str, Any]], client: str) -> dict[str, Any]:
    """A rollout on the chat routes (``/v1/chat/completions``, its ``/tokens`` form): every turn served,
    stored = returned, all turns in one chat, each extending the one before (0 prefix breaks: the
    client-written turns stitched after the stored tokens, ``stitch-written/...``, no fork), the written
    turns stored as manual assistant messages, teacher-forced logprobs within 1e-4."""
    stored = []
    for turn in turns:
        i, info = turn["turn"], turn["tokentrail"]
        assert info and info["chat_id"] and info["message_id"], turn
        record = _stored(stack.url, key, info["chat_id"], info["message_id"])
        _check_served(turn, record)
        if turn.get("wire_prompt_token_ids") is not None:
            assert turn["wire_prompt_token_ids"] == record["prompt_token_ids"], f"turn {i}"
        assert not info["forked"] and not record["fork"], f"turn {i} forked: {record['prompt_method']}"
        assert info["prompt_method"] == record["prompt_method"], f"turn {i}"
        method = record["prompt_method"].split("/")[0]
        if i == 0:
            assert method == "full", record["prompt_method"]
        elif turn["kind"].startswith("written"):
            assert method == "stitch-written", f"turn {i} ({turn['kind']}): {record['prompt_method']}"
        else:
            assert method == "stitch", f"turn {i}: {record['prompt_method']}"
        if turn["route"] == "tokens":  # the client's own stitch, checked against tokentrail's
            assert info["prompt_check"] == "match", f"turn {i}: {info}"
            assert turn["sent_prompt_ids"] == record["prompt_token_ids"], f"turn {i}"
        stored.append(record)
    chats = {t["tokentrail"]["chat_id"] for t in turns}
    assert len(chats) == 1, f"the rollout landed in {len(chats)} chats"
    breaks = []
    for i in range(1, len(stored)):
        before = stored[i - 1]["prompt_token_ids"] + stored[i - 1]["completion_token_ids"]
        assert stored[i]["prior_message_id"] == stored[i - 1]["id"], f"turn {i}"
        if stored[i]["prompt_token_ids"][: len(before)] != before:
            breaks.append(i)
    assert not breaks, f"prefix breaks at turns {breaks} ({[turns[i]['kind'] for i in breaks]})"
    # the written turns are in the chat as the client wrote them: manual assistant messages, no tokens
    chat_id = turns[0]["tokentrail"]["chat_id"]
    tree = httpx.get(f"{stack.url}/chats/{chat_id}", headers={"Authorization": f"Bearer {key}"}, timeout=30)
    assert tree.status_code == 200, tree.text
    manual = [m for m in tree.json()["messages"] if m["role"] == "assistant" and m["state"] == "manual"]
    assert len(manual) == 2, manual
    calls = [c for m in manual for c in m.get("tool_calls") or []]
    assert [c["id"] for c in calls] == [WRITTEN_TOOL_CALL_ID]
    assert not any(m["content"] for m in manual if m.get("tool_calls"))  # the tool call's content: null
    assert [m["content"] for m in manual if not m.get("tool_calls")] == [WRITTEN_TEXT]
    last = stored[-1]["prompt_token_ids"] + stored[-1]["completion_token_ids"]
    worst = _teacher_forced(stack.model_dir, [(last, record) for record in stored])
    assert worst <= TEACHER_FORCED_TOLERANCE, f"teacher-forced logprobs differ by up to {worst:.3g}"
    naive = _naive_breaks(stack, turns, stored)
    if stack.template_kwargs == {"enable_thinking": False}:  # the template drops every stored think block
        assert naive == list(range(1, len(turns))), naive
    summary = {
        "client": client,
        "template": stack.template,
        "routes": [t["route"] for t in turns],
        "methods": [r["prompt_method"] for r in stored],
        "finish": [t["finish_reason"] for t in turns],
        "reasoning_turns": [t["turn"] for t in turns if t["reasoning_content"]],
        "tool_call_turns": [t["turn"] for t in turns if t["tool_calls"]],
        "prefix_breaks": len(breaks),
        "full_render_breaks": naive,  # what re-rendering the sent messages would have broken
        "max_teacher_forced_delta": worst,
    }
    print(json.dumps(summary))
    return summary


@pytest.mark.timeout(900)  # the first run builds and trains the Qwen3 template's tiny model (cached after)
@pytest.mark.parametrize("client", ["token", "plain"])
def test_verifiers_legacy_chat_clients_keep_the_stored_prefix(
    clients_python_031: Path, agent_stack: AgentStack, client: str
) -> None:
    """verifiers 0.3.1's token and plain clients in a legacy ``MultiTurnEnv`` rollout of 6 model turns
    with 2 client-written assistant turns. The token client stitches where it can (``/tokenize`` +
    ``/v1/chat/completions/tokens``: tokentrail's ``prompt_check`` must say ``match``) and falls back to
    plain ``/v1/chat/completions`` for the written turns, where tokentrail keeps the stored prefix."""
    key = agent_stack.key(f"verifiers-legacy-{client}")
    turns = _run_driver(clients_python_031, LEGACY_DRIVER, agent_stack, key, "--client", client)
    summary = _check_chat_rollout(agent_stack, key, turns, client)
    written = [t for t in turns if t["kind"].startswith("written")]
    assert all(t["route"] == "plain" for t in written)  # verifiers' own stitch cannot bridge them
    if client == "token" and agent_stack.template == "qwen3":
        # verifiers' bridge needs a template that renders its dummy assistant turn the same with and
        # without a user turn after it; Qwen3's does (the tiny chatml template, which adds an empty think
        # block to a last assistant turn, does not: there every turn falls back to plain)
        assert "tokens" in summary["routes"], summary


@pytest.mark.timeout(900)
def test_verifiers_eval_client_keeps_the_stored_prefix(clients_python: Path, agent_stack: AgentStack) -> None:
    """verifiers 0.4.0's v1 ``EvalClient`` (``ChatDialect``, prime-rl's sampling arguments) runs the same
    script as an agent loop that echoes each reply (content, tool calls, reasoning) back."""
    key = agent_stack.key("verifiers-eval")
    turns = _run_driver(clients_python, EVAL_DRIVER, agent_stack, key)
    _check_chat_rollout(agent_stack, key, turns, "eval")
    assert all(t["usage"]["prompt_tokens"] == len(t["prompt_ids"]) for t in turns)


@pytest.mark.timeout(900)
def test_verifiers_renderer_client_generate(clients_python_031: Path, agent_stack: AgentStack) -> None:
    """verifiers 0.3.1's ``RendererClient`` (renderers 0.1.10, ``POST /inference/v1/generate``) through
    the same rollout: every turn served in vLLM's shape (renderers' checks pass), the ids and logprobs it
    got are the ones stored, teacher-forced within 1e-4.

    On this tokens-in route the client owns the prompt: each request is a chat of its own, and where
    the renderer bridged from the previous turn's ids (vLLM's ``routed_experts_prompt_start`` sent) the
    prompt extends that turn. For the client-written turns RendererClient does not bridge (its tail
    check admits only tool and user messages) and re-renders the conversation from text; such a prompt
    may drop what the template rewrites (earlier reasoning), which tokentrail cannot change here: those
    breaks are counted and printed, not failed."""
    key = agent_stack.key("verifiers-renderer")
    turns = _run_driver(
        clients_python_031, LEGACY_DRIVER, agent_stack, key, "--client", "renderer", "--renderer", agent_stack.renderer
    )
    records, breaks, bridged = [], [], []
    for turn in turns:
        i, info = turn["turn"], turn["tokentrail"]
        assert turn["route"] == "generate" and info and info["chat_id"], turn
        record = _stored(agent_stack.url, key, info["chat_id"], info["message_id"])
        _check_served(turn, record)
        assert turn["sent_prompt_ids"] == record["prompt_token_ids"], f"turn {i}: the prompt sent is not stored"
        assert record["prompt_method"] == "raw", record["prompt_method"]
        records.append(record)
        if i:
            before = records[i - 1]["prompt_token_ids"] + records[i - 1]["completion_token_ids"]
            extends = record["prompt_token_ids"][: len(before)] == before
            if "routed_experts_prompt_start" in turn["sent_sampling"]["sampling_params"]:
                bridged.append(i)
                assert extends, f"turn {i}: the renderer's bridge does not extend the previous turn"
            elif not extends:
                breaks.append(i)
    assert len({t["tokentrail"]["chat_id"] for t in turns}) == AGENT_TURNS  # raw prompts: a chat each
    assert not bridged or not set(bridged) & {i for i, k in enumerate(AGENT_KINDS) if k.startswith("written")}
    if agent_stack.renderer == "qwen3":
        assert bridged, "Qwen3Renderer bridged no turn"
    spans = [(r["prompt_token_ids"] + r["completion_token_ids"], r) for r in records]
    worst = _teacher_forced(agent_stack.model_dir, spans)
    assert worst <= TEACHER_FORCED_TOLERANCE, f"teacher-forced logprobs differ by up to {worst:.3g}"
    print(
        json.dumps(
            {
                "client": "renderer",
                "template": agent_stack.template,
                "bridged": bridged,
                "client_rerender_breaks": breaks,
                "break_kinds": [turns[i]["kind"] for i in breaks],
                "finish": [t["finish_reason"] for t in turns],
                "max_teacher_forced_delta": worst,
            }
        )
    )
