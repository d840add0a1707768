"""Export and verify: conversations made through the real API become rollouts that re-score exactly."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest
from typer.testing import CliRunner

from server.settings import ServerSettings
from shared.rollout import Rollout
from tests.test_api_errors import expect
from tests.test_e2e_embedded import login, turn
from tests.test_multi_turn_api import finish
from tokentrail.cli import app


@pytest.fixture(scope="module")
def stored(embedded_stack: str) -> dict[str, Any]:
    """One user's chats: a 3-turn chat with a regenerated second turn (two leaves), votes, and an
    opted-out chat; plus another user's chat."""
    url = embedded_stack
    headers = login(url, "ex-alice")
    chat_id = httpx.post(f"{url}/chats", json={"system_prompt": "Be kind."}, headers=headers).json()["id"]
    _, a1 = turn(url, headers, chat_id, None, "one", max_new_tokens=5, temperature=0.7, top_k=50)
    finish(url, headers, chat_id, a1["id"])
    p2, a2 = turn(url, headers, chat_id, a1["id"], "two", max_new_tokens=7, temperature=1.3, top_p=0.9)
    finish(url, headers, chat_id, a2["id"])
    regen = httpx.post(
        f"{url}/chats/{chat_id}/assistant_message",
        json={"parent_id": p2["id"], "model_config_name": "tiny", "sampling_parameters": {"max_new_tokens": 6}},
        headers=headers,
    ).json()
    finish(url, headers, chat_id, regen["id"])
    _, a3 = turn(url, headers, chat_id, a2["id"], "three", max_new_tokens=4, repetition_penalty=1.3)
    finish(url, headers, chat_id, a3["id"])
    for mid, score in ((a1["id"], 1), (a2["id"], -1), (regen["id"], 0)):
        resp = httpx.post(f"{url}/chats/{chat_id}/messages/{mid}/votes", json={"score": score}, headers=headers)
        assert resp.status_code == 200, resp.text
    hidden = httpx.post(f"{url}/chats", json={}, headers=headers).json()["id"]
    _, h1 = turn(url, headers, hidden, None, "private")
    finish(url, headers, hidden, h1["id"])
    assert httpx.put(f"{url}/chats/{hidden}", json={"allow_data_use": False}, headers=headers).status_code == 200
    bob = login(url, "ex-bob")
    bob_chat = httpx.post(f"{url}/chats", json={}, headers=bob).json()["id"]
    _, b1 = turn(url, bob, bob_chat, None, "bob here")
    finish(url, bob, bob_chat, b1["id"])
    return {"chat": chat_id, "a1": a1["id"], "a2": a2["id"], "regen": regen["id"], "a3": a3["id"], "hidden": hidden}


def run_cli(*args: str) -> str:
    result = CliRunner().invoke(app, list(args))
    assert result.exit_code == 0, result.output
    return result.output


def export(settings: ServerSettings, out: Path, *args: str) -> list[dict[str, Any]]:
    run_cli("export", "--out", str(out), "--data-dir", str(settings.data_dir), "--quiet", *args)
    return [json.loads(line) for line in out.read_text().splitlines()]


def test_one_rollout_per_leaf_with_exact_samples(
    embedded_settings: ServerSettings, stored: dict[str, Any], tmp_path: Path
) -> None:
    rollouts = export(embedded_settings, tmp_path / "all.jsonl", "--user", "ex-alice")
    by_leaf = {r["leaf_message_id"]: r for r in rollouts}
    assert set(by_leaf) == {stored["regen"], stored["a3"]}  # the opted-out chat is not exported
    main = Rollout.model_validate(by_leaf[stored["a3"]])
    assert [t.message_id for t in main.turns] == [stored["a1"], stored["a2"], stored["a3"]]
    assert main.system_prompt == "Be kind." and main.user_id == "ex-alice"
    assert len(main.samples) == 1  # no fork: one sample
    sample = main.samples[0]
    assert sample.turn_indices == [0, 1, 2]
    for turn_rec, (start, end) in zip(main.turns, sample.turn_spans, strict=True):
        assert sample.token_ids[start:end] == turn_rec.completion_ids
        assert sample.logprobs[start:end] == pytest.approx([lp or 0.0 for lp in turn_rec.logprobs], abs=0)
    assert sum(sample.loss_mask) == sum(len(t.completion_ids) for t in main.turns)
    assert sample.prompt_length == main.turns[0].prompt_length
    assert all(lp == 0.0 for lp, m in zip(sample.logprobs, sample.loss_mask, strict=True) if not m)
    # later prompt deltas are the bridge (plus a synthetic closer when a turn was cut by length)
    assert main.turns[1].prompt_delta_ids == sample.token_ids[sample.turn_spans[0][1] : sample.turn_spans[1][0]]
    assert (
        main.turns[1].synthetic_closer_ids == main.turns[1].prompt_delta_ids[: len(main.turns[1].synthetic_closer_ids)]
    )
    # rewards: votes per turn, rollout reward = last rated turn
    assert [t.reward for t in main.turns] == [1.0, -1.0, None]
    assert main.reward == -1.0
    regen = Rollout.model_validate(by_leaf[stored["regen"]])
    assert regen.turns[0].message_id == stored["a1"] and regen.reward == 0.0
    assert (
        regen.samples[0].token_ids[: regen.samples[0].turn_spans[0][1]] == sample.token_ids[: sample.turn_spans[0][1]]
    )


def test_filters_and_reward_rules(embedded_settings: ServerSettings, stored: dict[str, Any], tmp_path: Path) -> None:
    def leaves(*args: str) -> set[str]:
        return {r["leaf_message_id"] for r in export(embedded_settings, tmp_path / "f.jsonl", *args)}

    assert leaves("--chat", stored["chat"]) == {stored["regen"], stored["a3"]}
    assert leaves("--chat", stored["hidden"]) == set()
    assert leaves("--user", "ex-alice", "--min-score", "0") == {stored["regen"]}
    assert leaves("--user", "ex-alice", "--rated-only", "--reward-rule", "leaf") == {stored["regen"], stored["a3"]}
    assert stored["a3"] not in leaves("--user", "ex-alice", "--reward-rule", "leaf", "--min-score", "-1")
    assert leaves("--user", "ex-alice", "--model", "nope") == set()
    assert leaves("--user", "ex-alice", "--since", "2999-01-01") == set()
    assert leaves("--user", "ex-alice", "--until", "2999-01-01") == {stored["regen"], stored["a3"]}
    mean = export(embedded_settings, tmp_path / "m.jsonl", "--chat", stored["chat"], "--reward-rule", "mean")
    assert {r["leaf_message_id"]: r["reward"] for r in mean}[stored["a3"]] == 0.0


def test_export_verifies_and_parquet_matches(
    embedded_settings: ServerSettings, stored: dict[str, Any], tmp_path: Path, tiny_model_dir: Path
) -> None:
    out = tmp_path / "v.jsonl"
    export(embedded_settings, out, "--user", "ex-alice")
    report = run_cli("verify", str(out), "--model", str(tiny_model_dir))
    assert "PASS" in report and "loss-mask mismatches:        0" in report
    import pyarrow.parquet as pq

    pq_out = tmp_path / "v.parquet"
    run_cli("export", "--out", str(pq_out), "--format", "parquet", "--data-dir", str(embedded_settings.data_dir),
            "--user", "ex-alice", "--quiet")  # fmt: skip
    rows = pq.read_table(pq_out).to_pylist()
    jsonl = {r["rollout_id"]: r for r in (json.loads(x) for x in out.read_text().splitlines())}
    assert {r["rollout_id"] for r in rows} == set(jsonl)
    for row in rows:
        assert row["samples"][0]["token_ids"] == jsonl[row["rollout_id"]]["samples"][0]["token_ids"]
    assert "PASS" in run_cli("verify", str(pq_out), "--model", str(tiny_model_dir))


def test_verify_fails_on_tampered_logprobs(
    embedded_settings: ServerSettings, stored: dict[str, Any], tmp_path: Path, tiny_model_dir: Path
) -> None:
    out = tmp_path / "t.jsonl"
    rollouts = export(embedded_settings, out, "--chat", stored["chat"])
    rollouts[0]["samples"][0]["logprobs"][rollouts[0]["samples"][0]["turn_spans"][0][0]] += 0.01
    out.write_text("\n".join(json.dumps(r) for r in rollouts) + "\n")
    result = CliRunner().invoke(app, ["verify", str(out), "--model", str(tiny_model_dir)])
    assert result.exit_code == 1 and "FAIL" in result.output


def test_votes_validation(embedded_stack: str, stored: dict[str, Any]) -> None:
    headers = login(embedded_stack, "ex-alice")
    path = f"{embedded_stack}/chats/{stored['chat']}/messages/{stored['a1']}/votes"
    expect(httpx.post(path, json={"score": 2}, headers=headers), 422, "validation_error")
    mallory = login(embedded_stack, "ex-mallory")
    expect(httpx.post(path, json={"score": 1}, headers=mallory), 404, "chat_not_found")


def test_admin_export_endpoint(
    embedded_stack: str, embedded_settings: ServerSettings, stored: dict[str, Any], tmp_path: Path
) -> None:
    key = run_cli("admin", "create-user", "ex-admin", "--admin", "--data-dir", str(embedded_settings.data_dir)).strip()
    resp = httpx.get(
        f"{embedded_stack}/admin/export", params={"user": "ex-alice"}, headers={"Authorization": f"Bearer {key}"}
    )
    assert resp.status_code == 200 and resp.headers["content-type"].startswith("application/x-ndjson")
    leaves = {json.loads(line)["leaf_message_id"] for line in resp.text.splitlines()}
    assert leaves == {stored["regen"], stored["a3"]}
    # the bytes tokentrail export writes, in every schema (the same page path, in the server's process)
    for schema in ("tokentrail", "verl", "slime"):
        resp = httpx.get(
            f"{embedded_stack}/admin/export", params={"schema": schema}, headers={"Authorization": f"Bearer {key}"}
        )
        out = tmp_path / f"all.{schema}.jsonl"
        run_cli(
            "export", "--out", str(out), "--schema", schema, "--quiet", "--data-dir", str(embedded_settings.data_dir)
        )
        assert resp.status_code == 200 and resp.content == out.read_bytes() and len(resp.content.splitlines()) >= 3
    user = login(embedded_stack, "ex-alice")
    expect(httpx.get(f"{embedded_stack}/admin/export", headers=user), 403, "forbidden")


def test_parquet_token_fields_are_typed_lists_that_datasets_loads(
    embedded_settings: ServerSettings, stored: dict[str, Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Token ids, masks and versions are list<int32> columns and logprobs list<float> (the stored float32
    values), loaded by ``datasets`` as they are, equal to the JSONL export's."""
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    import datasets

    jsonl = {r["rollout_id"]: r for r in export(embedded_settings, tmp_path / "t.jsonl", "--user", "ex-alice")}
    out = tmp_path / "t.parquet"
    run_cli("export", "--out", str(out), "--format", "parquet", "--data-dir", str(embedded_settings.data_dir),
            "--user", "ex-alice", "--quiet")  # fmt: skip
    ds = datasets.load_dataset("parquet", data_files=str(out), split="train", cache_dir=str(tmp_path / "hf"))
    samples, turns = ds.features["samples"].feature, ds.features["turns"].feature
    for feature, dtype in (
        (samples["token_ids"], "int32"),
        (samples["loss_mask"], "int32"),
        (samples["policy_versions"], "int32"),
        (samples["logprobs"], "float32"),
        (turns["completion_ids"], "int32"),
        (turns["logprobs"], "float32"),
    ):
        assert isinstance(feature, datasets.List) and feature.feature.dtype == dtype, feature
    assert len(ds) == len(jsonl) == 2
    for row in ds:
        want = jsonl[row["rollout_id"]]
        for got_sample, want_sample in zip(row["samples"], want["samples"], strict=True):
            for key in ("token_ids", "loss_mask", "logprobs", "policy_versions"):
                assert got_sample[key] == want_sample[key], key  # float32 values: their float64 widening
        for got_turn, want_turn in zip(row["turns"], want["turns"], strict=True):
            assert got_turn["completion_ids"] == want_turn["completion_ids"]
            assert got_turn["logprobs"] == want_turn["logprobs"]  # None where a logprob is not finite


_EXPORT_IN_WORKERS = """
import asyncio, sys
from pathlib import Path
from server.export import parallel
from server.export.run import run_export
from server.settings import ServerSettings

parallel.CHATS_PER_PAGE = 1  # a page per chat: the pages are dealt out to both workers
settings = ServerSettings(data_dir=Path(sys.argv[1]), migrate_on_start=False)
out, fmt, schema, workers = sys.argv[2], sys.argv[3], sys.argv[4], int(sys.argv[5])
message = asyncio.run(run_export(settings, Path(out), fmt=fmt, schema=schema, progress=False, workers=workers))
print(message, parallel.LAST.workers, file=sys.stderr)
"""


def test_worker_processes_write_what_one_process_writes(
    embedded_settings: ServerSettings, stored: dict[str, Any], tmp_path: Path
) -> None:
    """Pages built on two forked workers (in a fresh process: a fork of this one would copy its server
    threads) give the same file as one process: JSONL (to a file and to a pipe) and Parquet."""
    import pyarrow.parquet as pq

    def run(out: str, fmt: str, schema: str, workers: int) -> bytes:
        args = [str(embedded_settings.data_dir), out, fmt, schema, str(workers)]
        proc = subprocess.run([sys.executable, "-c", _EXPORT_IN_WORKERS, *args], capture_output=True, check=False)
        assert proc.returncode == 0, proc.stderr.decode()
        assert proc.stderr.decode().split()[-1] == ("2" if workers == 2 else "0"), proc.stderr.decode()
        return proc.stdout

    for fmt, schema in (("jsonl", "tokentrail"), ("parquet", "tokentrail"), ("jsonl", "verl"), ("parquet", "verl")):
        one, two = tmp_path / f"one.{schema}.{fmt}", tmp_path / f"two.{schema}.{fmt}"
        run(str(one), fmt, schema, 1)
        run(str(two), fmt, schema, 2)
        if fmt == "jsonl":
            assert one.read_bytes() == two.read_bytes() and len(one.read_text().splitlines()) >= 3
        else:
            assert pq.read_table(one).equals(pq.read_table(two)) and pq.read_table(one).num_rows >= 3
    assert run("-", "jsonl", "tokentrail", 2) == (tmp_path / "one.tokentrail.jsonl").read_bytes()


_EXPORT_WITH_FAILING_WORKERS = """
import asyncio, os, sys
from pathlib import Path
from server.export import parallel
from server.export.run import run_export
from server.settings import ServerSettings

parallel.CHATS_PER_PAGE = 1
how = sys.argv[3]
encode = parallel._encode_page

async def failing(job, conn, after, last):  # in every worker, at its first page
    if how == "raise":
        raise ValueError("injected failure")
    os._exit(3)

parallel._encode_page = failing
settings = ServerSettings(data_dir=Path(sys.argv[1]), migrate_on_start=False)
try:
    asyncio.run(run_export(settings, Path(sys.argv[2]), fmt="jsonl", schema="tokentrail", progress=False, workers=2))
except RuntimeError as exc:
    print(exc)
    print("children left:", len(parallel.multiprocessing.active_children()))
    sys.exit(7)
"""


@pytest.mark.parametrize("how", ["raise", "exit"])
def test_a_failing_worker_fails_the_export_with_what_happened(
    embedded_settings: ServerSettings, stored: dict[str, Any], tmp_path: Path, how: str
) -> None:
    """A worker that raises hands its traceback over; one that dies is named with its exit code; the
    export stops either way, its workers with it."""
    args = [str(embedded_settings.data_dir), str(tmp_path / "out.jsonl"), how]
    proc = subprocess.run(
        [sys.executable, "-c", _EXPORT_WITH_FAILING_WORKERS, *args], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 7, proc.stdout + proc.stderr
    if how == "raise":
        assert "failed:" in proc.stdout and "ValueError: injected failure" in proc.stdout, proc.stdout
    else:
        assert "ended early (exit code 3)" in proc.stdout, proc.stdout
    assert "children left: 0" in proc.stdout


def test_export_workers_come_from_the_option_or_the_environment(
    embedded_settings: ServerSettings, stored: dict[str, Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from server.export import parallel

    monkeypatch.setenv("TOKENTRAIL_EXPORT_WORKERS", "3")
    assert parallel.default_workers() == 3
    for bad in ("0", "two", "-1"):
        monkeypatch.setenv("TOKENTRAIL_EXPORT_WORKERS", bad)
        with pytest.raises(ValueError, match="TOKENTRAIL_EXPORT_WORKERS must be a whole number"):
            parallel.default_workers()
    monkeypatch.setenv("TOKENTRAIL_EXPORT_WORKERS", "1")
    one = export(embedded_settings, tmp_path / "one.jsonl", "--user", "ex-alice", "--workers", "1")
    assert parallel.LAST.workers == 0 and len(one) >= 2  # built in this process
    result = CliRunner().invoke(app, ["export", "--out", str(tmp_path / "x.jsonl"), "--workers", "0"])
    assert result.exit_code != 0 and "--workers" in result.output
