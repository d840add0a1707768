"""Export and verify by policy version: a real server with an hf worker, two weights pushes (one in flight
during a long reply), then exports that carry each token's version and each version's checkpoint, the
version filters (CLI and ``GET /admin/export``), trainer records, and ``tokentrail verify`` re-scoring each
span under its own version's weights (and failing under the wrong ones)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from typer.testing import CliRunner

from benchmarks.policy_check import perturbed_checkpoint
from server.admin import issue_user_key
from server.export.rollouts import build_samples
from server.settings import ServerSettings
from shared.rollout import Rollout
from shared.rollout_adapters import SCHEMAS, adapt, to_native_samples
from tests.test_e2e_embedded import turn
from tests.test_export import export, run_cli
from tests.test_weights import _first_token, _message, _push, _reply, stack
from tokentrail.cli import app


@pytest.fixture(scope="module")
def pushed(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> Iterator[dict[str, Any]]:
    """A two-turn chat whose turns ran on versions 0 and 1; a reply on version 0 only; a long reply
    switched from version 1 to 2 in flight; a reply on version 2."""
    root = tmp_path_factory.mktemp("export-versions")
    ckpt = {
        1: perturbed_checkpoint(tiny_model_dir, root / "v1", seed=1),
        2: perturbed_checkpoint(tiny_model_dir, root / "v2", 2),
    }
    with stack(root / "data", tiny_model_dir) as (url, settings, _):
        admin = {"Authorization": f"Bearer {issue_user_key(settings, 'trainer', admin=True)}"}
        user = {"Authorization": f"Bearer {issue_user_key(settings, 'player')}"}

        chat = httpx.post(f"{url}/chats", json={}, headers=user).json()["id"]
        _, a1 = turn(url, user, chat, None, "one", max_new_tokens=8, ignore_eos=True)
        assert _message(url, user, chat, a1["id"])["policy_versions"] == [[0, 0]]
        old = _reply(url, user, 8)
        assert _message(url, user, *old)["policy_versions"] == [[0, 0]]

        assert _push(url, admin, ckpt[1], 1).status_code == 200
        _, a2 = turn(url, user, chat, a1["id"], "two", max_new_tokens=8, ignore_eos=True)
        assert _message(url, user, chat, a2["id"])["policy_versions"] == [[0, 1]]

        long = _reply(url, user, 200)
        _first_token(url, user, *long)
        resp = _push(url, admin, ckpt[2], 2, mode="inflight")
        assert resp.status_code == 200, resp.text
        spans = _message(url, user, *long)["policy_versions"]
        assert [v for _, v in spans] == [1, 2], spans

        new = _reply(url, user, 8)
        assert _message(url, user, *new)["policy_versions"] == [[0, 2]]
        yield {
            "url": url,
            "settings": settings,
            "admin": admin,
            "ckpt": ckpt,
            "chat": (chat, a2["id"]),
            "old": old[1],
            "long": long[1],
            "long_switch": spans[1][0],
            "new": new[1],
        }


def _by_leaf(rollouts: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {r["leaf_message_id"]: r for r in rollouts}


def _leaves(pushed: dict[str, Any], tmp_path: Path, *args: str) -> set[str]:
    return set(_by_leaf(export(pushed["settings"], tmp_path / "f.jsonl", *args)))


def test_native_export_carries_versions_and_paths(pushed: dict[str, Any], tmp_path: Path) -> None:
    rollouts = _by_leaf(export(pushed["settings"], tmp_path / "all.jsonl"))
    ckpt = {str(v): str(p) for v, p in pushed["ckpt"].items()}
    assert set(rollouts) == {pushed["chat"][1], pushed["old"], pushed["long"], pushed["new"]}
    for r in rollouts.values():
        Rollout.model_validate(r)
        assert r["schema_version"] == 1

    # two turns on two versions, one sample: version 0 on the first completion, 1 on the second
    two = rollouts[pushed["chat"][1]]
    assert [t["policy_versions"] for t in two["turns"]] == [[[0, 0]], [[0, 1]]]
    assert two["policy_paths"] == {"0": None, "1": ckpt["1"]}
    (sample,) = two["samples"]
    (s1, e1), (s2, e2) = sample["turn_spans"]
    versions = sample["policy_versions"]
    assert len(versions) == len(sample["token_ids"]) == len(sample["loss_mask"])
    assert versions == [-1] * s1 + [0] * (e1 - s1) + [-1] * (s2 - e1) + [1] * (e2 - s2)
    assert all((v >= 0) == bool(m) for v, m in zip(versions, sample["loss_mask"], strict=True))

    # a reply switched in flight: both spans, and the switch at the same token of the sample
    long = rollouts[pushed["long"]]
    k = pushed["long_switch"]
    assert long["turns"][0]["policy_versions"] == [[0, 1], [k, 2]]
    assert long["policy_paths"] == {"1": ckpt["1"], "2": ckpt["2"]}
    (sample,) = long["samples"]
    start, end = sample["turn_spans"][0]
    assert sample["policy_versions"][start:end] == [1] * k + [2] * (end - start - k)

    assert rollouts[pushed["old"]]["policy_paths"] == {"0": None}
    assert rollouts[pushed["new"]]["turns"][0]["policy_versions"] == [[0, 2]]
    assert rollouts[pushed["new"]]["policy_paths"] == {"2": ckpt["2"]}


def test_version_filters_on_the_cli_and_over_http(pushed: dict[str, Any], tmp_path: Path) -> None:
    two, old, long, new = pushed["chat"][1], pushed["old"], pushed["long"], pushed["new"]
    cases = {
        (): {two, old, long, new},
        ("--min-version", "0"): {two, old, long, new},
        ("--min-version", "1"): {long, new},  # the two-turn chat has a version-0 turn
        ("--min-version", "2"): {new},  # the long reply began on version 1
        ("--min-version", "3"): set(),
        ("--max-staleness", "0"): {new},  # newest registered: 2
        ("--max-staleness", "1"): {long, new},
        ("--max-staleness", "2"): {two, old, long, new},
        ("--min-version", "1", "--max-staleness", "0"): {new},
    }
    for args, expected in cases.items():
        assert _leaves(pushed, tmp_path, *args) == expected, args
        params = {a.removeprefix("--").replace("-", "_"): v for a, v in zip(args[::2], args[1::2], strict=True)}
        resp = httpx.get(f"{pushed['url']}/admin/export", params=params, headers=pushed["admin"])
        assert resp.status_code == 200, resp.text
        assert {json.loads(line)["leaf_message_id"] for line in resp.text.splitlines()} == expected, params
    resp = httpx.get(f"{pushed['url']}/admin/export", params={"min_version": -1}, headers=pushed["admin"])
    assert resp.status_code == 422
    result = CliRunner().invoke(app, ["export", "--out", str(tmp_path / "x.jsonl"), "--max-staleness", "-1"])
    assert result.exit_code == 2


def test_trainer_records_carry_versions(pushed: dict[str, Any], tmp_path: Path) -> None:
    settings: ServerSettings = pushed["settings"]
    two, long = pushed["chat"][1], pushed["long"]
    k = pushed["long_switch"]

    verl = {r["extra_fields"]["rollout_id"]: r for r in export(settings, tmp_path / "verl.jsonl", "--schema", "verl")}
    rec = verl[long]
    assert len(rec["extra_fields"]["policy_versions"]) == len(rec["response_ids"])
    assert rec["extra_fields"]["policy_versions"] == [1] * k + [2] * (len(rec["response_ids"]) - k)
    assert rec["extra_fields"]["policy_paths"] == {"1": str(pushed["ckpt"][1]), "2": str(pushed["ckpt"][2])}
    rec = verl[two]
    versions = [v for v, m in zip(rec["extra_fields"]["policy_versions"], rec["response_mask"], strict=True) if m]
    assert sorted(set(versions)) == [0, 1] and -1 in rec["extra_fields"]["policy_versions"]  # the bridge

    slime = {r["metadata"]["rollout_id"]: r for r in export(settings, tmp_path / "slime.jsonl", "--schema", "slime")}
    assert slime[long]["weight_versions"] == ["1", "2"]
    assert slime[two]["weight_versions"] == ["0", "1"]
    assert slime[pushed["new"]]["weight_versions"] == ["2"]

    marin = export(settings, tmp_path / "marin.jsonl", "--schema", "marin")
    steps = {r["env_example_id"]: [] for r in marin}
    for r in marin:
        steps[r["env_example_id"]].append(r["metadata"]["weight_step"])
    assert steps[two] == [0, 1] and steps[long] == [1]  # marin: the version of the turn's first token


def test_verify_rescores_each_span_under_its_own_weights(
    pushed: dict[str, Any], tmp_path: Path, tiny_model_dir: Path
) -> None:
    ckpt = pushed["ckpt"]
    out = tmp_path / "v.jsonl"
    rollouts = export(pushed["settings"], out)
    report = run_cli("verify", str(out), "--model", str(tiny_model_dir))
    assert "PASS" in report and "versions without weights:    none" in report
    for v in (0, 1, 2):
        assert f"{v} (" in report.split("policy versions:")[1].splitlines()[0]

    # the wrong weights for version 2 (version 1's): its tokens no longer re-score
    result = CliRunner().invoke(app, ["verify", str(out), "--model", str(tiny_model_dir), "--weights", f"2={ckpt[1]}"])
    assert result.exit_code == 1 and "FAIL" in result.output, result.output
    assert f"version 2 ({ckpt[1]})" in result.output
    # a checkpoint moved since the export: its version fails, named, until --weights points at it
    moved = [json.loads(json.dumps(r).replace(str(ckpt[2]), str(tmp_path / "gone"))) for r in rollouts]
    out_moved = tmp_path / "moved.jsonl"
    out_moved.write_text("".join(json.dumps(r) + "\n" for r in moved))
    result = CliRunner().invoke(app, ["verify", str(out_moved), "--model", str(tiny_model_dir)])
    assert result.exit_code == 1 and "version 2: cannot read" in result.output, result.output
    assert "PASS" in run_cli("verify", str(out_moved), "--model", str(tiny_model_dir), "--weights", f"2={ckpt[2]}")

    # a version the export names no checkpoint for, and none given: it fails, naming the version
    for r in moved:
        r["policy_paths"] = {k: None for k in r["policy_paths"]}
    out_moved.write_text("".join(json.dumps(r) + "\n" for r in moved))
    result = CliRunner().invoke(app, ["verify", str(out_moved), "--model", str(tiny_model_dir)])
    assert result.exit_code == 1, result.output
    assert "versions without weights:    1, 2" in result.output
    assert "pass --weights 1=DIR" in result.output

    # a trainer schema that carries per-token versions and the paths (verl), in Parquet
    pq_out = tmp_path / "verl.parquet"
    run_cli("export", "--out", str(pq_out), "--format", "parquet", "--schema", "verl",
            "--data-dir", str(pushed["settings"].data_dir), "--quiet")  # fmt: skip
    assert "PASS" in run_cli("verify", str(pq_out), "--model", str(tiny_model_dir), "--schema", "verl")

    bad = CliRunner().invoke(app, ["verify", str(out), "--model", str(tiny_model_dir), "--weights", "two=/x"])
    assert bad.exit_code == 2 and "N=DIR" in bad.output


# --- adapters without a server: every schema maps the versions back ---------------------------------


def _native(turns: list[tuple[list[int], list[int], list[list[int]]]]) -> dict[str, Any]:
    rows = [
        {
            "message_id": f"m{i}",
            "prompt_delta_ids": prompt,
            "completion_ids": completion,
            "logprobs": [-0.5] * len(completion),
            "finish_reason": "stop",
            "prompt_length": len(prompt),
            "sampling": {"temperature": 1.0},
            "policy_versions": spans,
            "tool_calls": None,
        }
        for i, (prompt, completion, spans) in enumerate(turns)
    ]
    seqs = [(prompt, completion) for prompt, completion, _ in turns]
    return {
        "schema": "tokentrail",
        "rollout_id": "leaf",
        "chat_id": "chat",
        "turns": rows,
        "samples": build_samples(seqs, rows),
        "reward": 1.0,
        "policy_paths": {"3": "/ckpt/3", "4": "/ckpt/4"},
    }


def test_every_schema_maps_versions_back() -> None:
    p, c1, u, c2 = [10, 11, 12], [20, 21, 22], [30, 31], [40, 41]
    r = _native([(p, c1, [[0, 3], [2, 4]]), (p + c1 + u, c2, [[0, 4]])])
    (sample,) = r["samples"]
    assert sample["policy_versions"] == [-1, -1, -1, 3, 3, 4, -1, -1, 4, 4]
    for schema in SCHEMAS:
        views = [v for rec in adapt(json.loads(json.dumps(r)), schema) for v in to_native_samples(rec, schema)]
        if schema == "marin":  # one version per turn: its first token's
            assert [v["policy_versions"] for v in views] == [[-1, -1, -1, 3, 3, 3], [-1] * 8 + [4, 4]]
        else:
            assert [v["policy_versions"] for v in views] == [sample["policy_versions"]], schema
        carries_paths = schema in ("tokentrail", "verl", "slime", "nemo-rl")
        assert all(v["policy_paths"] == ({"3": "/ckpt/3", "4": "/ckpt/4"} if carries_paths else None) for v in views)
    assert adapt(r, "slime")[0]["weight_versions"] == ["3", "4", "4"]
    assert adapt(r, "openrlhf")[0]["policy_versions"] == sample["policy_versions"]
    assert adapt(r, "skyrl")[0]["policy_versions"] == [sample["policy_versions"][3:]]
    # a rollout without versions gives records without them
    del r["samples"][0]["policy_versions"]
    assert "policy_versions" not in adapt(r, "verl")[0]["extra_fields"]
    assert adapt(r, "slime")[0]["weight_versions"] == []
    assert adapt(r, "marin")[0]["metadata"]["weight_step"] == -1
    assert to_native_samples(adapt(r, "prime-rl")[0], "prime-rl")[0]["policy_versions"] is None
