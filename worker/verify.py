"""``tokentrail verify``: re-score exported samples by teacher forcing and check their structure.

For every sample and every policy version its generated tokens come from: one fp32 forward pass over
its tokens under that version's weights; each turn's completion positions of that version are
re-scored under that turn's sampling (temperature, top-k, top-p, typical-p, repetition penalty,
processed exactly as during generation) and compared with the stored logprobs. Also checked: the loss
mask covers exactly the generated tokens (native records), each turn of a sample extends the turns
before it, and (native records) the samples' per-token versions are the turns' version spans. The exit
code is non-zero when any check fails.

The weights of version N: a ``--weights N=DIR`` override, else ``--model`` for version 0, else the
checkpoint directory the export names for N (``policy_paths``). A version found nowhere, or whose
checkpoint cannot be loaded, fails the run and is named. Records without versions are all version 0:
``--model``. A checkpoint is loaded into ``--model``'s architecture by tensor name, as the workers load
a push (worker/engines/hf.py). The file is read once for the structure and the versions, then once per
version, so that each version's weights are loaded once.

Preference pairs (shared/pairs.py, native or TRL rows) are recognised by their fields: each side is a
sample of the shared prompt + that side's completion, its stored logprobs compared like a turn's, under
that side's sampling and policy versions.
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
    version_mismatches: int = 0
    skipped: int = 0
    problems: list[str] = field(default_factory=list)
    versions: dict[int, int] = field(default_factory=dict)  # policy version -> generated positions
    missing_weights: dict[int, str] = field(default_factory=dict)  # version -> why it was not re-scored
    pairs: int = 0  # preference pairs read (each side is a sample)

    @property
    def ok(self) -> bool:
        return (
            self.samples > 0
            and self.over_tolerance == 0
            and self.mask_mismatches == 0
            and self.extension_breaks == 0
            and self.version_mismatches == 0
            and not self.missing_weights
            and self.max_abs_delta <= TOLERANCE
        )

    def summary(self) -> str:
        share = self.over_tolerance / self.positions if self.positions else 0.0
        versions = ", ".join(f"{v} ({n} positions)" for v, n in sorted(self.versions.items())) or "none"
        missing = ", ".join(str(v) for v in sorted(self.missing_weights)) or "none"
        lines = [
            f"samples checked:             {self.samples}" + (f" ({self.skipped} skipped)" if self.skipped else ""),
            f"generated positions:         {self.positions}",
            f"|dlogprob| > {TOLERANCE:g}:         {self.over_tolerance} ({share:.4%})",
            f"max |dlogprob|:              {self.max_abs_delta:.3g}",
            f"loss-mask mismatches:        {self.mask_mismatches}",
            f"extension-property breaks:   {self.extension_breaks}",
            f"policy versions:             {versions}",
            f"policy-version mismatches:   {self.version_mismatches}",
            f"versions without weights:    {missing}",
            "PASS" if self.ok else "FAIL",
        ]
        if self.pairs:
            lines.insert(1, f"preference pairs:            {self.pairs} (two samples each)")
        problems = list(self.missing_weights.values()) + self.problems
        return "\n".join(lines + [f"  - {p}" for p in problems[:20]])


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
    versions: list[int] | None = None  # per position (-1 off the generated tokens); None: all version 0
    paths: dict[str, str | None] = field(default_factory=dict)  # version -> checkpoint, as exported

    def version_at(self) -> list[int]:
        """The policy version of every position (0 everywhere when the record has none)."""
        return self.versions if self.versions is not None else [0] * len(self.token_ids)


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


def _json_object(value: Any) -> dict[str, Any]:
    """A free-form object, or the JSON text Parquet stores it as."""
    return dict((json.loads(value) if isinstance(value, str) else value) or {})


def _native_versions(
    rollout: dict[str, Any], sample: dict[str, Any], where: str, report: VerifyReport
) -> list[int] | None:
    """A native sample's per-position versions, checked against its turns' ``[start, version]`` spans."""
    from shared.rollout import sample_versions

    spans = [(int(a), int(b)) for a, b in sample["turn_spans"]]
    group = [int(i) for i in sample["turn_indices"]]
    n = len(sample["token_ids"])
    from_turns = sample_versions(spans, group, rollout["turns"], n)
    stored = sample.get("policy_versions")
    if stored is None:
        return from_turns
    versions = [int(v) for v in stored]
    if from_turns is not None and versions != from_turns:
        report.version_mismatches += 1
        report.problems.append(f"{where}: policy_versions differ from the turns' policy_versions spans")
    return versions


def native_views(rollout: dict[str, Any], report: VerifyReport) -> list[SampleView]:
    turns = rollout["turns"]
    paths = _json_object(rollout.get("policy_paths"))
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
                _native_versions(rollout, sample, where, report),
                paths,
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
            SampleView(
                list(view["token_ids"]),
                list(view["loss_mask"]),
                list(view["logprobs"]),
                turns,
                f"record {k}",
                view["policy_versions"],
                view["policy_paths"] or {},
            )
        )
    return views


def pair_views(record: dict[str, Any], temperature: float | None, report: VerifyReport) -> list[SampleView]:
    """The two sides of a preference pair as samples: the shared prompt (mask 0), then the side's
    completion (mask 1, its stored logprobs, its policy versions)."""
    from shared.pairs import pair_sides
    from shared.rollout import NO_VERSION, token_versions

    sides, problems = pair_sides(record)
    report.pairs += 1
    report.mask_mismatches += len(problems)
    report.problems += problems
    views = []
    for side in sides:
        prompt, completion = side["prompt_ids"], side["completion_ids"]
        p, n = len(prompt), len(completion)
        lps = ([0.0 if x is None else float(x) for x in side["logprobs"]] + [0.0] * n)[:n]
        spans = side["policy_versions"]
        views.append(
            SampleView(
                prompt + completion,
                [0] * p + [1] * n,
                [0.0] * p + lps,
                [TurnView(p, p + n, _params(side["sampling"], temperature))] if n else [],
                side["where"],
                None if spans is None else [NO_VERSION] * p + token_versions(spans, n),
                side["policy_paths"],
            )
        )
    return views


PAIR_SCHEMA_NAMES = ("trl", "tokentrail.pair")  # --schema values that mean pair records


def _views(path: Path, schema: str | None, temperature: float | None, report: VerifyReport) -> Iterator[SampleView]:
    from shared.pairs import is_pair_record

    for n, record in enumerate(read_records(path)):
        kind = schema or str(record.get("schema", ""))
        if schema in PAIR_SCHEMA_NAMES or (schema in (None, "tokentrail") and is_pair_record(record)):
            views = pair_views(record, temperature, report)
        elif kind == "tokentrail":
            views = native_views(record, report)
        elif kind:
            views = adapter_views(record, kind, temperature)
            for k, view in enumerate(views):
                view.where = f"record {n}" if len(views) == 1 else f"record {n} sample {k}"
        else:
            raise ValueError("records carry no schema name: pass --schema")
        yield from views


def _survey(path: Path, schema: str | None, temperature: float | None, report: VerifyReport) -> dict[int, str]:
    """The structural checks and the versions' positions (into ``report``); the checkpoint directory
    the export names for each version (the first one named)."""
    exported: dict[int, str] = {}
    for view in _views(path, schema, temperature, report):
        if not view.turns:
            report.skipped += 1
            continue
        report.samples += 1
        versions = view.version_at()
        unknown = 0
        for turn in view.turns:
            for v in versions[turn.start : turn.end]:
                if v < 0:
                    unknown += 1
                else:
                    report.versions[v] = report.versions.get(v, 0) + 1
        if unknown:
            report.version_mismatches += 1
            report.problems.append(f"{view.where}: {unknown} generated tokens have no policy version")
        for key, directory in view.paths.items():
            if directory and int(key) not in exported:
                exported[int(key)] = directory
    return exported


def weights_sources(
    versions: dict[int, int], exported: dict[int, str], overrides: dict[int, str], report: VerifyReport
) -> dict[int, str | None]:
    """Where each version's weights come from: a directory, or None for ``--model`` itself. A version
    found nowhere goes to ``report.missing_weights``."""
    sources: dict[int, str | None] = {}
    for v in sorted(versions):
        if v in overrides:
            sources[v] = overrides[v]
        elif v == 0:
            sources[v] = None
        elif v in exported:
            sources[v] = exported[v]
        else:
            report.missing_weights[v] = (
                f"version {v} ({versions[v]} positions): no weights: the export names no checkpoint for it;"
                f" pass --weights {v}=DIR"
            )
    return sources


def load_weights(model: Any, directory: str) -> None:
    """Load a checkpoint directory's safetensors into ``model`` by tensor name (every parameter must get
    a value of its shape), as the workers load a pushed version; ValueError when it cannot."""
    import torch

    from worker.checkpoint import matched_tensors
    from worker.engines.contract import WeightsError

    try:
        pairs = matched_tensors(model, directory)
    except WeightsError as exc:  # a checkpoint that does not fit is named as such; any other as unreadable
        raise ValueError(str(exc) if exc.code == "weights_load_failed" else f"cannot read {directory}: {exc}") from exc
    with torch.no_grad():
        for target, tensor in pairs:
            target.copy_(tensor)


def _rescore(model: Any, version: int, view: SampleView, report: VerifyReport, device: str) -> int:
    """Compare the sample's positions of ``version`` with ``model``'s; how many differ."""
    import torch

    from worker.sampling import gather_logprobs, teacher_forced_logprobs

    versions = view.version_at()
    turns = [t for t in view.turns if version in versions[t.start : t.end]]
    if not turns:
        return 0
    with torch.no_grad():
        ids = torch.tensor([view.token_ids], device=device)
        logits = model(input_ids=ids).logits[0].float()
    over = 0
    for turn in turns:
        rows = teacher_forced_logprobs(logits, view.token_ids[: turn.end], turn.start, turn.params)
        rescored = gather_logprobs(rows, view.token_ids[turn.start : turn.end]).tolist()
        for t, fresh in enumerate(rescored, start=turn.start):
            if versions[t] != version:
                continue
            delta = abs(view.logprobs[t] - fresh) if math.isfinite(fresh) else math.inf
            report.positions += 1
            report.max_abs_delta = max(report.max_abs_delta, delta)
            if delta > TOLERANCE:
                report.over_tolerance += 1
                over += 1
    return over


def verify_file(
    path: Path,
    model_path: str,
    *,
    device: str = "cpu",
    schema: str | None = None,
    temperature: float | None = None,
    weights: dict[int, str] | None = None,
) -> VerifyReport:
    """Verify an export; ``weights``: version -> checkpoint directory, over the export's own paths."""
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    report = VerifyReport()
    exported = _survey(path, schema, temperature, report)
    sources = weights_sources(report.versions, exported, weights or {}, report)
    if not sources:
        return report
    hf_logging.disable_progress_bar()  # type: ignore[no-untyped-call]  # our report is the output
    hf: Any = AutoModelForCausalLM
    model = hf.from_pretrained(model_path, dtype=torch.float32).to(device).eval()
    # ascending: version 0 (the --model as loaded) first, then each checkpoint loaded over the last
    for version, source in sorted(sources.items()):
        if source is not None:
            try:
                load_weights(model, source)
            except ValueError as exc:
                report.missing_weights[version] = f"version {version}: {exc}"
                continue
        over = 0
        for view in _views(path, schema, temperature, VerifyReport()):
            if view.turns:
                over += _rescore(model, version, view, report, device)
        if over:
            where = source or model_path
            report.problems.append(
                f"version {version} ({where}): {over} of {report.versions[version]} positions differ by more"
                f" than {TOLERANCE:g}"
            )
    return report
