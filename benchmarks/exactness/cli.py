"""Token exactness of stored conversations: stitched prompts vs. naive re-templating, end to end.

The command line of ``python benchmarks/exactness.py``; the benchmark is described in the package docstring.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from benchmarks.exactness.conversation import dump_conversations, load_conversations
from benchmarks.exactness.driver import drive
from benchmarks.exactness.evaluator import Evaluator, infer_cache_block
from benchmarks.exactness.processes import ARMS, running_arms
from benchmarks.exactness.report import finite, print_table, targets
from benchmarks.exactness.scorer import Scorer
from benchmarks.exactness.script import Script, stop_candidates
from benchmarks.exactness.zoo import FolderOptions, run_folder
from benchmarks.models import prepare_model
from benchmarks.progress import say
from worker.chat_format import ChatFormat
from worker.prompt_builder import PromptBuilder


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--conversations", type=int, help="per template (default 20; 4 with --folder)")
    parser.add_argument("--turns", type=int, help="user messages per conversation (default 4; 3 with --folder)")
    parser.add_argument(
        "--template",
        default="chatml",
        help="chatml, llama3, a Jinja template file, or a real family of benchmarks/template_zoo (e.g. gpt-oss)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--written",
        type=float,
        default=0.0,
        help="share of user turns (after the first) where the client writes the assistant message itself "
        "(a tool call it makes, then its result; or a typed reply) instead of asking the model",
    )
    parser.add_argument(
        "--api",
        choices=("chat", "openai", "responses", "messages"),
        default="chat",
        help="drive conversations through the chat API (default), /v1/chat/completions with messages only, "
        "/v1/responses or /v1/messages",
    )
    parser.add_argument("--concurrency", type=int, default=8, help="conversations at a time per arm")
    parser.add_argument(
        "--engine",
        choices=("hf", "vllm"),
        default="hf",
        help="the workers' engine; vllm runs them with the python of $TOKENTRAIL_VLLM_VENV "
        "(default ~/.cache/tokentrail/vllm-venv, built by scripts/vllm_env.sh)",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    parser.add_argument("--model-dir", help="use this model directory (and its template) instead of a tiny model")
    parser.add_argument("--dump", type=Path, help="also write every conversation (messages, turns) to this JSON file")
    parser.add_argument("--load", type=Path, help="evaluate the conversations of a --dump file; drive nothing")
    parser.add_argument(
        "--closer-policy",
        choices=("keep", "history"),
        default="keep",
        help="the workers' --closer-policy (matters where a template's history closer is not its stop token)",
    )
    parser.add_argument(
        "--folder",
        help="run the stitch arm on every template of a folder, one row each: 'all' (every source of "
        "benchmarks/template_zoo), a source (llama.cpp, vllm) or a directory of .jinja files",
    )
    parser.add_argument("--only", help="with --folder: comma-separated template file stems or family names")
    parser.add_argument(
        "--train-steps",
        type=int,
        default=100,
        help="--folder and real families of --template: training steps of the tiny model (cached)",
    )
    args = parser.parse_args(argv)
    if args.folder:
        opts = FolderOptions(
            conversations=args.conversations or 4,
            turns=args.turns or 3,
            seed=args.seed,
            concurrency=args.concurrency,
            train_steps=args.train_steps,
            closer_policy=args.closer_policy,
            written=args.written,
        )
        return run_folder(args.folder, args.only, opts, args.json)
    args.conversations = args.conversations or 20
    args.turns = args.turns or 4

    loaded = json.loads(args.load.read_text()) if args.load else None
    if loaded is not None:
        args.template, args.seed, args.turns = loaded["template"], loaded["seed"], loaded["turns"]
        args.engine = loaded.get("engine", "hf")
    model_dir = args.model_dir or (loaded["model_dir"] if loaded else prepare_model(args.template, args.train_steps))
    fmt = ChatFormat.load(model_dir)
    closers = PromptBuilder(fmt).shape.history_ends
    candidates = stop_candidates(fmt)
    scripts = [
        Script.make(args.seed, i, args.turns, tuple(candidates), args.written) for i in range(args.conversations)
    ]

    start = time.monotonic()
    if loaded is not None:
        convs = load_conversations(loaded)
        args.conversations = len(convs["stitch"])
    else:
        with (
            tempfile.TemporaryDirectory(prefix="tokentrail-exactness-") as tmp,
            running_arms(
                model_dir, Path(tmp), args.concurrency, args.engine, ["--closer-policy", args.closer_policy]
            ) as url,
        ):
            convs = asyncio.run(drive(url, scripts, args.concurrency, ARMS, api=args.api))
    driven = time.monotonic() - start
    say(f"conversations finished in {driven:.0f} s; re-rendering and re-scoring...")
    if args.dump is not None:
        meta = {
            "template": args.template,
            "seed": args.seed,
            "turns": args.turns,
            "written": args.written,
            "model_dir": model_dir,
            "engine": args.engine,
        }
        args.dump.write_text(json.dumps({**meta, "conversations": dump_conversations(convs)}, indent=1))
        say(f"conversations written to {args.dump}")
    evaluator = Evaluator(fmt, Scorer(model_dir), infer_cache_block(convs))
    reports = {arm: evaluator.evaluate(arm, convs[arm]) for arm in ARMS}
    config = {
        "engine": args.engine,
        "template": args.template,
        "model_dir": model_dir,
        "conversations": args.conversations,
        "turns": args.turns,
        "written": args.written,
        "seed": args.seed,
        "concurrency": args.concurrency,
        "api": args.api,
        "closer_policy": args.closer_policy,
        "stop_token_candidates": candidates,
        "closers": sorted(closers),
        "drive_s": round(driven, 1),
        "wall_s": round(time.monotonic() - start, 1),
    }
    if args.json:
        stitch = reports["stitch"].metrics()
        out = {
            "config": config,
            "arms": {arm: {"metrics": r.metrics(), "counts": r.counts} for arm, r in reports.items()},
            "targets": [{"metric": n, "target": req, "pass": ok} for n, req, ok in targets(stitch)],
            "stitch_failures": reports["stitch"].examples,
            "failed_turn_errors": {arm: r.errors for arm, r in reports.items()},
        }
        print(json.dumps(finite(out), indent=2))
    else:
        print_table(config, reports)
    return 0
