"""Third-party RL clients against a real server and worker: verifiers 0.4.0's ``TrainClient`` (prime-rl's
way: the prompt rendered client-side with ``renderers``' DefaultRenderer from the tokenizer's chat
template, then ``POST /inference/v1/generate``) runs a multi-turn conversation, and every turn's
tokens the client got must be the ones tokentrail stored.

The client lives in an environment of its own (its pins are not the server's), built by
scripts/clients_env.sh at $TOKENTRAIL_CLIENTS_VENV or ~/.cache/tokentrail/clients-venv; the tests are
skipped when it does not exist (CI builds it: there they fail instead). The driver,
tests/clients/verifiers_train.py, runs with that environment's python and talks HTTP only.
"""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

from server.admin import issue_user_key
from server.settings import ServerSettings
from tests.stack import MODEL, serving

ROOT = Path(__file__).resolve().parents[1]
DRIVER = ROOT / "tests" / "clients" / "verifiers_train.py"
TURNS = 4
# The driver's conversation (tests/clients/verifiers_train.py): its system prompt and user turns.
SYSTEM = "You are a terse assistant."
USERS = [
    "Hello there. Tell me about the sea.",
    "And what about rivers?",
    "Say something about mountains.",
    "Last one: the sky?",
]


@pytest.fixture(scope="session")
def clients_python() -> Path:
    """The clients environment's python; requested first, so a test without it skips before any server
    starts."""
    venv = os.environ.get("TOKENTRAIL_CLIENTS_VENV") or str(Path.home() / ".cache" / "tokentrail" / "clients-venv")
    python = Path(venv) / "bin" / "python"
    if not python.exists():
        message = f"no clients environment at {venv}: build it with scripts/clients_env.sh"
        if os.environ.get("CI"):  # CI builds it (.ci/run): the tests must really run there
            pytest.fail(message)
        pytest.skip(message)
    return python


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
