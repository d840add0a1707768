"""Trainer rollout records from native rollouts (shared/rollout_adapters.py).

The running example of the trainer notes: P=[10,11,12], C1=[20,21] (logprobs -0.1, -0.2), U=[30,31,32]
(tool results, bridge and next header), C2=[40,41] (logprobs -0.3, -0.4), reward 1.0. Each adapter must
produce exactly the trainer's record for it; records map back to the native samples; everything is JSON.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from server.export.rollouts import build_samples
from shared.rollout import Rollout
from shared.rollout_adapters import SCHEMAS, adapt, to_native_samples
from shared.stitching import extends

P, C1, U, C2 = [10, 11, 12], [20, 21], [30, 31, 32], [40, 41]
LP1, LP2 = [-0.1, -0.2], [-0.3, -0.4]


@dataclass
class T:
    """One assistant turn as the model saw it: its full prompt and its completion."""

    prompt: list[int]
    completion: list[int]
    logprobs: list[float | None]
    finish_reason: str = "stop"
    temperature: float | None = 1.0
    reward: float | None = None
    tool_calls: list[dict[str, Any]] | None = None
    content: str = ""
    sampling: dict[str, Any] = field(default_factory=dict)


def native(turns: list[T], reward: float | None = 1.0) -> dict[str, Any]:
    """A native rollout dict as server/export/rollouts.py's ``_rollout`` builds it."""
    rows: list[dict[str, Any]] = []
    seqs: list[tuple[list[int], list[int]]] = []
    prev: list[int] = []
    for i, t in enumerate(turns):
        fork = not (prev and extends(prev, t.prompt))
        sampling = {"temperature": t.temperature, "top_p": None, "top_k": None, "max_new_tokens": 64}
        sampling |= t.sampling
        sampling.setdefault("seed", 7)
        rows.append(
            {
                "message_id": f"m{i}",
                "prompt_delta_ids": t.prompt if fork else t.prompt[len(prev) :],
                "completion_ids": t.completion,
                "logprobs": t.logprobs,
                "finish_reason": t.finish_reason,
                "stop_reason": None,
                "synthetic_closer_ids": [],
                "reused_prefix_len": 0 if fork else len(prev),
                "fork": fork and i > 0,
                "prompt_length": len(t.prompt),
                "sampling": sampling,
                "reward": t.reward,
                "content": t.content,
                "reasoning_content": None,
                "tool_calls": t.tool_calls,
                "created_at": None,
            }
        )
        seqs.append((t.prompt, t.completion))
        prev = t.prompt + t.completion
    rollout = {
        "schema": "tokentrail",
        "schema_version": 1,
        "rollout_id": "leaf",
        "chat_id": "chat",
        "leaf_message_id": "leaf",
        "user_id": "u",
        "model_name": "tiny",
        "tokenizer_hash": "th",
        "template_hash": "tp",
        "engine": "hf",
        "system_prompt": None,
        "tools": None,
        "turns": rows,
        "samples": build_samples(seqs, rows),
        "reward": reward,
        "reward_rule": "last",
        "complete": True,
    }
    Rollout.model_validate(rollout)  # the native schema accepts it
    return rollout


CALL = [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]


def example(**second: Any) -> dict[str, Any]:
    return native(
        [
            T(P, C1, list(LP1), tool_calls=CALL, content="calling f"),
            T(P + C1 + U, C2, list(LP2), reward=1.0, content="done", **second),
        ]
    )


def forked() -> dict[str, Any]:
    """The example, then a fork: an edited history whose prompt does not extend the path so far."""
    return native(
        [
            T(P, C1, list(LP1), tool_calls=CALL),
            T(P + C1 + U, C2, list(LP2)),
            T([10, 11, 50], [60, 61, 62], [-0.5, None, -0.7], temperature=0.5, reward=1.0),
        ]
    )


IDS = {"rollout_id": "leaf", "chat_id": "chat", "sample_index": 0, "turn_indices": [0, 1], "temperatures": [1.0, 1.0]}
FULL = [10, 11, 12, 20, 21, 30, 31, 32, 40, 41]
RESP_LP = [-0.1, -0.2, 0.0, 0.0, 0.0, -0.3, -0.4]

EXPECTED: dict[str, list[dict[str, Any]]] = {
    "verl": [
        {
            "prompt_ids": [10, 11, 12],
            "response_ids": [20, 21, 30, 31, 32, 40, 41],
            "response_mask": [1, 1, 0, 0, 0, 1, 1],
            "response_logprobs": RESP_LP,
            "reward_score": 1.0,
            "num_turns": 4,
            "multi_modal_data": {},
            "extra_fields": {"turn_scores": [None, 1.0], "tool_rewards": [], **IDS},
            "metrics": {},
        }
    ],
    "openrlhf": [
        {
            "prompt": "",
            "label": None,
            "images": None,
            "mm_train_inputs": None,
            "observation_tokens": FULL,
            "action_ranges": [[3, 5], [8, 10]],
            "rollout_log_probs": [0.0, 0.0, 0.0, -0.1, -0.2, 0.0, 0.0, 0.0, -0.3, -0.4],
            "reward": 1.0,
            "scores": 1.0,
            "extra_logs": {},
            "truncated": False,
        }
    ],
    "slime": [
        {
            "group_index": None,
            "index": 0,
            "prompt": "",
            "tokens": FULL,
            "response": "",
            "response_length": 7,
            "label": None,
            "reward": 1.0,
            "loss_mask": [1, 1, 0, 0, 0, 1, 1],
            "weight_versions": [],
            "rollout_log_probs": RESP_LP,
            "remove_sample": False,
            "status": "completed",
            "metadata": IDS,
        }
    ],
    "skyrl": [
        {
            "prompt_token_ids": [[10, 11, 12]],
            "response_ids": [[20, 21, 30, 31, 32, 40, 41]],
            "loss_masks": [[1, 1, 0, 0, 0, 1, 1]],
            "rollout_logprobs": [RESP_LP],
            "rewards": [1.0],
            "stop_reasons": ["stop"],
            "trajectory_ids": [{"instance_id": "leaf", "repetition_id": 0}],
            "rollout_metrics": {},
        }
    ],
    "prime-rl": [
        {
            "token_ids": FULL,
            "mask": [False, False, False, True, True, False, False, False, True, True],
            "logprobs": [0.0, 0.0, 0.0, -0.1, -0.2, 0.0, 0.0, 0.0, -0.3, -0.4],
            "temperatures": [1.0] * 10,
            "env_name": "tokentrail",
            "advantages": None,
            "reward": 1.0,
        }
    ],
    "nemo-rl": [
        {
            "message_log": [
                {"role": "user", "content": "", "token_ids": [10, 11, 12]},
                {"role": "assistant", "content": "calling f", "token_ids": [20, 21], "generation_logprobs": LP1},
                {"role": "environment", "content": "", "token_ids": [30, 31, 32]},
                {"role": "assistant", "content": "done", "token_ids": [40, 41], "generation_logprobs": LP2},
            ],
            "length": 10,
            "extra_env_info": {"reward": 1.0, **IDS},
            "loss_multiplier": 1.0,
            "idx": 0,
            "task_name": "tokentrail",
        }
    ],
    "marin": [
        {
            "env_name": "tokentrail",
            "env_example_id": "leaf",
            "prompt_tokens": [10, 11, 12],
            "response_tokens": [20, 21],
            "response_logprobs": LP1,
            "token_rewards": [1.0, 1.0],
            "episode_reward": 1.0,
            "decoding": {
                "temperature": 1.0,
                "top_k": None,
                "top_p": None,
                "repetition_penalty": None,
                "seed": 7,
                "max_output_tokens": 64,
                "stop_token_ids": [],
            },
            "is_truncated": False,
            "metadata": {"worker_id": "", "timestamp": 0.0, "weight_step": -1},
            "correctness_reward": None,
        },
        {
            "env_name": "tokentrail",
            "env_example_id": "leaf",
            "prompt_tokens": [10, 11, 12, 20, 21, 30, 31, 32],
            "response_tokens": [40, 41],
            "response_logprobs": LP2,
            "token_rewards": [1.0, 1.0],
            "episode_reward": 1.0,
            "decoding": {
                "temperature": 1.0,
                "top_k": None,
                "top_p": None,
                "repetition_penalty": None,
                "seed": 7,
                "max_output_tokens": 64,
                "stop_token_ids": [],
            },
            "is_truncated": False,
            "metadata": {"worker_id": "", "timestamp": 0.0, "weight_step": -1},
            "correctness_reward": None,
        },
    ],
}


def test_running_example_is_one_native_sample() -> None:
    r = example()
    (s,) = r["samples"]
    assert s["token_ids"] == FULL
    assert s["loss_mask"] == [0, 0, 0, 1, 1, 0, 0, 0, 1, 1]
    assert s["logprobs"] == [0.0, 0.0, 0.0, -0.1, -0.2, 0.0, 0.0, 0.0, -0.3, -0.4]
    assert (s["prompt_length"], s["turn_spans"], s["turn_indices"]) == (3, [(3, 5), (8, 10)], [0, 1])


@pytest.mark.parametrize("schema", sorted(EXPECTED))
def test_running_example_gives_the_trainer_record(schema: str) -> None:
    assert adapt(example(), schema) == EXPECTED[schema]


def test_tokentrail_is_the_rollout_itself() -> None:
    r = example()
    assert adapt(r, "tokentrail") == [r]


def test_schemas_are_all_covered() -> None:
    assert set(SCHEMAS) == {*EXPECTED, "tokentrail"}


def test_fork_gives_one_record_per_sample_and_marin_one_per_turn() -> None:
    r = forked()
    assert [s["turn_indices"] for s in r["samples"]] == [[0, 1], [2]]
    for schema in SCHEMAS:
        records = adapt(r, schema)
        assert len(records) == {"tokentrail": 1, "marin": 3}.get(schema, 2), schema
    verl = adapt(r, "verl")[1]
    assert verl["prompt_ids"] == [10, 11, 50]
    assert verl["response_ids"] == [60, 61, 62]
    assert verl["response_logprobs"] == [-0.5, 0.0, -0.7]  # a missing logprob is 0.0, as natively
    assert verl["num_turns"] == 2  # SingleTurnAgentLoop's value: prompt + one assistant turn
    assert verl["extra_fields"]["sample_index"] == 1
    assert verl["extra_fields"]["temperatures"] == [0.5]
    assert adapt(r, "skyrl")[1]["trajectory_ids"] == [{"instance_id": "leaf", "repetition_id": 1}]
    assert [m["prompt_tokens"] for m in adapt(r, "marin")] == [P, P + C1 + U, [10, 11, 50]]
    assert adapt(r, "marin")[2]["decoding"]["temperature"] == 0.5


def test_skyrl_records_concatenate_into_a_valid_batch() -> None:
    records = adapt(forked(), "skyrl")
    batch = {k: [x for rec in records for x in rec[k]] for k in records[0] if k != "rollout_metrics"}
    n = len(batch["response_ids"])
    assert n == 2 and all(len(v) == n for v in batch.values())
    for resp, mask, lps in zip(batch["response_ids"], batch["loss_masks"], batch["rollout_logprobs"], strict=True):
        assert len(resp) == len(mask) == len(lps)
    views = to_native_samples({**batch, "rollout_metrics": {}}, "skyrl")
    assert [v["token_ids"] for v in views] == [s["token_ids"] for s in forked()["samples"]]


def test_truncated_last_turn() -> None:
    r = example(finish_reason="length")
    assert adapt(r, "slime")[0]["status"] == "truncated"
    assert adapt(r, "openrlhf")[0]["truncated"] is True
    assert adapt(r, "skyrl")[0]["stop_reasons"] == ["length"]
    assert [m["is_truncated"] for m in adapt(r, "marin")] == [False, True]
    assert adapt(example(finish_reason="abort"), "slime")[0]["status"] == "aborted"


def test_truncated_earlier_turn_then_continued() -> None:
    r = native([T(P, C1, list(LP1), finish_reason="length"), T(P + C1 + U, C2, list(LP2))])
    assert adapt(r, "slime")[0]["status"] == "completed"  # the sample itself ended normally
    assert adapt(r, "openrlhf")[0]["truncated"] is True  # but a turn of it was cut
    assert [m["is_truncated"] for m in adapt(r, "marin")] == [True, False]


def test_unrated_rollout() -> None:
    r = native([T(P, C1, list(LP1)), T(P + C1 + U, C2, list(LP2))], reward=None)
    assert adapt(r, "verl")[0]["reward_score"] is None
    assert adapt(r, "verl")[0]["extra_fields"]["turn_scores"] == [None, None]
    assert adapt(r, "openrlhf")[0]["reward"] is None and adapt(r, "openrlhf")[0]["scores"] is None
    assert adapt(r, "slime")[0]["reward"] is None
    assert adapt(r, "prime-rl")[0]["reward"] is None
    assert adapt(r, "nemo-rl")[0]["extra_env_info"]["reward"] is None
    assert adapt(r, "skyrl")[0]["rewards"] == [0.0]  # SkyRL validates rewards as floats
    for m in adapt(r, "marin"):  # marin's rewards are float arrays
        assert m["episode_reward"] == 0.0 and m["token_rewards"] == [0.0, 0.0]


def test_prime_rl_per_token_temperatures() -> None:
    r = native([T(P, C1, list(LP1), temperature=0.7), T(P + C1 + U, C2, list(LP2), temperature=None)])
    # P and C1 at turn 1's temperature, U and C2 at turn 2's (unset: 1.0)
    assert adapt(r, "prime-rl")[0]["temperatures"] == [0.7] * 5 + [1.0] * 5
    r = native([T(P, C1, list(LP1), temperature=0.7), T(P + C1 + U, C2, list(LP2), temperature=0.2)])
    assert adapt(r, "prime-rl")[0]["temperatures"] == [0.7] * 5 + [0.2] * 5
    assert to_native_samples(adapt(r, "prime-rl")[0], "prime-rl")[0]["temperatures"] == [0.7, 0.2]


def test_marin_decoding_comes_from_the_turn() -> None:
    sampling = {"top_k": 40, "top_p": 0.9, "repetition_penalty": 1.1, "seed": 3, "stop_token_ids": [2]}
    r = native([T(P, C1, list(LP1), temperature=0.0, sampling=sampling)])
    assert adapt(r, "marin")[0]["decoding"] == {
        "temperature": 0.0,
        "top_k": 40,
        "top_p": 0.9,
        "repetition_penalty": 1.1,
        "seed": 3,
        "max_output_tokens": 64,
        "stop_token_ids": [2],
    }
    assert to_native_samples(adapt(r, "marin")[0], "marin")[0]["temperatures"] == [0.0]


def test_nemo_rl_user_message_between_turns_without_tool_calls() -> None:
    r = native([T(P, C1, list(LP1)), T(P + C1 + U, C2, list(LP2))])
    assert [m["role"] for m in adapt(r, "nemo-rl")[0]["message_log"]] == ["user", "assistant", "user", "assistant"]


def _core(view: Any) -> tuple[Any, ...]:
    return view["token_ids"], view["loss_mask"], view["logprobs"], view["prompt_length"]


CARRY_TEMPERATURES = {"tokentrail", "verl", "slime", "prime-rl", "nemo-rl", "marin"}


def check_round_trip(r: dict[str, Any]) -> None:
    samples = r["samples"]
    for schema in SCHEMAS:
        records = adapt(r, schema)
        views = [v for rec in records for v in to_native_samples(rec, schema)]
        if schema == "marin":  # each turn maps to a single-turn sample
            expected = []
            for s in samples:
                for (a, b), temp in zip(s["turn_spans"], s["temperatures"], strict=True):
                    lps = [0.0] * a + s["logprobs"][a:b]
                    view = {"token_ids": s["token_ids"][:b], "loss_mask": [0] * a + [1] * (b - a), "logprobs": lps}
                    expected.append({**view, "prompt_length": a, "turn_spans": [(a, b)], "temperatures": [temp]})
        else:
            expected = [
                {**s, "turn_spans": [tuple(x) for x in s["turn_spans"]], "temperatures": s["temperatures"]}
                for s in samples
            ]
        assert [_core(v) for v in views] == [_core(e) for e in expected], schema
        assert [v["turn_spans"] for v in views] == [e["turn_spans"] for e in expected], schema
        carried = schema in CARRY_TEMPERATURES
        assert [v["temperatures"] for v in views] == [e["temperatures"] if carried else None for e in expected]


def test_round_trip_every_schema() -> None:
    check_round_trip(example())
    check_round_trip(forked())


def test_round_trip_through_json() -> None:
    r = json.loads(json.dumps(forked()))  # tuples become lists, as read back from an export file
    for schema in SCHEMAS:
        for rec in adapt(r, schema):
            views = to_native_samples(json.loads(json.dumps(rec)), schema)
            assert all(isinstance(v["turn_spans"][0], tuple) for v in views)
    check_round_trip(r)


def test_records_are_json() -> None:
    for r in (example(), forked(), native([T(P, C1, [None, -0.2])], reward=None)):
        for schema in SCHEMAS:
            for rec in adapt(r, schema):
                assert json.loads(json.dumps(rec, allow_nan=False)) == json.loads(json.dumps(rec))


def test_unknown_schema_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown rollout schema 'trl'"):
        adapt(example(), "trl")
    with pytest.raises(ValueError, match="unknown rollout schema"):
        to_native_samples({}, "trl")


def test_records_that_cannot_be_mapped_back() -> None:
    verl = adapt(example(), "verl")[0]
    with pytest.raises(ValueError, match="no response logprobs"):
        to_native_samples({**verl, "response_logprobs": None}, "verl")
    with pytest.raises(ValueError, match="differ in length"):
        to_native_samples({**verl, "response_mask": [1]}, "verl")
    with pytest.raises(ValueError, match="not a valid slime record: KeyError"):
        to_native_samples({"tokens": FULL}, "slime")
    with pytest.raises(ValueError, match="no rollout_logprobs"):
        to_native_samples({**adapt(example(), "skyrl")[0], "rollout_logprobs": None}, "skyrl")
    with pytest.raises(ValueError, match="outside"):
        to_native_samples({**adapt(example(), "openrlhf")[0], "action_ranges": [[8, 11]]}, "openrlhf")


# --- property: trainable-token logprobs are the native ones, for any sample shape ------------------


def trainable_logprobs(record: dict[str, Any], schema: str) -> list[float]:
    """Read each trainer's trainable-token logprobs straight from its record, as the trainer would."""
    if schema == "tokentrail":
        return [lp for s in record["samples"] for lp, m in zip(s["logprobs"], s["loss_mask"], strict=True) if m]
    if schema == "verl":
        return [lp for lp, m in zip(record["response_logprobs"], record["response_mask"], strict=True) if m]
    if schema == "openrlhf":
        return [record["rollout_log_probs"][i] for a, b in record["action_ranges"] for i in range(a, b)]
    if schema == "slime":
        return [lp for lp, m in zip(record["rollout_log_probs"], record["loss_mask"], strict=True) if m]
    if schema == "skyrl":
        pairs = zip(record["rollout_logprobs"][0], record["loss_masks"][0], strict=True)
        return [lp for lp, m in pairs if m]
    if schema == "prime-rl":
        return [lp for lp, m in zip(record["logprobs"], record["mask"], strict=True) if m]
    if schema == "nemo-rl":
        return [lp for msg in record["message_log"] for lp in msg.get("generation_logprobs", [])]
    assert schema == "marin"
    return list(record["response_logprobs"])


tokens = st.lists(st.integers(0, 999), min_size=1, max_size=6)
logprob = st.one_of(st.none(), st.floats(-30.0, 0.0, allow_nan=False))


@st.composite
def rollouts(draw: st.DrawFn) -> dict[str, Any]:
    turns: list[T] = []
    prev: list[int] = []
    for i in range(draw(st.integers(1, 5))):
        fork = not prev or draw(st.integers(0, 3)) == 0
        # a fork's first token differs from every earlier prompt's, so it never extends the path so far
        prompt = [1000 + i, *draw(tokens)] if fork else prev + draw(tokens)
        completion = draw(tokens)
        lps = draw(st.lists(logprob, min_size=len(completion), max_size=len(completion)))
        temp = draw(st.sampled_from([None, 0.0, 0.6, 1.0]))
        finish = draw(st.sampled_from(["stop", "length", "abort"]))
        turns.append(T(prompt, completion, lps, finish_reason=finish, temperature=temp))
        prev = prompt + completion
    return native(turns, reward=draw(st.sampled_from([None, -1.0, 0.0, 1.0])))


@settings(max_examples=60, deadline=None)
@given(rollouts())
def test_trainable_logprobs_are_the_native_ones(r: dict[str, Any]) -> None:
    # the truth: every turn's sampled logprobs, in order (a missing one is 0.0, as in native samples)
    by_sample = [
        [0.0 if lp is None else lp for i in s["turn_indices"] for lp in r["turns"][i]["logprobs"]] for s in r["samples"]
    ]
    for schema in SCHEMAS:
        records = adapt(r, schema)
        got = [trainable_logprobs(rec, schema) for rec in records]
        if schema == "marin":
            assert [lp for g in got for lp in g] == [lp for s in by_sample for lp in s]
        elif schema == "tokentrail":
            assert got == [[lp for s in by_sample for lp in s]]
        else:
            assert got == by_sample, schema
        for rec in records:
            json.dumps(rec, allow_nan=False)
    check_round_trip(r)
