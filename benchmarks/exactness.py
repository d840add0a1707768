"""Token exactness of stored conversations: stitched prompts vs. naive re-templating, end to end.

    python benchmarks/exactness.py [--conversations 20] [--turns 4] [--template chatml|llama3|FAMILY|FILE.jinja]
                                   [--seed 0] [--concurrency 8] [--engine hf|vllm] [--closer-policy keep|history]
                                   [--json]
    python benchmarks/exactness.py --folder all|llama.cpp|vllm|DIR [--only a,b] [--train-steps 100] [--json]

``--folder`` runs the stitch arm on every template of a folder, one row each (``benchmarks/exactness_zoo``);
``--template FAMILY`` one real template of ``benchmarks/template_zoo.FAMILIES`` (e.g. ``gpt-oss``) with its
model's tokens, on a tiny model trained ``--train-steps`` steps (cached).

Starts one server (embedded SQLite, in-process queue) and two workers on the same tiny model as child
processes: one with ``--prompt-mode stitch`` served as ``stitch``, one with ``--prompt-mode naive`` (the
baseline: re-render and re-tokenize the whole text history every turn, as other systems do) served as
``naive``. Both arms run the same seeded conversation scripts over real HTTP + SSE, ``--concurrency``
conversations at a time per arm. ``--engine vllm`` runs both workers with ``--engine vllm --max-model-len
2048 --gpu-memory-utilization 0.2`` under the python of the vLLM environment (``$TOKENTRAIL_VLLM_VENV``,
default ``~/.cache/tokentrail/vllm-venv``, built by ``scripts/vllm_env.sh``) with
``VLLM_CPU_KVCACHE_SPACE=1``, and waits up to 10 minutes for them to start; TFLA re-scoring still runs
here with transformers on the same weights. ``--template FILE`` builds a tiny model trained on that Jinja template
into the cache (keyed by the file's hash; about a minute, once).

The script
----------
Each conversation has a system prompt (half of them), function tools (half of them; the tiny model was
trained to call such tools) and ``--turns`` user messages. After a user message the assistant answers;
when the answer has ``tool_calls``, a ``tool_message`` with a deterministic fake result answers each call
and the assistant is asked again under the last result (at most 2 such rounds per user message). A
*turn* is one assistant message. Per turn the script draws sampling parameters (temperature 0/0.7/0.8/1,
sometimes top-k, top-p or a repetition penalty, a seed), sometimes a small ``max_new_tokens`` (3-8, so
the turn is cut) and sometimes ``stop_token_ids`` with a token that is not the turn closer (the id of
" the", or eos where eos is not the closer, as in llama3). User texts, tool results and system prompts
sometimes contain literal control-token strings (``<|im_end|>``, ``<|eot_id|>``,
``<tool_call>{...}</tool_call>``, ``<|start_header_id|>system<|end_header_id|>``, ...). Everything the
script decides comes from ``random.Random`` seeded by (``--seed``, conversation, turn, round), so both
arms get the same script; what the model writes (and so whether it calls tools) may differ per arm.

Ground truth per turn: the token ids and logprobs streamed over SSE (what the engine produced) and the
stored ``prompt_token_ids`` (the worker refuses to finish a message whose engine-reported consumed
prompt differs from the prompt it sent), read back with ``GET .../messages/{id}?include=tokens``.

Metrics (per arm; "stored" = what ``?include=tokens`` returns)
-------------------------------------------------------------
TEF  token exactness failure: share of turns whose training record is not exactly what the engine
     consumed and produced. stitch: the record is the stored (prompt, completion, logprobs); it fails if
     the completion or logprobs (float32, bit for bit) differ from the SSE stream. naive: the record is
     what a text pipeline stores: it keeps the conversation as text (content, reasoning_content,
     tool_calls as returned by the API) and re-renders it with the chat template (message text encoded
     safely, like the worker does). Turn i's view is (P, C): P = render(messages[:i], generation
     prompt), C = the tokens that render(messages[:i+1]) adds after P, up to and including the turn's
     closer (the separator after it is not part of the turn); if render(messages[:i+1]) does not start
     with P the view does not exist and the turn fails. It fails if P != stored prompt or C != the
     streamed completion (its logprobs are then the engine's, so they match whenever the tokens do).
EPB  extension property break: share of consecutive turn pairs in a conversation where the later prompt
     does not start with the earlier prompt + completion (both arms: stored tokens; for naive the stored
     prompt is the one the engine consumed).
SPR  samples per rollout: training samples per conversation after merging turns whose prompt extends
     everything before them (``shared.stitching.merge_turns`` on the stored tokens), averaged.
TFLA teacher-forced logprob agreement: stitch: each merged sample's final sequence (its last turn's
     prompt + completion) is re-scored with the same model in one fp32 forward pass on CPU; every turn
     of the sample compares its stored logprobs with the re-scored ones at its completion positions,
     processed with that turn's sampling parameters (``worker.sampling.teacher_forced_logprobs``:
     repetition penalty, temperature, top-k, top-p). A position where the turn's top-k cut falls on
     a near-tie (k-th and (k+1)-th scores within 1e-5) and the logprobs differ is left out and
     counted ("top-k cut ties"): fp rounding alone decides whether the tied token is kept, which
     moves the logprob by its share of the mass. naive: the sample is the text render of the whole
     final conversation (one per conversation); turn i's positions start after P (if the render starts
     with P) and its engine tokens are aligned with the render's tokens of that turn; positions up to
     the first differing token are re-scored and compared, every later generated position (or all of
     them, if the render does not start with P) counts as a disagreement with |delta| = inf.
     Reported: share of generated positions with |delta| > 1e-4, and max |delta|.
BF   bridge fidelity failure (stitch only; "-" for naive): share of stitched turns (later turns that
     did not fork) whose bridge — stored prompt minus the reused prefix minus the synthetic closer —
     differs from the template's own rendering of the new messages: the tokens of render(history + new,
     generation prompt) after the prior assistant turn's closer, computed here from the real history
     (not the worker's dummy base conversation; where a history text holds a control string that the
     template interprets, such as a </think> the model wrote without opening reasoning, from that
     history with the control strings taken out of its texts, since the bridge does not depend on
     them). Reported beside it: synthetic closer mismatches —
     a closer added although the prior turn closed itself, missing although it did not (cut by
     max_new_tokens or stopped on a non-closer token), or other than the template's closer for it.
FBR  full-render fallback rate: share of later turns (not the first of a conversation) whose prompt
     was a full render after a history edit (``fork``). naive: 1.0 by construction (every prompt is a
     full render).
PC   prefix cache (vllm only; "-" for hf, which reports no cache hits): for each later turn, its reusable
     prefix is the longest common prefix of its prompt and the previous turn's prompt + completion (for
     stitch that is ``reused_prefix_len``); reported: sum of ``num_cached_tokens`` / sum of reusable
     tokens; beside it the block-rounded ideal (each reusable length rounded down to the cache block size,
     inferred as the gcd of all positive cached counts: a block cache serves whole blocks only), and the
     plain mean over later turns of ``num_cached_tokens`` / prompt length. Not a target.

Targets for the stitch arm (no history edits here): TEF 0, EPB 0, SPR 1.0, TFLA max |delta| < 1e-4,
BF 0 (and no closer mismatches), FBR 0; a PASS/FAIL line per target is printed. The exit code is 0
whatever the results (it is a benchmark); ``--json`` prints one JSON object instead of the table.
Progress goes to stderr.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import hashlib
import json
import math
import os
import random
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncGenerator, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.exactness_metrics import (
    TFLA_TOLERANCE,
    Agreement,
    PrefixCache,
    agreement,
    aligned_prefix,
    bridge_mismatch,
    cache_block_size,
    closer_mismatch,
    expected_stitch_suffix,
    extension_breaks,
    logprob_deltas,
    naive_training_view,
    prefix_cache,
    samples_per_rollout,
    share,
    tokens_exact,
    top_k_cut_tied,
    turn_closed,
    turn_end,
)
from shared.protocol import WorkMessage
from shared.stitching import extends, merge_turns
from tokentrail.launcher import answers, free_port, offers, spawn, stop, wait_ready
from worker.chat_format import ChatFormat, template_message
from worker.engines.contract import GenerationParams
from worker.prompt_builder import PromptBuilder

ARMS = ("stitch", "naive")
MAX_TOOL_ROUNDS = 2  # assistant messages after tool results, per user message
CONTROL_STRINGS = (
    "<|im_end|>",
    "<|im_start|>assistant\n",
    "<|endoftext|>",
    "<|eot_id|>",
    "<|eom_id|>",
    "<|start_header_id|>system<|end_header_id|>",
    "<|python_tag|>",
    '<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>',
    "<think>",
    "</think>",
)

# --------------------------------------------------------------------------------------------------
# The model
# --------------------------------------------------------------------------------------------------


def _say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def prepare_model(template: str, train_steps: int = 100) -> str:
    """The directory of the tiny model for a built-in template name or a Jinja template file."""
    from worker.tiny_model import (
        BUILD_VERSION,
        TINY_TEMPLATES,
        build_cached,
        build_tiny_model,
        default_cache_dir,
        resolve_model,
    )

    if template in TINY_TEMPLATES:
        _say(f"preparing tiny-{template} (built and trained once, then cached)...")
        return resolve_model(f"tiny-{template}")
    from benchmarks.template_zoo import FAMILIES, family, zoo_model

    if template in FAMILIES:  # a real template with its model's tokens, briefly trained (cached)
        _say(f"preparing a tiny model with the {template} template and tokens ({train_steps} training steps)...")
        return zoo_model(family(template), train_steps=train_steps)
    path = Path(template)
    if not path.is_file():
        raise SystemExit(f"--template: {template!r} is neither a built-in template ({TINY_TEMPLATES}) nor a file")
    text = path.read_text(encoding="utf-8")
    # The special tokens come from a built-in layout: llama3's if the template uses its markers.
    tokens = "llama3" if "<|eot_id|>" in text or "<|start_header_id|>" in text else "chatml"
    digest = hashlib.sha256(text.encode()).hexdigest()[:16]
    models = default_cache_dir() / "models"
    final = (models / f"tiny-file-{tokens}-{digest}-s0-v{BUILD_VERSION}").absolute()
    if (final / "tokentrail.json").is_file():
        _say(f"using the cached model for {path} ({final})")
        return str(final)
    _say(f"building a tiny model trained on {path} ({tokens} tokens) into {final}; about a minute...")
    build_cached(final, lambda out: build_tiny_model(out, template=tokens, chat_template_file=path, seed=0))
    _say(f"model ready: {final}")
    return str(final)


# --------------------------------------------------------------------------------------------------
# The seeded script
# --------------------------------------------------------------------------------------------------

_TOOLS: tuple[tuple[str, str, dict[str, str]], ...] = (
    ("get_weather", "Current weather in a city", {"city": "string", "units": "string"}),
    ("search_web", "Search the web, return the top result", {"query": "string"}),
    ("get_time", "Current local time in a time zone", {"tz": "string"}),
    ("lookup_user", "Look up a user record by id", {"user_id": "integer"}),
    ("read_file", "Read a text file", {"path": "string"}),
)
_CITIES = ("Paris", "London", "Berlin", "Tokyo", "Lagos", "Lima", "Oslo", "Cairo")
_SYSTEM_PROMPTS = (
    "You are a helpful assistant.",
    "You are terse.",
    "Answer in one or two sentences.",
    "You are a careful assistant. Think before you answer.",
)
_TOPICS = ("the river", "a quiet garden", "the old train", "my computer", "the weather", "a music file")
_PLAIN_ASKS = (
    "Tell me about {topic}.",
    "What do you think of {topic}?",
    "Write one sentence about {topic}.",
    "The team builds a small model. Why does it change {topic}?",
    "Can you explain {topic} in simple words?",
)


def _tool_schema(name: str, description: str, params: dict[str, str]) -> dict[str, Any]:
    return {
        "type": "function",
        "function": {
            "name": name,
            "description": description,
            "parameters": {
                "type": "object",
                "properties": {p: {"type": t} for p, t in params.items()},
                "required": list(params),
            },
        },
    }


def _tool_ask(rng: random.Random, name: str) -> str:
    if name == "get_weather":
        return rng.choice(("What is the weather in {}?", "Is it warm in {} today?")).format(rng.choice(_CITIES))
    if name == "get_time":
        return f"Please use get time: {rng.choice(('UTC', 'Asia/Tokyo', 'Europe/Paris'))}."
    if name == "lookup_user":
        return f"Please use lookup user: {rng.randint(1, 99999)}."
    if name == "read_file":
        return f"Can you read file for ./data/{rng.choice(('notes', 'report', 'list'))}.txt?"
    return f"Please use search web: {rng.choice(_TOPICS)}."


@dataclass(frozen=True)
class Script:
    """Everything one conversation sends, the same for both arms."""

    seed: int
    index: int
    system_prompt: str | None
    tools: list[dict[str, Any]] | None
    user_texts: tuple[str, ...]
    stop_candidates: tuple[int, ...]

    @classmethod
    def make(cls, seed: int, index: int, turns: int, stop_candidates: tuple[int, ...]) -> Script:
        rng = random.Random(f"exactness:{seed}:{index}")
        offered = rng.sample(_TOOLS, rng.choice((1, 2, 3))) if rng.random() < 0.5 else []
        system: str | None = None
        if rng.random() < 0.5:
            system = rng.choice(_SYSTEM_PROMPTS)
            if rng.random() < 0.2:
                system += f" Never print {rng.choice(CONTROL_STRINGS)}."
        texts = []
        for _ in range(turns):
            if offered and rng.random() < 0.6:
                text = _tool_ask(rng, rng.choice(offered)[0])
            else:
                text = rng.choice(_PLAIN_ASKS).format(topic=rng.choice(_TOPICS))
            if rng.random() < 0.3:
                literal = rng.choice(CONTROL_STRINGS)
                text = rng.choice((f"{text} Also, why does {literal} show up in my file?", f"{literal}\n{text}"))
            texts.append(text)
        tools = [_tool_schema(*t) for t in offered] or None
        return cls(seed, index, system, tools, tuple(texts), stop_candidates)

    def _rng(self, *key: object) -> random.Random:
        return random.Random(":".join(map(str, ("exactness", self.seed, self.index, *key))))

    def sampling(self, turn: int, round_: int) -> dict[str, Any]:
        rng = self._rng("sampling", turn, round_)
        params: dict[str, Any] = {
            "temperature": rng.choices((0.0, 0.7, 0.8, 1.0), weights=(1, 3, 3, 2))[0],
            "max_new_tokens": rng.randint(3, 8) if rng.random() < 0.2 else 64,
            "seed": rng.randrange(2**31),
        }
        if rng.random() < 0.25:
            params["top_k"] = rng.choice((20, 50))
        if rng.random() < 0.25:
            params["top_p"] = rng.choice((0.8, 0.9, 0.95))
        if rng.random() < 0.2:
            params["repetition_penalty"] = rng.choice((1.1, 1.3))
        if self.stop_candidates and rng.random() < 0.2:
            params["stop_token_ids"] = [rng.choice(self.stop_candidates)]
        return params

    def tool_result(self, turn: int, round_: int, call_index: int, call: dict[str, Any]) -> str:
        rng = self._rng("tool", turn, round_, call_index)
        name = str(call.get("function", {}).get("name", "tool"))
        roll = rng.random()
        if roll < 0.25:
            return f"{rng.choice(CONTROL_STRINGS)} {name} returned nothing useful."
        if roll < 0.35:
            return f"Error: {name} timed out."
        if name == "get_weather":
            return json.dumps({"temperature": rng.randint(-10, 40), "conditions": rng.choice(("warm", "cold"))})
        return json.dumps({"result": rng.randint(1, 9999), "status": "ok"})


def has_control_text(text: str | None) -> bool:
    return bool(text) and any(s.strip() in (text or "") for s in CONTROL_STRINGS)


# --------------------------------------------------------------------------------------------------
# Server and workers
# --------------------------------------------------------------------------------------------------


VLLM_STARTUP_S = 600  # vLLM on CPU takes 30-60 s to start (more on a busy machine): two start at once


def vllm_python() -> str:
    """The python of the vLLM environment built by ``scripts/vllm_env.sh``."""
    venv = Path(os.environ.get("TOKENTRAIL_VLLM_VENV") or Path.home() / ".cache/tokentrail/vllm-venv")
    python = venv / "bin" / "python"
    if not python.is_file():
        raise SystemExit(f"--engine vllm: no vLLM environment at {venv}; build it with scripts/vllm_env.sh {venv}")
    return str(python)


@contextlib.contextmanager
def running_server(work: Path) -> Iterator[tuple[str, str]]:
    """One server (embedded SQLite under ``work``) as a child process; yields (URL, worker key)."""
    from server.admin import issue_worker_key
    from server.settings import ServerSettings

    url = f"http://127.0.0.1:{free_port()}"
    data = work / "data"
    data.mkdir()
    key = issue_worker_key(ServerSettings(data_dir=data), "exactness")
    proc = spawn(
        ["serve", "--port", url.rsplit(":", 1)[1], "--data-dir", str(data), "--log-level", "warning"],
        output=work / "server.log",
    )
    try:
        wait_ready(lambda: answers(url), {"server": proc}, "server", 180, logs=work)
        yield url, key
    finally:
        stop(proc, "server")


@contextlib.contextmanager
def running_workers(
    url: str,
    key: str,
    work: Path,
    model_dir: str,
    modes: dict[str, str],
    max_parallel: int,
    engine: str = "hf",
    extra_args: Sequence[str] = (),
) -> Iterator[None]:
    """One worker per served name (``modes``: name -> prompt mode) on ``model_dir``, as child processes.

    ``engine`` vllm starts them with the vLLM environment's python (``vllm_python``)."""
    procs: dict[str, subprocess.Popen[bytes]] = {}
    try:
        program, env, engine_args = None, {}, ["--engine", engine]
        if engine == "vllm":
            program, env = (vllm_python(), "-m", "tokentrail"), {"VLLM_CPU_KVCACHE_SPACE": "1"}
            engine_args += ["--max-model-len", "2048", "--gpu-memory-utilization", "0.2"]
            _say(f"starting {len(modes)} vLLM worker(s) with {program[0]} (30-60 s or more each)...")
        env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 2) // len(modes)))
        for name, mode in modes.items():
            procs[name] = spawn(
                ["worker", "--server-url", url, "--api-key", key, "--model", model_dir, "--served-model-name", name,
                 "--prompt-mode", mode, "--max-parallel", str(max_parallel), "--log-level", "warning",
                 *engine_args, *extra_args],
                program=program,
                output=work / f"{name}.log",
                env=env,
            )  # fmt: skip
        timeout = VLLM_STARTUP_S if engine == "vllm" else 180
        wait_ready(
            lambda: offers(url, list(modes)), procs, f"workers {', '.join(modes)}", timeout, logs=work, progress=True
        )
        yield
    finally:
        for name, proc in reversed(procs.items()):
            stop(proc, name)


@contextlib.contextmanager
def running_arms(
    model_dir: str, work: Path, max_parallel: int, engine: str = "hf", extra_args: Sequence[str] = ()
) -> Iterator[str]:
    """One server and one worker per arm (same model dir) as child processes; yields the server URL."""
    modes = {arm: arm for arm in ARMS}
    with (
        running_server(work) as (url, key),
        running_workers(url, key, work, model_dir, modes, max_parallel, engine, extra_args),
    ):
        _say(f"server at {url}, {engine} workers 'stitch' and 'naive' connected")
        yield url


# --------------------------------------------------------------------------------------------------
# Driving conversations over HTTP + SSE
# --------------------------------------------------------------------------------------------------


@dataclass
class Turn:
    """One assistant message: what was asked, what was streamed, what was stored."""

    at: int  # index of this assistant message in Conversation.messages
    new_from: int  # index of the first message after the previous assistant message (or of the first)
    turn: int  # user turn it answers
    round: int  # 0, or the tool round
    sampling: dict[str, Any]
    message_id: str = ""
    error: str | None = None
    streamed_ids: list[int] = field(default_factory=list)
    streamed_logprobs: list[float | None] = field(default_factory=list)
    stored: dict[str, Any] = field(default_factory=dict)  # MessageRead with tokens

    def as_message(self) -> WorkMessage:
        """The stored assistant message as the oracle renders it in later history."""
        return WorkMessage(
            id=self.message_id,
            role="assistant",
            content=self.stored.get("content") or "",
            tool_calls=self.stored.get("tool_calls") or None,
            reasoning_content=self.stored.get("reasoning_content"),
        )

    @property
    def prompt(self) -> list[int]:
        return list(self.stored.get("prompt_token_ids") or [])

    @property
    def completion(self) -> list[int]:
        return list(self.stored.get("completion_token_ids") or [])

    @property
    def logprobs(self) -> list[float | None]:
        return list(self.stored.get("logprobs") or [])


@dataclass
class Conversation:
    arm: str
    script: Script
    messages: list[WorkMessage] = field(default_factory=list)
    turns: list[Turn] = field(default_factory=list)  # completed turns only
    failed: list[Turn] = field(default_factory=list)


async def _sse(client: httpx.AsyncClient, url: str) -> AsyncGenerator[dict[str, Any], None]:
    async with client.stream("GET", url, headers={"Accept": "text/event-stream"}) as resp:
        resp.raise_for_status()
        data: list[str] = []
        async for line in resp.aiter_lines():
            if line.startswith("data:"):
                data.append(line[5:].removeprefix(" "))
            elif not line and data:
                yield json.loads("\n".join(data))
                data = []


async def _post(client: httpx.AsyncClient, path: str, body: dict[str, Any]) -> dict[str, Any]:
    resp = await client.post(path, json=body)
    if resp.status_code >= 400:
        raise RuntimeError(f"POST {path}: HTTP {resp.status_code} {resp.text[:500]}")
    result: dict[str, Any] = resp.json()
    return result


async def _generate(client: httpx.AsyncClient, arm: str, chat_id: str, parent_id: str, turn: Turn) -> None:
    body = {"parent_id": parent_id, "model_config_name": arm, "sampling_parameters": turn.sampling}
    turn.message_id = (await _post(client, f"/chats/{chat_id}/assistant_message", body))["id"]
    ids: list[int] = []
    lps: list[float | None] = []
    url = f"/chats/{chat_id}/messages/{turn.message_id}/events"
    async with contextlib.aclosing(_sse(client, url)) as events:
        async for event in events:
            kind = event.get("event_type")
            if kind == "token":
                index = int(event["index"])
                if index > len(ids):
                    turn.error = f"the token stream skipped from index {len(ids)} to {index}"
                    return
                del ids[index:], lps[index:]  # a replayed index overwrites
                ids.append(int(event["token_id"]))
                lps.append(event["logprob"])
            elif kind == "reset":
                del ids[int(event["from_index"]) :], lps[int(event["from_index"]) :]
            elif kind == "error":
                turn.error = f"{event.get('code')}: {event.get('error') or event.get('message')}"
                return
            elif kind == "message":
                break
    turn.streamed_ids, turn.streamed_logprobs = ids, lps
    resp = await client.get(f"/chats/{chat_id}/messages/{turn.message_id}", params={"include": "tokens"})
    resp.raise_for_status()
    turn.stored = resp.json()
    if turn.stored.get("state") != "complete":
        turn.error = f"message ended {turn.stored.get('state')}: {turn.stored.get('error')}"


async def run_conversation(client: httpx.AsyncClient, arm: str, script: Script) -> Conversation:
    conv = Conversation(arm, script)
    chat = await _post(client, "/chats", {"system_prompt": script.system_prompt, "tools": script.tools})
    chat_id = chat["id"]
    msgs = conv.messages
    if script.system_prompt is not None:
        msgs.append(WorkMessage(id="system", role="system", content=script.system_prompt))
    parent: str | None = None
    new_from = 0
    for t, text in enumerate(script.user_texts):
        user = await _post(client, f"/chats/{chat_id}/prompter_message", {"parent_id": parent, "content": text})
        msgs.append(WorkMessage(id=user["id"], role="user", content=text))
        ask_under = user["id"]
        for r in range(MAX_TOOL_ROUNDS + 1):
            turn = Turn(at=len(msgs), new_from=new_from, turn=t, round=r, sampling=script.sampling(t, r))
            await _generate(client, arm, chat_id, ask_under, turn)
            if turn.error is not None:
                conv.failed.append(turn)
                return conv
            stored = turn.stored
            msgs.append(turn.as_message())
            conv.turns.append(turn)
            parent, new_from = turn.message_id, len(msgs)
            calls = stored.get("tool_calls") or []
            if not calls or r == MAX_TOOL_ROUNDS:
                break
            last = turn.message_id
            for j, call in enumerate(calls):
                content = script.tool_result(t, r, j, call)
                body = {"parent_id": last, "tool_call_id": call["id"], "content": content}
                tool = await _post(client, f"/chats/{chat_id}/tool_message", body)
                msgs.append(WorkMessage(id=tool["id"], role="tool", content=content, tool_call_id=call["id"]))
                last = tool["id"]
            ask_under = last
    return conv


async def drive(
    url: str, scripts: list[Script], concurrency: int, arms: Sequence[str] = ARMS, api: str = "chat"
) -> dict[str, list[Conversation]]:
    """Run every script on every arm; ``api`` "openai" sends them through ``/v1/chat/completions``."""
    runner = run_conversation
    if api == "openai":
        from benchmarks.exactness_openai import run_conversation_openai

        runner = run_conversation_openai
    timeout = httpx.Timeout(60.0, read=600.0)
    async with httpx.AsyncClient(base_url=url, timeout=timeout) as client:
        resp = await client.get("/auth/callback/debug", params={"code": "exactness"})
        resp.raise_for_status()
        client.headers["Authorization"] = f"Bearer {resp.json()['access_token']['access_token']}"
        done = dict.fromkeys(arms, 0)
        gates = {arm: asyncio.Semaphore(concurrency) for arm in arms}

        async def one(arm: str, script: Script) -> Conversation:
            async with gates[arm]:
                conv = await runner(client, arm, script)
            done[arm] += 1
            _say("conversations done: " + ", ".join(f"{a} {done[a]}/{len(scripts)}" for a in arms))
            return conv

        results = await asyncio.gather(*(one(arm, s) for arm in arms for s in scripts))
    return {arm: [c for c in results if c.arm == arm] for arm in arms}


def dump_conversations(convs: dict[str, list[Conversation]]) -> dict[str, Any]:
    """Everything driven, as JSON-ready data (``--dump``), for investigating a failure offline."""
    return {
        arm: [
            {
                "index": c.script.index,
                "system_prompt": c.script.system_prompt,
                "tools": c.script.tools,
                "messages": [m.model_dump(exclude_none=True) for m in c.messages],
                "turns": [asdict(t) for t in [*c.turns, *c.failed]],
            }
            for c in cs
        ]
        for arm, cs in convs.items()
    }


def load_conversations(data: dict[str, Any]) -> dict[str, list[Conversation]]:
    """The conversations of a ``--dump`` file (the inverse of ``dump_conversations``)."""
    out: dict[str, list[Conversation]] = {}
    for arm, convs in data["conversations"].items():
        out[arm] = []
        for c in convs:
            script = Script(data["seed"], c["index"], c["system_prompt"], c["tools"], (), ())
            conv = Conversation(arm, script, [WorkMessage.model_validate(m) for m in c["messages"]])
            for t in c["turns"]:
                turn = Turn(**t)
                (conv.failed if turn.error is not None else conv.turns).append(turn)
            out[arm].append(conv)
    return out


# --------------------------------------------------------------------------------------------------
# Metrics
# --------------------------------------------------------------------------------------------------


def _params(sampling: dict[str, Any]) -> GenerationParams:
    """The processing the worker applied (worker/client.py builds GenerationParams the same way)."""
    temperature = sampling.get("temperature")
    return GenerationParams(
        max_new_tokens=int(sampling.get("max_new_tokens", 1024)),
        temperature=1.0 if temperature is None else float(temperature),
        top_k=sampling.get("top_k"),
        top_p=sampling.get("top_p"),
        typical_p=sampling.get("typical_p"),
        repetition_penalty=sampling.get("repetition_penalty"),
    )


class Scorer:
    """Re-scores token sequences with the model in one fp32 forward pass on CPU."""

    def __init__(self, model_dir: str) -> None:
        import torch
        import transformers
        from transformers import AutoModelForCausalLM

        hf: Any = transformers
        hf.utils.logging.disable_progress_bar()
        # one thread: for a model this small, more threads only wait on each other (badly so on a busy machine)
        torch.set_num_threads(1)
        self.torch = torch
        model: Any = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        self.model = model.eval()

    def logits(self, ids: Sequence[int]) -> Any:
        with self.torch.inference_mode():
            return self.model(input_ids=self.torch.tensor([list(ids)], dtype=self.torch.long)).logits[0].float()

    def rescored(
        self, logits: Any, seq: Sequence[int], prompt_len: int, n: int, sampling: dict[str, Any]
    ) -> list[float]:
        """Re-scored logprobs of ``seq[prompt_len : prompt_len + n]`` given everything before them."""
        from worker.sampling import gather_logprobs, teacher_forced_logprobs

        if n == 0:
            return []
        end = prompt_len + n
        rows = teacher_forced_logprobs(logits[:end], list(seq[:end]), prompt_len, _params(sampling))
        values: list[float] = gather_logprobs(rows, list(seq[prompt_len:end])).tolist()
        return values

    def cut_tied(
        self, logits: Any, seq: Sequence[int], prompt_len: int, n: int, sampling: dict[str, Any]
    ) -> list[bool]:
        """Per completion position: does the turn's top-k cut fall on a near-tie of the scores
        (repetition penalty and temperature applied, no filter)?"""
        from worker.sampling import is_greedy, teacher_forced_logprobs

        params = _params(sampling)
        top_k = params.top_k
        if n == 0 or not top_k or is_greedy(params):
            return [False] * n
        unfiltered = dataclasses.replace(params, top_k=None, top_p=None, typical_p=None, min_p=None)
        end = prompt_len + n
        rows = teacher_forced_logprobs(logits[:end], list(seq[:end]), prompt_len, unfiltered)
        k = min(top_k + 1, rows.shape[-1])
        best = self.torch.topk(rows, k, dim=-1).values.tolist()
        return [top_k_cut_tied(row, top_k) for row in best]


@dataclass
class ArmReport:
    counts: dict[str, int] = field(default_factory=dict)
    tef: tuple[int, int] = (0, 0)
    epb: tuple[int, int] = (0, 0)
    samples: int = 0
    tfla: Agreement = field(default_factory=Agreement)
    bf: tuple[int, int] | None = None
    closer: tuple[int, int] | None = None
    fbr: tuple[int, int] = (0, 0)
    fbr_by_construction: bool = False
    examples: list[str] = field(default_factory=list)  # first failures, for investigation
    errors: dict[str, int] = field(default_factory=dict)  # why turns failed (the worker's error), how often
    cache: PrefixCache | None = None  # None: the engine reports no prefix-cache hits (hf)
    cache_block: int | None = None

    def metrics(self) -> dict[str, Any]:
        conversations = self.counts.get("conversations", 0)
        out: dict[str, Any] = {
            "TEF": share(*self.tef),
            "TEF_counts": list(self.tef),
            "EPB": share(*self.epb),
            "EPB_counts": list(self.epb),
            "SPR": self.samples / conversations if conversations else None,
            "TFLA_share": self.tfla.share,
            "TFLA_max_abs_delta": self.tfla.max_delta,
            "TFLA_counts": [self.tfla.disagreements, self.tfla.positions],
            "TFLA_cut_ties": self.tfla.cut_ties,
            "BF": share(*self.bf) if self.bf else None,
            "BF_counts": list(self.bf) if self.bf else None,
            "closer_mismatches": list(self.closer) if self.closer else None,
            "FBR": 1.0 if self.fbr_by_construction else share(*self.fbr),
            "FBR_counts": None if self.fbr_by_construction else list(self.fbr),
            "prefix_cache": None
            if self.cache is None
            else {
                "served": self.cache.served,
                "ideal_served": self.cache.ideal_served,
                "mean_cached_prompt_share": self.cache.mean_prompt_share,
                "later_turns": self.cache.turns,
                "reusable_tokens": self.cache.reusable,
                "cached_tokens": self.cache.cached,
                "ideal_tokens": self.cache.ideal,
                "block_size": self.cache_block,
            },
        }
        return out


_MASK = "\ue000ref{}\ue001"
_MASK_RE = re.compile("\ue000ref(\\d+)\ue001")


@dataclass(frozen=True)
class Reference:
    """A reference render: token ids, and for each masked text the (message index, start, end) of its
    tokens."""

    ids: list[int]
    spans: list[tuple[int, int, int]]

    def text_end(self, message: int) -> int | None:
        """Where the last text of message ``message`` ends in ``ids`` (None: it rendered no text)."""
        ends = [end for m, _, end in self.spans if m == message]
        return max(ends) if ends else None


def reference_render(
    fmt: ChatFormat, messages: Sequence[WorkMessage], tools: list[dict[str, Any]] | None, gen: bool
) -> Reference | None:
    """The template's render of ``messages`` as token ids, message text encoded safely; None if the
    template rewrites message text so that it cannot be isolated.

    Written here independently of ``ChatFormat.render``: the template renders once with every
    non-empty text (content, reasoning) replaced by a sentinel — empty texts stay empty, so templates that
    test them (``if content``) branch as for the real message — and once for real; the two must agree
    once the sentinels are put back. Template text is tokenized with control tokens recognised
    (``encode_template_text``), message text with them split (``encode_content``).
    """
    texts: list[tuple[int, str]] = []

    def mask(index: int, value: str | None) -> str | None:
        if not value:
            return value
        texts.append((index, value))
        return _MASK.format(len(texts) - 1)

    masked = [
        template_message(m, mask(i, m.content) or "", mask(i, m.reasoning_content)) for i, m in enumerate(messages)
    ]
    real = [template_message(m, m.content, m.reasoning_content) for m in messages]
    try:
        rendered = fmt.render_text(masked, add_generation_prompt=gen, tools=tools)
        reference = fmt.render_text(real, add_generation_prompt=gen, tools=tools)
    except Exception:  # a template may raise on what it does not support
        return None
    if _MASK_RE.sub(lambda m: texts[int(m.group(1))][1], rendered) != reference:
        return None
    ids: list[int] = []
    spans: list[tuple[int, int, int]] = []
    pos = 0
    for match in _MASK_RE.finditer(rendered):
        ids += fmt.encode_template_text(rendered[pos : match.start()])
        index, text = texts[int(match.group(1))]
        begin = len(ids)
        ids += fmt.encode_content(text)
        spans.append((index, begin, len(ids)))
        pos = match.end()
    return Reference(ids + fmt.encode_template_text(rendered[pos:]), spans)


def cached_tokens(turn: Turn) -> int | None:
    """``num_cached_tokens`` of a stored turn: prompt tokens the engine served from its prefix cache."""
    value = turn.stored.get("num_cached_tokens")
    return None if value is None else int(value)


def infer_cache_block(convs: dict[str, list[Conversation]]) -> int | None:
    """The prefix cache's block size, inferred from every cached count of every arm."""
    return cache_block_size(cached_tokens(t) for cs in convs.values() for c in cs for t in c.turns)


class Evaluator:
    def __init__(self, fmt: ChatFormat, scorer: Scorer, cache_block: int | None = None) -> None:
        self.cache_block = cache_block
        self.fmt = fmt
        self.scorer = scorer
        shape = PromptBuilder(fmt).shape
        self.closers = shape.history_ends
        # a render that ends on an assistant turn may close it the generation way (gpt-oss <|return|>
        # where history has <|end|>): counting turns in such a render needs both kinds of ends
        self.turn_ends = self.closers | frozenset(c.generation[-1] for c in (shape.plain, shape.tool) if c.generation)
        self.specials = frozenset(int(i) for i in fmt.tokenizer.all_special_ids)
        self._cache: dict[tuple[int, int, bool], Reference | None] = {}

    def render(self, conv: Conversation, upto: int, gen: bool) -> list[int] | None:
        """Token ids of the template's render of ``conv.messages[:upto]`` (text encoded safely), or None
        if the template cannot render them safely (it rewrites text holding control-token strings)."""
        ref = self.reference(conv, upto, gen)
        return None if ref is None else ref.ids

    def reference(self, conv: Conversation, upto: int, gen: bool) -> Reference | None:
        key = (id(conv), upto, gen)
        if key not in self._cache:
            self._cache[key] = reference_render(self.fmt, conv.messages[:upto], conv.script.tools, gen)
        return self._cache[key]

    def counts(self, convs: list[Conversation]) -> dict[str, int]:
        turns = [t for c in convs for t in c.turns]
        stop_turns = [t for t in turns if t.sampling.get("stop_token_ids")]
        return {
            "conversations": len(convs),
            "turns": len(turns),
            "turn_pairs": sum(max(0, len(c.turns) - 1) for c in convs),
            "failed_turns": sum(len(c.failed) for c in convs),
            "tool_call_turns": sum(1 for t in turns if t.stored.get("tool_calls")),
            "tool_results": sum(1 for c in convs for m in c.messages if m.role == "tool"),
            "reasoning_turns": sum(1 for t in turns if t.stored.get("reasoning_content") is not None),
            "truncated_turns": sum(1 for t in turns if t.stored.get("finish_reason") == "length"),
            "synthetic_closer_turns": sum(1 for t in turns if t.stored.get("synthetic_token_count")),
            "stop_token_turns": len(stop_turns),
            "stopped_on_stop_token": sum(
                1
                for t in stop_turns
                if t.stored.get("finish_reason") == "stop"
                and t.stored.get("stop_reason") in t.sampling["stop_token_ids"]
            ),
            "control_string_turns": sum(1 for c in convs for t in c.turns if self._control_turn(c, t)),
        }

    @staticmethod
    def _control_turn(conv: Conversation, turn: Turn) -> bool:
        new = conv.messages[turn.new_from : turn.at]
        return any(has_control_text(m.content) for m in new)

    def evaluate(self, arm: str, convs: list[Conversation]) -> ArmReport:
        report = ArmReport(counts=self.counts(convs))
        for t in (t for c in convs for t in c.failed):
            report.errors[t.error or "?"] = report.errors.get(t.error or "?", 0) + 1
        tef = epb = pairs = later = forks = bf = closer = stitched = 0
        for conv in convs:
            turns = conv.turns
            if not turns:
                continue
            stored = [(t.prompt, t.completion) for t in turns]
            breaks = extension_breaks(stored)
            epb, pairs = epb + sum(breaks), pairs + len(breaks)
            for turn, broke in zip(turns[1:], breaks, strict=True):
                if broke:
                    self._example(report, conv, turn, "extension break")
            report.samples += samples_per_rollout(stored)
            later += len(turns) - 1
            forks += sum(1 for t in turns[1:] if t.stored.get("fork"))
            for t in turns:
                if not self._exact(arm, conv, t):
                    tef += 1
                    self._example(report, conv, t, "token exactness")
            if arm == "stitch":
                report.tfla += self._tfla_stitch(turns)
                counted = self._bridges(report, conv)
                bf, closer, stitched = bf + counted[0], closer + counted[1], stitched + counted[2]
            else:
                report.tfla += self._tfla_naive(conv)
        report.tef, report.epb, report.fbr = (tef, report.counts["turns"]), (epb, pairs), (forks, later)
        report.cache_block = self.cache_block
        report.cache = prefix_cache(
            ([(t.prompt, t.completion, cached_tokens(t)) for t in c.turns] for c in convs), self.cache_block
        )
        if arm == "stitch":
            report.bf, report.closer = (bf, stitched), (closer, stitched)
        else:
            report.fbr_by_construction = True
        return report

    def _example(self, report: ArmReport, conv: Conversation, turn: Turn, what: str) -> None:
        if len(report.examples) < 5:
            report.examples.append(
                f"{what}: conversation {conv.script.index}, turn {turn.turn} round {turn.round}, message "
                f"{turn.message_id} (finish={turn.stored.get('finish_reason')}, stop={turn.stored.get('stop_reason')}, "
                f"fork={turn.stored.get('fork')})"
            )

    def _exact(self, arm: str, conv: Conversation, turn: Turn) -> bool:
        if arm == "stitch":
            return tokens_exact(
                turn.prompt, turn.completion, turn.logprobs, turn.prompt, turn.streamed_ids, turn.streamed_logprobs
            )
        prompt, through = self.render(conv, turn.at, True), self.render(conv, turn.at + 1, False)
        if prompt is None or through is None:
            return False
        view = naive_training_view(prompt, through, self.closers)
        return view is not None and view == (turn.prompt, turn.streamed_ids)

    def _tfla_stitch(self, turns: list[Turn]) -> Agreement:
        total = Agreement()
        for sample in merge_turns([(t.prompt, t.completion) for t in turns]):
            last = turns[sample[-1]]
            seq = [*last.prompt, *last.completion]
            logits = self.scorer.logits(seq)
            for k in sample:
                t = turns[k]
                rescored = self.scorer.rescored(logits, seq, len(t.prompt), len(t.completion), t.sampling)
                # the merge guarantees seq extends this turn's prompt + completion
                deltas = logprob_deltas(t.logprobs, rescored)
                tied = None
                if any(d > TFLA_TOLERANCE for d in deltas):
                    tied = self.scorer.cut_tied(logits, seq, len(t.prompt), len(t.completion), t.sampling)
                total += agreement(deltas, tied=tied)
        return total

    def _tfla_naive(self, conv: Conversation) -> Agreement:
        total = Agreement()
        final = self.render(conv, conv.turns[-1].at + 1, False)
        logits = self.scorer.logits(final) if final is not None else None
        for t in conv.turns:
            engine = t.streamed_ids
            prompt = self.render(conv, t.at, True)
            if final is None or prompt is None or not extends(prompt, final):
                total += agreement([math.inf] * len(engine))
                continue
            start = len(prompt)
            view = final[start : turn_end(final, start, self.closers)]
            n = aligned_prefix(view, engine)
            rescored = self.scorer.rescored(logits, final, start, n, t.sampling)
            deltas = logprob_deltas(t.streamed_logprobs[:n], rescored) + [math.inf] * (len(engine) - n)
            total += agreement(deltas)
        return total

    def _without_controls(
        self, conv: Conversation, at: int, prior_at: int
    ) -> tuple[Reference | None, list[int] | None, list[int] | None]:
        """(full, history, before) renders of ``conv`` with control-token strings removed from the texts
        of the history (messages up to the prior assistant turn)."""
        controls = self.fmt.control_strings

        def clean(text: str | None) -> str | None:
            for c in controls:
                text = text.replace(c, "") if text else text
            return text

        # only the history: the new messages are what the bridge renders
        messages = [
            m.model_copy(update={"content": clean(m.content) or "", "reasoning_content": clean(m.reasoning_content)})
            if i <= prior_at
            else m
            for i, m in enumerate(conv.messages)
        ]
        tools = conv.script.tools
        full = reference_render(self.fmt, messages[:at], tools, True)
        history = reference_render(self.fmt, messages[: prior_at + 1], tools, False)
        before = reference_render(self.fmt, messages[:prior_at], tools, True)
        return full, history.ids if history else None, before.ids if before else None

    def _bridges(self, report: ArmReport, conv: Conversation) -> tuple[int, int, int]:
        """(bridge failures, closer mismatches, stitched turns) of one stitch-arm conversation."""
        bf = closer = stitched = 0
        by_id = {t.message_id: t for t in conv.turns}
        for t in conv.turns:
            prior = by_id.get(t.stored.get("prior_message_id") or "")
            if t.stored.get("fork") or prior is None:
                continue
            stitched += 1
            full = self.reference(conv, t.at, True)
            history = self.render(conv, prior.at + 1, False)
            before = self.render(conv, prior.at, True)
            if full is None or history is None:
                # A text of the history holds a control string that the template interprets (a
                # </think> the model wrote without opening reasoning): the texts cannot be isolated.
                # The bridge (closer, new messages, generation prompt) does not depend on them, so it
                # is measured on the same conversation with control strings taken out of its texts.
                full, history, before = self._without_controls(conv, t.at, prior.at)
            expected = None
            if full is not None and history is not None:
                anchor = full.text_end(prior.at)
                expected = expected_stitch_suffix(full.ids, history, self.turn_ends, self.specials, before, anchor)
            reused = int(t.stored.get("reused_prefix_len") or 0)
            synthetic = int(t.stored.get("synthetic_token_count") or 0)
            if expected is None or bridge_mismatch(t.prompt, reused, synthetic, expected[1]):
                bf += 1
                self._example(report, conv, t, "bridge")
            closed = turn_closed(
                prior.completion, prior.stored.get("finish_reason"), prior.stored.get("stop_reason"), self.turn_ends
            )
            if expected is None or closer_mismatch(t.prompt, reused, synthetic, expected[0], closed):
                closer += 1
                self._example(report, conv, t, "synthetic closer")
        return bf, closer, stitched


# --------------------------------------------------------------------------------------------------
# Report
# --------------------------------------------------------------------------------------------------


def _ratio(value: float | None, counts: Sequence[int] | None = None) -> str:
    if value is None:
        return "n/a"
    text = f"{value:.3f}"
    return f"{text} ({counts[0]}/{counts[1]})" if counts else text


def _delta(value: float) -> str:
    return "inf" if math.isinf(value) else f"{value:.2e}"


def _finite(value: Any) -> Any:
    """JSON has no infinity: non-finite floats become the strings "inf" / "nan"."""
    if isinstance(value, float) and not math.isfinite(value):
        return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_finite(v) for v in value]
    return value


def _cache_rows(reports: dict[str, ArmReport]) -> list[tuple[str, str, str]]:
    """Prefix-cache rows (stitch, naive): "-" where the engine reports no cache hits."""
    block = next((r.cache_block for r in reports.values() if r.cache_block), None)

    def cell(report: ArmReport, which: str) -> str:
        c = report.cache
        if c is None:
            return "-"
        if which == "served":
            return _ratio(c.served, (c.cached, c.reusable))
        if which == "ideal":
            return _ratio(c.ideal_served, (c.ideal, c.reusable))
        return _ratio(c.mean_prompt_share)

    names = (
        ("served", "PC   cached / reusable prefix"),
        ("ideal", f"     block-rounded ideal (block {block or '?'})"),
        ("prompt", "     mean cached / prompt"),
    )
    return [(name, cell(reports["stitch"], which), cell(reports["naive"], which)) for which, name in names]


def targets(stitch: dict[str, Any]) -> list[tuple[str, str, bool]]:
    """(name, requirement, passed) for each target of the stitch arm."""
    closer = stitch["closer_mismatches"] or [0, 0]
    return [
        ("TEF", "= 0", stitch["TEF"] in (0, None)),
        ("EPB", "= 0", stitch["EPB"] in (0, None)),
        ("SPR", "= 1.0", stitch["SPR"] == 1.0),
        ("TFLA", f"max |delta| < {TFLA_TOLERANCE:g}", stitch["TFLA_max_abs_delta"] < TFLA_TOLERANCE),
        ("BF", "= 0 (and no closer mismatch)", stitch["BF"] in (0, None) and closer[0] == 0),
        ("FBR", "= 0", stitch["FBR"] in (0, None)),
    ]


def print_table(config: dict[str, Any], reports: dict[str, ArmReport]) -> None:
    m = {arm: r.metrics() for arm, r in reports.items()}
    s, n = m["stitch"], m["naive"]
    print(
        f"exactness: engine {config['engine']}, template {config['template']}, "
        f"{config['conversations']} conversations x "
        f"{config['turns']} user turns, seed {config['seed']}; conversations {config['drive_s']:.0f} s, "
        f"total {config['wall_s']:.0f} s (model cached)"
    )
    rows = [
        ("TEF  token exactness failure", _ratio(s["TEF"], s["TEF_counts"]), _ratio(n["TEF"], n["TEF_counts"])),
        ("EPB  extension property break", _ratio(s["EPB"], s["EPB_counts"]), _ratio(n["EPB"], n["EPB_counts"])),
        ("SPR  samples per rollout", _ratio(s["SPR"]), _ratio(n["SPR"])),
        (
            f"TFLA positions |delta| > {TFLA_TOLERANCE:g}",
            _ratio(s["TFLA_share"], s["TFLA_counts"]),
            _ratio(n["TFLA_share"], n["TFLA_counts"]),
        ),
        ("TFLA max |delta|", _delta(s["TFLA_max_abs_delta"]), _delta(n["TFLA_max_abs_delta"])),
        ("     top-k cut ties left out", str(s["TFLA_cut_ties"]), str(n["TFLA_cut_ties"])),
        ("BF   bridge fidelity failure", _ratio(s["BF"], s["BF_counts"]), "-"),
        ("     synthetic closer mismatch", _ratio(share(*s["closer_mismatches"]), s["closer_mismatches"]), "-"),
        ("FBR  full-render fallback rate", _ratio(s["FBR"], s["FBR_counts"]), f"{n['FBR']:.3f} (by construction)"),
        *_cache_rows(reports),
    ]
    print(f"\n{'metric':<36} {'stitch':>22} {'naive':>26}")
    for name, a, b in rows:
        print(f"{name:<36} {a:>22} {b:>26}")
    print(f"\n{'count':<36} {'stitch':>22} {'naive':>26}")
    for key in reports["stitch"].counts:
        print(f"{key.replace('_', ' '):<36} {reports['stitch'].counts[key]:>22} {reports['naive'].counts[key]:>26}")
    for arm, report in reports.items():
        for error, count in report.errors.items():
            print(f"  {arm}: {count} turn(s) failed: {error}")
    print()
    for name, requirement, passed in targets(s):
        print(f"{'PASS' if passed else 'FAIL'}  stitch {name} {requirement}")
    for line in reports["stitch"].examples:
        print(f"  stitch failure: {line}")


def stop_candidates(fmt: ChatFormat) -> list[int]:
    """Stop token ids the script draws from: " the" (if one token) and eos where eos is not a closer."""
    closers = PromptBuilder(fmt).shape.history_ends
    candidates = []
    the = fmt.encode_content(" the")
    if len(the) == 1:
        candidates.append(the[0])
    eos = fmt.tokenizer.eos_token_id
    if isinstance(eos, int) and eos not in closers:
        candidates.append(eos)
    return candidates


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--conversations", type=int, help="per template (default 20; 4 with --folder)")
    parser.add_argument("--turns", type=int, help="user messages per conversation (default 4; 3 with --folder)")
    parser.add_argument(
        "--template",
        default="chatml",
        help="chatml, llama3, a Jinja template file, or a real family of benchmarks/template_zoo (e.g. gpt-oss)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--api",
        choices=("chat", "openai"),
        default="chat",
        help="drive conversations through the chat API (default) or /v1/chat/completions with messages only",
    )
    parser.add_argument("--concurrency", type=int, default=8, help="conversations at a time per arm")
    parser.add_argument(
        "--engine",
        choices=("hf", "vllm"),
        default="hf",
        help="the workers' engine; vllm runs them with the python of $TOKENTRAIL_VLLM_VENV "
        "(default ~/.cache/tokentrail/vllm-venv, built by scripts/vllm_env.sh)",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    parser.add_argument("--model-dir", help="use this model directory (and its template) instead of a tiny model")
    parser.add_argument("--dump", type=Path, help="also write every conversation (messages, turns) to this JSON file")
    parser.add_argument("--load", type=Path, help="evaluate the conversations of a --dump file; drive nothing")
    parser.add_argument(
        "--closer-policy",
        choices=("keep", "history"),
        default="keep",
        help="the workers' --closer-policy (matters where a template's history closer is not its stop token)",
    )
    parser.add_argument(
        "--folder",
        help="run the stitch arm on every template of a folder, one row each: 'all' (every source of "
        "benchmarks/template_zoo), a source (llama.cpp, vllm) or a directory of .jinja files",
    )
    parser.add_argument("--only", help="with --folder: comma-separated template file stems or family names")
    parser.add_argument(
        "--train-steps",
        type=int,
        default=100,
        help="--folder and real families of --template: training steps of the tiny model (cached)",
    )
    args = parser.parse_args(argv)
    if args.folder:
        from benchmarks.exactness_zoo import FolderOptions
        from benchmarks.exactness_zoo import main as folder_main

        opts = FolderOptions(
            conversations=args.conversations or 4,
            turns=args.turns or 3,
            seed=args.seed,
            concurrency=args.concurrency,
            train_steps=args.train_steps,
            closer_policy=args.closer_policy,
        )
        return folder_main(args.folder, args.only, opts, args.json)
    args.conversations = args.conversations or 20
    args.turns = args.turns or 4

    loaded = json.loads(args.load.read_text()) if args.load else None
    if loaded is not None:
        args.template, args.seed, args.turns = loaded["template"], loaded["seed"], loaded["turns"]
        args.engine = loaded.get("engine", "hf")
    model_dir = args.model_dir or (loaded["model_dir"] if loaded else prepare_model(args.template, args.train_steps))
    fmt = ChatFormat.load(model_dir)
    closers = PromptBuilder(fmt).shape.history_ends
    candidates = stop_candidates(fmt)
    scripts = [Script.make(args.seed, i, args.turns, tuple(candidates)) for i in range(args.conversations)]

    start = time.monotonic()
    if loaded is not None:
        convs = load_conversations(loaded)
        args.conversations = len(convs["stitch"])
    else:
        with (
            tempfile.TemporaryDirectory(prefix="tokentrail-exactness-") as tmp,
            running_arms(
                model_dir, Path(tmp), args.concurrency, args.engine, ["--closer-policy", args.closer_policy]
            ) as url,
        ):
            convs = asyncio.run(drive(url, scripts, args.concurrency, api=args.api))
    driven = time.monotonic() - start
    _say(f"conversations finished in {driven:.0f} s; re-rendering and re-scoring...")
    if args.dump is not None:
        meta = {
            "template": args.template,
            "seed": args.seed,
            "turns": args.turns,
            "model_dir": model_dir,
            "engine": args.engine,
        }
        args.dump.write_text(json.dumps({**meta, "conversations": dump_conversations(convs)}, indent=1))
        _say(f"conversations written to {args.dump}")
    evaluator = Evaluator(fmt, Scorer(model_dir), infer_cache_block(convs))
    reports = {arm: evaluator.evaluate(arm, convs[arm]) for arm in ARMS}
    config = {
        "engine": args.engine,
        "template": args.template,
        "model_dir": model_dir,
        "conversations": args.conversations,
        "turns": args.turns,
        "seed": args.seed,
        "concurrency": args.concurrency,
        "api": args.api,
        "closer_policy": args.closer_policy,
        "stop_token_candidates": candidates,
        "closers": sorted(closers),
        "drive_s": round(driven, 1),
        "wall_s": round(time.monotonic() - start, 1),
    }
    if args.json:
        stitch = reports["stitch"].metrics()
        out = {
            "config": config,
            "arms": {arm: {"metrics": r.metrics(), "counts": r.counts} for arm, r in reports.items()},
            "targets": [{"metric": n, "target": req, "pass": ok} for n, req, ok in targets(stitch)],
            "stitch_failures": reports["stitch"].examples,
            "failed_turn_errors": {arm: r.errors for arm, r in reports.items()},
        }
        print(json.dumps(_finite(out), indent=2))
    else:
        print_table(config, reports)
    return 0


if __name__ == "__main__":
    sys.exit(main())
