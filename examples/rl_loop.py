"""A small on-policy RL loop with tokentrail in it, on CPU in a few minutes.

    pip install -e '.[test]'          # tokentrail, torch (CPU), the openai SDK
    python examples/rl_loop.py [--steps 10] [--agents 16] [--target 12] [--mode drain]

Each step:

1. agents play through the ``openai`` SDK against tokentrail (``/v1/chat/completions``): each asks the
   policy one question;
2. the finished rollouts come back from tokentrail with their exact token ids, the logprob of every
   sampled token (the behaviour policy) and the weights version of every token (``policy_versions``);
3. the reward: 1 for a reply that ends (the model's own end token) within ``--target`` tokens, else 0;
4. a few policy-gradient steps (PPO's clipped importance ratio against the stored logprobs, advantage =
   reward minus the step's mean) on a copy of the tiny model held by this script, the trainer;
5. the new checkpoint is saved (safetensors) and pushed to the workers as the next version
   (``POST /admin/models/policy/weights``); the next step's rollouts come from it.

The reward it optimises rises over the steps. At the end every rollout is re-scored by teacher forcing
under the checkpoint of the version its tokens record (they must match within 1e-4), and the stored
conversations are exported (``tokentrail export``: each token's version and each version's checkpoint)
and checked by ``tokentrail verify``, which loads each version's weights from the export.

The server and its worker run as one child process (``tokentrail serve --model``) on embedded defaults
in a temporary directory; the script stops it at the end.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import torch
from openai import OpenAI

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.policy_check import TOLERANCE, Scorer  # noqa: E402
from tokentrail.launcher import free_port  # noqa: E402
from worker.tiny import resolve_model  # noqa: E402

MODEL = "policy"
QUESTIONS = ["hello", "what is two plus two", "name a colour", "tell me a story", "how are you", "say yes"]


def start_server(work: Path, base: str, port: int) -> tuple[subprocess.Popen[bytes], str, str]:
    """``tokentrail serve --model`` (server and worker in one process); returns it, an admin key and a
    user key."""
    data = work / "data"

    def cli(*args: str) -> str:
        out = subprocess.run([sys.executable, "-m", "tokentrail", *args, "--data-dir", str(data)],
                             check=True, capture_output=True, text=True)  # fmt: skip
        return out.stdout.strip()

    cli("db", "upgrade")
    admin = cli("admin", "create-user", "trainer", "--admin")
    agent = cli("admin", "create-user", "agents")
    log = (work / "server.log").open("wb")
    proc = subprocess.Popen(
        [sys.executable, "-m", "tokentrail", "serve", "--model", base, "--served-model-name", MODEL,
         "--port", str(port), "--data-dir", str(data), "--log-level", "warning", "--max-parallel", "16"],
        stdout=log, stderr=subprocess.STDOUT,
        env={**_env(), "TOKENTRAIL_RATE_LIMIT_PER_MINUTE": "0"},
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    for _ in range(600):
        try:
            if any(m["name"] == MODEL for m in httpx.get(f"{url}/configs/model_configs", timeout=2).json()):
                return proc, admin, agent
        except (httpx.HTTPError, ValueError):
            pass
        if proc.poll() is not None:
            raise SystemExit(f"the server exited; see {work / 'server.log'}")
        time.sleep(0.2)
    raise SystemExit("the server did not start in 120 s")


def _env() -> dict[str, str]:
    import os

    return dict(os.environ)


def play(client: OpenAI, question: str, max_tokens: int) -> tuple[str, str]:
    """One agent's episode: a question, the policy's reply. Returns (chat id, message id)."""
    reply = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": question}],
        max_tokens=max_tokens,
        temperature=1.0,
    )
    info = (reply.choices[0].model_extra or {})["tokentrail"]
    return info["chat_id"], info["message_id"]


def rollout(url: str, key: str, chat: str, mid: str) -> dict[str, Any]:
    """The stored message: prompt and completion ids, logprobs, finish reason, policy versions."""
    resp = httpx.get(f"{url}/chats/{chat}/messages/{mid}", params={"include": "tokens"},
                     headers={"Authorization": f"Bearer {key}"}, timeout=30)  # fmt: skip
    resp.raise_for_status()
    return dict(resp.json())


def reward(msg: dict[str, Any], target: int) -> float:
    return 1.0 if msg["finish_reason"] == "stop" and len(msg["completion_token_ids"]) <= target else 0.0


def train_step(model: Any, optimizer: torch.optim.Optimizer, batch: list[dict[str, Any]], rewards: list[float],
               epochs: int, clip: float) -> float:  # fmt: skip
    """PPO-clip on the batch: the importance ratio new/behaviour from the stored logprobs. Returns the
    last epoch's loss."""
    mean = statistics.fmean(rewards)
    loss_value = 0.0
    for _ in range(epochs):
        optimizer.zero_grad()
        total = torch.zeros(())
        count = 0
        for msg, r in zip(batch, rewards, strict=True):
            advantage = r - mean
            completion = msg["completion_token_ids"]
            if not completion or advantage == 0.0:
                continue
            ids = torch.tensor([msg["prompt_token_ids"] + completion])
            logits = model(input_ids=ids).logits[0, -len(completion) - 1 : -1].float()
            new = torch.log_softmax(logits, dim=-1).gather(1, torch.tensor(completion)[:, None])[:, 0]
            old = torch.tensor([lp if lp is not None else 0.0 for lp in msg["logprobs"]])
            ratio = torch.exp(new - old)
            surrogate = torch.minimum(ratio * advantage, torch.clamp(ratio, 1 - clip, 1 + clip) * advantage)
            total = total - surrogate.sum()
            count += len(completion)
        if count == 0:
            return 0.0
        loss = total / count
        loss.backward()
        optimizer.step()
        loss_value = float(loss.detach())
    return loss_value


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--agents", type=int, default=16, help="rollouts per step")
    ap.add_argument("--target", type=int, default=12, help="reward 1 for a reply that ends within this many tokens")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--epochs", type=int, default=4, help="gradient steps per batch")
    ap.add_argument("--mode", choices=("drain", "inflight"), default="drain")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", action="store_true", help="print the per-step figures as JSON at the end")
    args = ap.parse_args()

    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # type: ignore[no-untyped-call]
    torch.manual_seed(args.seed)
    base = resolve_model("tiny")
    hf: Any = AutoModelForCausalLM
    model = hf.from_pretrained(base, dtype=torch.float32).train()
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)

    with tempfile.TemporaryDirectory(prefix="tt-rl-") as tmp:
        work = Path(tmp)
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        proc, admin_key, agent_key = start_server(work, base, port)
        client = OpenAI(base_url=f"{url}/v1", api_key=agent_key, max_retries=2)
        checkpoints: dict[int, str | Path] = {0: base}
        rows: list[dict[str, Any]] = []
        everything: list[dict[str, Any]] = []
        started = time.monotonic()
        try:
            for step in range(args.steps):
                t0 = time.monotonic()
                questions = [QUESTIONS[(step * args.agents + i) % len(QUESTIONS)] for i in range(args.agents)]
                with ThreadPoolExecutor(args.agents) as pool:
                    ids = list(pool.map(lambda q: play(client, q, args.max_tokens), questions))
                batch = [rollout(url, agent_key, chat, mid) for chat, mid in ids]
                everything += batch
                rewards = [reward(m, args.target) for m in batch]
                versions = sorted({v for m in batch for _, v in m["policy_versions"]})
                loss = train_step(model, optimizer, batch, rewards, args.epochs, clip=0.2)
                version = step + 1
                out = work / f"v{version}"
                model.save_pretrained(str(out), safe_serialization=True)
                checkpoints[version] = out
                push = httpx.post(
                    f"{url}/admin/models/{MODEL}/weights",
                    json={"path": str(out), "version": version, "mode": args.mode},
                    headers={"Authorization": f"Bearer {admin_key}"},
                    timeout=600,
                )
                push.raise_for_status()
                row = {
                    "step": step,
                    "reward": round(statistics.fmean(rewards), 3),
                    "mean_tokens": round(statistics.fmean(len(m["completion_token_ids"]) for m in batch), 1),
                    "rollout_versions": versions,
                    "loss": round(loss, 4),
                    "pushed": version,
                    "push_s": push.json()["seconds"],
                    "step_s": round(time.monotonic() - t0, 1),
                }
                rows.append(row)
                print(
                    f"step {step:2d}  reward {row['reward']:.3f}  mean tokens {row['mean_tokens']:5.1f}  "
                    f"rollouts on version {versions}  pushed version {version} in {row['push_s']:.3f}s  "
                    f"({row['step_s']:.1f}s)",
                    flush=True,
                )
            scorer = Scorer(checkpoints)
            worst = max(scorer.max_delta(m) for m in everything)
        finally:
            proc.terminate()
            proc.wait(timeout=30)
        export = work / "rollouts.jsonl"
        data = ["--data-dir", str(work / "data")]
        tt = [sys.executable, "-m", "tokentrail"]
        subprocess.run([*tt, "export", "--out", str(export), "--quiet", *data], check=True)
        verify = subprocess.run([*tt, "verify", str(export), "--model", base], capture_output=True, text=True)
    first, last = rows[0]["reward"], statistics.fmean(r["reward"] for r in rows[-3:])
    print(f"reward: {first:.3f} at step 0, {last:.3f} over the last 3 steps "
          f"({len(everything)} rollouts, {time.monotonic() - started:.0f}s)")  # fmt: skip
    print(f"teacher forcing under each rollout's recorded version: max |delta logprob| = {worst:.2e} "
          f"({'ok' if worst < TOLERANCE else 'MISMATCH'})")  # fmt: skip
    print(f"tokentrail verify of the export: {verify.stdout.strip().splitlines()[-1] if verify.stdout else ''}")
    if args.json:
        print(json.dumps(rows, indent=2))
    sys.exit(0 if worst < TOLERANCE and verify.returncode == 0 else 1)


if __name__ == "__main__":
    main()
