"""``--folder``: the stitch arm end to end on every real chat template, one row each.

For each template (``benchmarks/template_zoo``: llama.cpp's ``models/templates`` and vLLM's examples,
or any folder of ``.jinja`` files) a tiny model with that template and its tokenizer's special and
added tokens is built and briefly trained on conversations rendered by the template itself
(``--train-steps``, cached after the first run), so that it closes its turns, sometimes calls tools and
sometimes runs into ``max_new_tokens``. One server runs for the whole folder; per template one worker
(``--prompt-mode stitch``, ``--closer-policy``) serves the seeded scripts of the benchmark over real
HTTP + SSE, then the worker stops and the stored tokens are evaluated as for the two arms
(TEF, EPB, TFLA against an fp32 re-score, BF and synthetic-closer checks against an independent
re-render).

Row: turns served; turns the template rejected itself (``template_rejected``: a conversation stops
there); failed turns by error code; TEF, EPB, BF (with closer mismatches); TFLA max |delta|; turns
ending with a synthetic closer; forks; tool-call turns; methods (``prompt_method``) used. A template
whose model cannot be built (transformers cannot render it at all) or whose worker does not start is
listed with the reason.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.exactness.driver import drive
from benchmarks.exactness.evaluator import Evaluator
from benchmarks.exactness.metrics import TFLA_TOLERANCE
from benchmarks.exactness.processes import running_server, running_workers
from benchmarks.exactness.report import finite
from benchmarks.exactness.scorer import Scorer
from benchmarks.exactness.script import Script, stop_candidates
from benchmarks.progress import say
from benchmarks.template_zoo import FAMILIES, SOURCES, ZooTemplate, load_folder, load_zoo, zoo_model
from worker.chat_format import ChatFormat

REJECTED = "template_rejected"


@dataclass(frozen=True)
class FolderOptions:
    conversations: int
    turns: int
    seed: int
    concurrency: int
    train_steps: int
    closer_policy: str
    written: float = 0.0  # share of user turns the client answers itself (Script.written)


def select(folder: str, only: str | None) -> list[ZooTemplate]:
    """The templates of ``folder`` (``all``, a source name or a directory), filtered by ``only`` (comma-
    separated file stems or family names)."""
    if folder == "all":
        templates = load_zoo()
    elif folder in SOURCES:
        templates = load_zoo((folder,))
    else:
        path = Path(folder)
        if not path.is_dir():
            raise SystemExit(f"--folder: {folder!r} is not 'all', a source ({', '.join(SOURCES)}) or a directory")
        templates = load_folder(path)
    if only:
        wanted = {FAMILIES[n][1] if n in FAMILIES else n for n in only.split(",")}
        templates = [t for t in templates if t.name in wanted]
        if not templates:
            raise SystemExit(f"--only: none of {sorted(wanted)} is in the folder")
    return templates


def _family(template: ZooTemplate) -> str | None:
    return next((k for k, (_, stem) in FAMILIES.items() if stem == template.name), None)


def _code(error: str) -> str:
    """The error code of a failed turn's error line (``code: message``)."""
    return error.split(":", 1)[0].strip() or "?"


def template_row(
    index: int, template: ZooTemplate, url: str, key: str, work: Path, opts: FolderOptions
) -> dict[str, Any]:
    row: dict[str, Any] = {
        "template": template.name,
        "source": template.source,
        "derived": template.derived,
        "family": _family(template),
    }
    start = time.monotonic()
    try:
        model_dir = zoo_model(template, train_steps=opts.train_steps)
        fmt = ChatFormat.load(model_dir, template_kwargs=template.kwargs)
    except Exception as exc:  # transformers cannot load or render the template at all
        return {**row, "error": f"model: {type(exc).__name__}: {str(exc)[:200]}"}
    built = time.monotonic() - start
    candidates = tuple(stop_candidates(fmt))
    scripts = [Script.make(opts.seed, i, opts.turns, candidates, opts.written) for i in range(opts.conversations)]
    name = f"t{index}"
    extra = ["--closer-policy", opts.closer_policy]
    if template.kwargs:
        extra += ["--chat-template-kwargs", json.dumps(template.kwargs)]
    try:
        with running_workers(url, key, work, model_dir, {name: "stitch"}, opts.concurrency, extra_args=extra):
            convs = asyncio.run(drive(url, scripts, opts.concurrency, arms=(name,)))[name]
    except RuntimeError as exc:  # the worker did not start: its log tail says why
        return {**row, "error": f"worker: {str(exc).strip().splitlines()[-1][:200]}"}
    report = Evaluator(fmt, Scorer(model_dir)).evaluate("stitch", convs)
    metrics = report.metrics()
    turns = [t for c in convs for t in c.turns]
    failed = [t.error or "?" for c in convs for t in c.failed]
    row.update(
        {
            "served": len(turns),
            "rejected": sum(1 for e in failed if _code(e) == REJECTED),
            "failed": dict(Counter(_code(e) for e in failed if _code(e) != REJECTED)),
            "failure_examples": [e[:200] for e in failed if _code(e) != REJECTED][:2],
            "tef": metrics["TEF_counts"],
            "epb": metrics["EPB_counts"],
            "bf": metrics["BF_counts"],
            "closer_mismatches": metrics["closer_mismatches"],
            "tfla_max_abs_delta": metrics["TFLA_max_abs_delta"],
            "tfla_positions": metrics["TFLA_counts"][1],
            "synthetic": report.counts["synthetic_closer_turns"],
            "truncated": report.counts["truncated_turns"],
            "tool_call_turns": report.counts["tool_call_turns"],
            "written": report.counts["client_written_turns"],
            "epb_written": metrics["EPB_written_counts"],
            "forks": sum(1 for t in turns if t.stored.get("fork")),
            "methods": dict(Counter(str(t.stored.get("prompt_method")) for t in turns)),
            "examples": report.examples[:2],
            "build_s": round(built, 1),
            "wall_s": round(time.monotonic() - start, 1),
        }
    )
    return row


def passed(row: dict[str, Any]) -> bool:
    """Every turn served or rejected by the template, exact (TEF, EPB, BF, closers 0; TFLA in tolerance)."""
    if "error" in row:
        return False
    zero = all(row[k] is None or row[k][0] == 0 for k in ("tef", "epb", "bf", "closer_mismatches"))
    return not row["failed"] and zero and row["tfla_max_abs_delta"] < TFLA_TOLERANCE


def _pair(value: list[int] | None) -> str:
    return "-" if value is None else f"{value[0]}/{value[1]}"


def print_rows(config: dict[str, Any], rows: list[dict[str, Any]]) -> None:
    print(
        f"exactness over {len(rows)} templates: {config['conversations']} conversations x {config['turns']} user "
        f"turns each, seed {config['seed']}, models trained {config['train_steps']} steps, closer policy "
        f"{config['closer_policy']}; {config['wall_s']:.0f} s; * = tokens derived from the template text"
    )
    written = bool(config.get("written"))  # a column for the client-written turns, when the script has them
    head = "template | served | rejected | failed | TEF | EPB | BF | TFLA max Δ | synthetic | forks | tools | methods"
    head += " | written (EPB after)" if written else ""
    print(f"| {head} |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|" + ("---|" if written else ""))
    for r in rows:
        label = (r["family"] or r["template"]) + (" *" if r["derived"] else "")
        if "error" in r:
            print(f"| {label} | - | - | {r['error'][:70]} | - | - | - | - | - | - | - | - |")
            continue
        failed = ", ".join(f"{k} {v}" for k, v in r["failed"].items()) or "0"
        bf = _pair(r["bf"]) + ("" if not r["closer_mismatches"] or not r["closer_mismatches"][0] else " (closer!)")
        methods = ", ".join(f"{k} {v}" for k, v in sorted(r["methods"].items()))
        print(
            f"| {label} | {r['served']} | {r['rejected']} | {failed} | {_pair(r['tef'])} | {_pair(r['epb'])} | {bf} "
            f"| {r['tfla_max_abs_delta']:.2e} | {r['synthetic']} | {r['forks']} | {r['tool_call_turns']} | {methods} |"
            + (f" {r['written']} ({_pair(r['epb_written'])}) |" if written else "")
        )
    ok = [r for r in rows if passed(r)]
    print(f"\n{len(ok)}/{len(rows)} templates: every turn served or rejected by the template, TEF 0, EPB 0, BF 0, "
          f"TFLA max |Δ| < {TFLA_TOLERANCE:g}")  # fmt: skip
    for r in rows:
        if not passed(r):
            print(f"  {r['template']}: {r.get('error') or r['failure_examples'] or r['examples']}")


def run_folder(folder: str, only: str | None, opts: FolderOptions, as_json: bool) -> int:
    import tempfile

    templates = select(folder, only)
    start = time.monotonic()
    rows = []
    with (
        tempfile.TemporaryDirectory(prefix="tokentrail-exactness-zoo-") as tmp,
        running_server(Path(tmp)) as (url, key),
    ):
        for i, template in enumerate(templates, 1):
            say(f"[{i}/{len(templates)}] {template.name}")
            rows.append(template_row(i, template, url, key, Path(tmp), opts))
            r = rows[-1]
            say(f"[{i}/{len(templates)}] {template.name}: {json.dumps(finite(r))}")
    config = {**opts.__dict__, "folder": folder, "only": only, "wall_s": round(time.monotonic() - start, 1)}
    if as_json:
        print(json.dumps(finite({"config": config, "rows": rows}), indent=1))
    else:
        print_rows(config, rows)
    return 0
