"""The results: the table, the stitch arm's targets, and JSON without infinities."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from benchmarks.exactness.evaluator import ArmReport
from benchmarks.exactness.metrics import TFLA_TOLERANCE, share


def _ratio(value: float | None, counts: Sequence[int] | None = None) -> str:
    if value is None:
        return "n/a"
    text = f"{value:.3f}"
    return f"{text} ({counts[0]}/{counts[1]})" if counts else text


def _delta(value: float) -> str:
    return "inf" if math.isinf(value) else f"{value:.2e}"


def finite(value: Any) -> Any:
    """JSON has no infinity: non-finite floats become the strings "inf" / "nan"."""
    if isinstance(value, float) and not math.isfinite(value):
        return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")
    if isinstance(value, dict):
        return {k: finite(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [finite(v) for v in value]
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
        (
            "     across client-written turns",
            _ratio(s["EPB_written"], s["EPB_written_counts"]),
            _ratio(n["EPB_written"], n["EPB_written_counts"]),
        ),
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
