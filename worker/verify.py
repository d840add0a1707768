"""``tokentrail verify``: re-score exported samples by teacher forcing and check their structure.

For every sample: one fp32 forward pass over its tokens; each turn's completion positions are
re-scored under that turn's sampling (temperature, top-k, top-p, typical-p, repetition penalty,
processed exactly as during generation) and compared with the stored logprobs. Also checked:
the loss mask covers exactly the generated tokens (native records), and each turn of a sample
extends the turns before it. The exit code is non-zero when any check fails.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson

from worker.engines.contract import GenerationParams

TOLERANCE = 1e-4


@dataclass
class VerifyReport:
    samples: int = 0
    positions: int = 0
    over_tolerance: int = 0
    max_abs_delta: float = 0.0
    mask_mismatches: int = 0
    extension_breaks: int = 0
    skipped: int = 0
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return (
            self.samples > 0
            and self.over_tolerance == 0
            and self.mask_mismatches == 0
            and self.extension_breaks == 0
            and self.max_abs_delta <= TOLERANCE
        )

    def summary(self) -> str:
        share = self.over_tolerance / self.positions if self.positions else 0.0
        lines = [
            f"samples checked:             {self.samples}" + (f" ({self.skipped} skipped)" if self.skipped else ""),
            f"generated positions:         {self.positions}",
            f"|dlogprob| > {TOLERANCE:g}:         {self.over_tolerance} ({share:.4%})",
            f"max |dlogprob|:              {self.max_abs_delta:.3g}",
            f"loss-mask mismatches:        {self.mask_mismatches}",
            f"extension-property breaks:   {self.extension_breaks}",
            "PASS" if self.ok else "FAIL",
        ]
        return "\n".join(lines + [f"  - {p}" for p in self.problems[:20]])


@dataclass
class TurnView:
    start: int  # first completion position in the sample
    end: int
    params: GenerationParams


@dataclass
class SampleView:
    token_ids: list[int]
    loss_mask: list[int]
    logprobs: list[float]
    turns: list[TurnView]
    where: str


def read_records(path: Path) -> Iterator[dict[str, Any]]:
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        for batch in pq.ParquetFile(path).iter_batches(batch_size=256):
            yield from batch.to_pylist()
        return
    with path.open("rb") as fh:
        for line in fh:
            if line.strip():
                yield orjson.loads(line)


def _params(sampling: dict[str, Any] | str | None, temperature: float | None = None) -> GenerationParams:
    # Parquet stores free-form objects as JSON text
    s: dict[str, Any] = (json.loads(sampling) if isinstance(sampling, str) else sampling) or {}
    temp = s.get("temperature", temperature)
    return GenerationParams(
        max_new_tokens=1,
        temperature=1.0 if temp is None else float(temp),
        top_k=s.get("top_k"),
        top_p=s.get("top_p"),
        typical_p=s.get("typical_p"),
        repetition_penalty=s.get("repetition_penalty"),
    )


def native_views(rollout: dict[str, Any], report: VerifyReport) -> list[SampleView]:
    turns = rollout["turns"]
    views = []
    for k, sample in enumerate(rollout["samples"]):
        where = f"rollout {rollout['rollout_id']} sample {k}"
        spans = [tuple(s) for s in sample["turn_spans"]]
        expected = [0] * len(sample["token_ids"])
        for start, end in spans:
            expected[start:end] = [1] * (end - start)
        if list(sample["loss_mask"]) != expected:
            report.mask_mismatches += 1
            report.problems.append(f"{where}: loss mask does not cover exactly the generated tokens")
        seq: list[int] = []
        for i, (start, end) in zip(sample["turn_indices"], spans, strict=True):
            turn = turns[i]
            prompt = sample["token_ids"][:start]
            if seq and prompt[: len(seq)] != seq:
                report.extension_breaks += 1
                report.problems.append(f"{where}: turn {i} does not extend the turns before it")
            if sample["token_ids"][start:end] != turn["completion_ids"] or end - start != len(turn["completion_ids"]):
                report.mask_mismatches += 1
                report.problems.append(f"{where}: turn {i} completion is not at its span")
            seq = sample["token_ids"][:end]
        views.append(
            SampleView(
                sample["token_ids"],
                sample["loss_mask"],
                sample["logprobs"],
                [
                    TurnView(s, e, _params(turns[i]["sampling"]))
                    for i, (s, e) in zip(sample["turn_indices"], spans, strict=True)
                ],
                where,
            )
        )
    return views


def adapter_views(record: dict[str, Any], schema: str, temperature: float | None) -> list[SampleView]:
    """Views of a trainer-schema record mapped back to native samples."""
    from shared.rollout_adapters import to_native_samples

    views = []
    for k, view in enumerate(to_native_samples(record, schema)):
        temps = view["temperatures"]
        turns = [
            TurnView(int(s), int(e), _params({}, temps[i] if temps else temperature))
            for i, (s, e) in enumerate(view["turn_spans"])
        ]
        views.append(
            SampleView(list(view["token_ids"]), list(view["loss_mask"]), list(view["logprobs"]), turns, f"record {k}")
        )
    return views


def verify_file(
    path: Path, model_path: str, *, device: str = "cpu", schema: str | None = None, temperature: float | None = None
) -> VerifyReport:
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    from worker.sampling import gather_logprobs, teacher_forced_logprobs

    hf_logging.disable_progress_bar()  # type: ignore[no-untyped-call]  # our report is the output
    hf: Any = AutoModelForCausalLM
    model = hf.from_pretrained(model_path, dtype=torch.float32).to(device).eval()
    report = VerifyReport()
    for record in read_records(path):
        kind = schema or str(record.get("schema", ""))
        if kind == "tokentrail":
            views = native_views(record, report)
        elif kind:
            views = adapter_views(record, kind, temperature)
        else:
            raise ValueError("records carry no schema name: pass --schema")
        for view in views:
            if not view.turns:
                report.skipped += 1
                continue
            report.samples += 1
            with torch.no_grad():
                ids = torch.tensor([view.token_ids], device=device)
                logits = model(input_ids=ids).logits[0].float()
            for turn in view.turns:
                rows = teacher_forced_logprobs(logits, view.token_ids[: turn.end], turn.start, turn.params)
                rescored = gather_logprobs(rows, view.token_ids[turn.start : turn.end]).tolist()
                for stored, fresh in zip(view.logprobs[turn.start : turn.end], rescored, strict=True):
                    delta = abs(stored - fresh) if math.isfinite(fresh) else math.inf
                    report.positions += 1
                    report.max_abs_delta = max(report.max_abs_delta, delta)
                    if delta > TOLERANCE:
                        report.over_tolerance += 1
    return report
