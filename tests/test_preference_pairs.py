"""Preference pairs (``tokentrail export --pairs``): sibling drafts made through the real HTTP API with a
real tiny-model worker become pairs, from OA's draft choice (``message_evals``) and from posted rewards
and votes, in the native and TRL schemas, JSONL and Parquet; ``tokentrail verify`` re-scores both sides
and fails on a tampered logprob."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import pytest
from typer.testing import CliRunner

from server.settings import ServerSettings
from shared.pairs import PAIR_SCHEMA_NAME, PairRecord
from tests.stack import MODEL
from tests.test_e2e_embedded import login
from tests.test_multi_turn_api import finish, tokens
from tokentrail.cli import app

# OA's website sends every field of its form; unset ones are null (tests/test_oa_website.py)
OA_SAMPLING = {"top_k": None, "top_p": None, "typical_p": None, "temperature": None, "repetition_penalty": None}


def _prompter(url: str, headers: dict[str, str], chat: str, text: str) -> str:
    resp = httpx.post(
        f"{url}/chats/{chat}/prompter_message", json={"parent_id": None, "content": text}, headers=headers
    )
    assert resp.status_code == 200, resp.text
    return str(resp.json()["id"])


def _draft(url: str, headers: dict[str, str], chat: str, parent: str, **sampling: Any) -> str:
    """One OA draft, run to completion."""
    body = {
        "parent_id": parent,
        "model_config_name": MODEL,
        "sampling_parameters": {**OA_SAMPLING, "max_new_tokens": 8, **sampling},
        "system_prompt": None,
        "plugins": [],
        "used_plugin": None,
    }
    resp = httpx.post(f"{url}/chats/{chat}/assistant_message", json=body, headers=headers)
    assert resp.status_code == 200, resp.text
    mid = str(resp.json()["id"])
    finish(url, headers, chat, mid)
    return mid


def _post(url: str, path: str, body: dict[str, Any], headers: dict[str, str]) -> None:
    resp = httpx.post(f"{url}{path}", json=body, headers=headers)
    assert resp.status_code == 200, resp.text


@pytest.fixture(scope="module")
def stored(embedded_stack: str) -> dict[str, Any]:
    url = embedded_stack
    headers = login(url, "pp-alice")
    new_chat = lambda: httpx.post(f"{url}/chats", json={}, headers=headers).json()["id"]  # noqa: E731

    # OA's draft choice: two drafts of one prompt, the user picks the second
    choice = new_chat()
    parent = _prompter(url, headers, choice, "pick one")
    drafts = [_draft(url, headers, choice, parent), _draft(url, headers, choice, parent, temperature=0.8)]
    _post(url, f"/chats/{choice}/messages/{drafts[1]}/message_evals", {"inferior_message_ids": [drafts[0]]}, headers)

    # an environment scores four regenerations; d4 and d1 were also voted
    scored = new_chat()
    parent = _prompter(url, headers, scored, "solve it")
    d = [_draft(url, headers, scored, parent) for _ in range(4)]
    for mid, reward in ((d[0], 1.0), (d[1], 0.25), (d[2], 0.25)):
        _post(url, "/v1/rewards", {"message_id": mid, "reward": reward}, headers)
    for mid, score in ((d[3], 1), (d[0], -1)):
        _post(url, f"/chats/{scored}/messages/{mid}/votes", {"score": score}, headers)

    # the chat's system prompt changed between two drafts: their prompts differ
    changed = new_chat()
    parent = _prompter(url, headers, changed, "hello")
    first = _draft(url, headers, changed, parent)
    assert httpx.put(f"{url}/chats/{changed}", json={"system_prompt": "Be brief."}, headers=headers).status_code == 200
    second = _draft(url, headers, changed, parent)
    _post(url, f"/chats/{changed}/messages/{first}/message_evals", {"inferior_message_ids": [second]}, headers)
    return {"headers": headers, "choice": choice, "drafts": drafts, "scored": scored, "d": d, "changed": changed}


def _cli(*args: str, code: int = 0) -> str:
    result = CliRunner().invoke(app, list(args))
    assert result.exit_code == code, result.output
    return result.output


def _export(settings: ServerSettings, out: Path, *args: str) -> list[dict[str, Any]]:
    _cli("export", "--pairs", "--out", str(out), "--data-dir", str(settings.data_dir), "--quiet", *args)
    return [json.loads(line) for line in out.read_text().splitlines()]


def _rollouts(settings: ServerSettings, out: Path, chat: str) -> list[dict[str, Any]]:
    _cli("export", "--out", str(out), "--data-dir", str(settings.data_dir), "--quiet", "--chat", chat)
    return [json.loads(line) for line in out.read_text().splitlines()]


def _write(path: Path, records: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def test_draft_choice_is_a_pair_in_both_schemas_that_verifies(
    embedded_stack: str,
    embedded_settings: ServerSettings,
    stored: dict[str, Any],
    tmp_path: Path,
    tiny_model_dir: Path,
) -> None:
    url, headers = embedded_stack, stored["headers"]
    worse, better = stored["drafts"]
    (pair,) = _export(embedded_settings, tmp_path / "native.jsonl", "--chat", stored["choice"])
    record = PairRecord.model_validate(pair)
    assert pair["schema"] == PAIR_SCHEMA_NAME and pair["schema_version"] == 1
    assert (record.source, record.chosen.message_id, record.rejected.message_id) == ("message_eval", better, worse)
    assert record.pair_id == f"message_eval:{better}:{worse}" and record.chat_id == stored["choice"]
    assert record.model_name == MODEL and record.user_id == "pp-alice"
    rollouts = {r["leaf_message_id"]: r for r in _rollouts(embedded_settings, tmp_path / "r.jsonl", stored["choice"])}
    for side, mid in ((record.chosen, better), (record.rejected, worse)):
        read = tokens(url, headers, stored["choice"], mid)
        assert record.prompt_ids == read["prompt_token_ids"]  # both drafts' stored prompt, token for token
        assert side.completion_ids == read["completion_token_ids"]
        assert side.logprobs == pytest.approx(read["logprobs"], abs=0)
        assert side.content == read["content"] and side.policy_versions == [(0, 0)] and side.reward is None
        rollout = rollouts[mid]
        assert (record.tokenizer_hash, record.template_hash) == (rollout["tokenizer_hash"], rollout["template_hash"])
        assert rollout["turns"][-1]["logprobs"] == pair["chosen" if mid == better else "rejected"]["logprobs"]
    assert record.chosen.sampling["temperature"] == 0.8 and record.policy_paths == {"0": None}

    (trl,) = _export(embedded_settings, tmp_path / "trl.jsonl", "--chat", stored["choice"], "--schema", "trl")
    for name in ("prompt", "chosen", "rejected"):
        assert trl[f"{name}_input_ids"] == trl[f"{name}_ids"]
    assert trl["prompt_ids"] == pair["prompt_ids"] and trl["prompt"] == ""
    assert trl["chosen_ids"] == pair["chosen"]["completion_ids"] and trl["chosen"] == pair["chosen"]["content"]
    assert trl["rejected_ids"] == pair["rejected"]["completion_ids"]
    assert trl["chosen_logps"] == pair["chosen"]["logprobs"] and trl["rejected_logps"] == pair["rejected"]["logprobs"]
    assert trl["tokentrail"]["pair_id"] == pair["pair_id"] and trl["tokentrail"]["chosen"]["message_id"] == better

    for path in (tmp_path / "native.jsonl", tmp_path / "trl.jsonl"):
        report = _cli("verify", str(path), "--model", str(tiny_model_dir))
        assert "PASS" in report and "preference pairs:            1" in report, report
        assert "samples checked:             2" in report

    tampered = dict(
        pair,
        chosen={**pair["chosen"], "logprobs": [pair["chosen"]["logprobs"][0] + 0.01, *pair["chosen"]["logprobs"][1:]]},
    )
    bad = _cli("verify", str(_write(tmp_path / "bad.jsonl", [tampered])), "--model", str(tiny_model_dir), code=1)
    assert "FAIL" in bad and "|dlogprob| > 0.0001:         1" in bad
    trl_bad = dict(trl, rejected_logps=[*trl["rejected_logps"][:-1], trl["rejected_logps"][-1] - 0.01])
    bad = _cli("verify", str(_write(tmp_path / "bad_trl.jsonl", [trl_bad])), "--model", str(tiny_model_dir), code=1)
    assert "FAIL" in bad
    short = dict(trl, chosen_logps=trl["chosen_logps"][:-1])  # a logprob missing: a structural failure
    bad = _cli("verify", str(_write(tmp_path / "short.jsonl", [short])), "--model", str(tiny_model_dir), code=1)
    assert "loss-mask mismatches:        1" in bad and "logprobs for" in bad


def test_parquet_pairs_have_typed_lists_and_verify(
    embedded_settings: ServerSettings, stored: dict[str, Any], tmp_path: Path, tiny_model_dir: Path
) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    jsonl = {p["pair_id"]: p for p in _export(embedded_settings, tmp_path / "p.jsonl", "--chat", stored["scored"])}
    for schema in ("tokentrail", "trl"):
        out = tmp_path / f"{schema}.parquet"
        _cli("export", "--pairs", "--schema", schema, "--format", "parquet", "--out", str(out),
             "--data-dir", str(embedded_settings.data_dir), "--chat", stored["scored"], "--quiet")  # fmt: skip
        table = pq.read_table(out)
        assert table.num_rows == len(jsonl) == 3
        if schema == "trl":
            for name in ("prompt_ids", "chosen_ids", "rejected_input_ids"):
                assert table.schema.field(name).type == pa.list_(pa.int64())
            assert table.schema.field("chosen_logps").type == pa.list_(pa.float64())
            rows = {r["tokentrail"]["pair_id"]: r for r in table.to_pylist()}
            assert all(rows[k]["chosen_ids"] == p["chosen"]["completion_ids"] for k, p in jsonl.items())
        else:
            chosen = table.schema.field("chosen").type
            assert chosen.field("completion_ids").type == pa.list_(pa.int64())
            assert chosen.field("logprobs").type == pa.list_(pa.float64())
            assert table.schema.field("prompt_ids").type == pa.list_(pa.int64())
        report = _cli("verify", str(out), "--model", str(tiny_model_dir))
        assert "PASS" in report and "preference pairs:            3" in report, report


def test_rewarded_and_voted_siblings_pair_higher_over_lower(
    embedded_stack: str, embedded_settings: ServerSettings, stored: dict[str, Any], tmp_path: Path
) -> None:
    d = stored["d"]
    pairs = _export(embedded_settings, tmp_path / "r.jsonl", "--chat", stored["scored"])
    got = {(p["source"], p["chosen"]["message_id"], p["rejected"]["message_id"]) for p in pairs}
    # rewards: d1 over d2 and d3, their tie makes none; votes: d4 over d1 (the environment's reward is
    # compared with rewards only: d4 has none, so no reward pair with it)
    assert got == {("reward", d[0], d[1]), ("reward", d[0], d[2]), ("vote", d[3], d[0])}
    by_id = {p["pair_id"]: p for p in pairs}
    assert (
        by_id[f"reward:{d[0]}:{d[1]}"]["chosen"]["reward"],
        by_id[f"reward:{d[0]}:{d[1]}"]["rejected"]["reward"],
    ) == (1.0, 0.25)
    assert (by_id[f"vote:{d[3]}:{d[0]}"]["chosen"]["reward"], by_id[f"vote:{d[3]}:{d[0]}"]["rejected"]["reward"]) == (
        1.0,
        -1.0,
    )
    assert len({json.dumps(p["prompt_ids"]) for p in pairs}) == 1  # one parent, one prompt

    # filters
    assert _export(embedded_settings, tmp_path / "f.jsonl", "--chat", stored["scored"], "--model", "nope") == []
    assert _export(embedded_settings, tmp_path / "f.jsonl", "--chat", stored["scored"], "--since", "2999-01-01") == []
    assert len(_export(embedded_settings, tmp_path / "f.jsonl", "--chat", stored["scored"], "--min-version", "0")) == 3
    assert _export(embedded_settings, tmp_path / "f.jsonl", "--chat", stored["scored"], "--min-version", "1") == []
    mine = _export(embedded_settings, tmp_path / "f.jsonl", "--user", "pp-alice")
    assert {p["chat_id"] for p in mine} == {stored["choice"], stored["scored"]}


def test_drafts_with_different_prompts_are_skipped_and_counted(
    embedded_settings: ServerSettings, stored: dict[str, Any], tmp_path: Path
) -> None:
    out = tmp_path / "c.jsonl"
    args = ["export", "--pairs", "--out", str(out), "--data-dir", str(embedded_settings.data_dir)]
    result = CliRunner().invoke(app, [*args, "--chat", stored["changed"]])
    assert result.exit_code == 0, result.output
    assert out.read_text() == "" and "exported 0 pairs (skipped: 1 different_prompt)" in result.output


def test_bad_pair_requests_are_refused(
    embedded_stack: str, embedded_settings: ServerSettings, stored: dict[str, Any], tmp_path: Path
) -> None:
    base = ["export", "--out", str(tmp_path / "x.jsonl"), "--data-dir", str(embedded_settings.data_dir)]
    assert "is a rollout schema" in _cli(*base, "--pairs", "--schema", "verl", code=2)
    assert "add --pairs" in _cli(*base, "--schema", "trl", code=2)
    assert "rollout options" in _cli(*base, "--pairs", "--rated-only", code=2)
    assert not (tmp_path / "x.jsonl").exists()

    key = _cli("admin", "create-user", "pp-admin", "--admin", "--data-dir", str(embedded_settings.data_dir)).strip()
    admin = {"Authorization": f"Bearer {key}"}
    resp = httpx.get(
        f"{embedded_stack}/admin/export",
        params={"pairs": "true", "chat": stored["choice"], "schema": "trl"},
        headers=admin,
    )
    assert resp.status_code == 200 and resp.headers["content-type"].startswith("application/x-ndjson")
    (row,) = [json.loads(line) for line in resp.text.splitlines()]
    assert row["chosen_ids"] and row["tokentrail"]["chosen"]["message_id"] == stored["drafts"][1]
    for params in ({"pairs": "true", "schema": "verl"}, {"pairs": "true", "rated_only": "true"}):
        bad = httpx.get(f"{embedded_stack}/admin/export", params=params, headers=admin)
        assert bad.status_code == 400 and bad.json()["code"] == "bad_request", bad.text


def test_sides_on_different_policy_versions_verify_under_each(
    tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path
) -> None:
    """A draft on version 0, the weights pushed, a draft on version 1: each side is re-scored under its
    own version's weights (the checkpoint the export names), and fails under the wrong ones."""
    from benchmarks.policy_check import perturbed_checkpoint
    from server.admin import issue_user_key
    from tests.stack import hf_stack

    root = tmp_path_factory.mktemp("pairs-versions")
    ckpt = perturbed_checkpoint(tiny_model_dir, root / "v1", seed=1)
    with hf_stack(root / "data", tiny_model_dir) as (url, settings):
        admin = {"Authorization": f"Bearer {issue_user_key(settings, 'pp-trainer', admin=True)}"}
        user = {"Authorization": f"Bearer {issue_user_key(settings, 'pp-player')}"}
        chat = httpx.post(f"{url}/chats", json={}, headers=user).json()["id"]
        parent = _prompter(url, user, chat, "again")
        old = _draft(url, user, chat, parent)
        push = {"path": str(ckpt), "version": 1, "mode": "drain"}
        resp = httpx.post(f"{url}/admin/models/{MODEL}/weights", json=push, headers=admin, timeout=120)
        assert resp.status_code == 200, resp.text
        new = _draft(url, user, chat, parent)
        _post(url, f"/chats/{chat}/messages/{new}/message_evals", {"inferior_message_ids": [old]}, user)

        out = root / "v.jsonl"
        (pair,) = _export(settings, out)
        assert pair["chosen"]["policy_versions"] == [[0, 1]] and pair["rejected"]["policy_versions"] == [[0, 0]]
        assert pair["policy_paths"] == {"0": None, "1": str(ckpt)}
        assert _export(settings, root / "none.jsonl", "--min-version", "1") == []
        report = _cli("verify", str(out), "--model", str(tiny_model_dir))
        assert "PASS" in report and "policy versions:             0 (8 positions), 1 (8 positions)" in report
        wrong = _cli("verify", str(out), "--model", str(tiny_model_dir), "--weights", f"1={tiny_model_dir}", code=1)
        assert "FAIL" in wrong and "version 1" in wrong
