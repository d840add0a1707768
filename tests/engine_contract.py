"""Engine contract suite (DESIGN D6/D7), run against any engine: ``python tests/engine_contract.py
--engine hf|vllm --model DIR [--device cpu|cuda] [--dtype float32|bfloat16|float16] [--tolerance X]``.
Prints one line per check, then ``N passed, M failed``; exits 1 on failure.

``--device``/``--dtype`` place the hf engine (vLLM picks its own device) and the teacher-forced reference
that its logprobs are compared with: the same device and dtype, so that the comparison measures the
engine, not a CPU/GPU difference. On CUDA, TF32 is switched off for the whole process (the engine and
the reference share it): float32 matmuls stay IEEE float32, as on CPU. The default tolerance is 1e-4 in
float32 (reached on CPU: 1e-6 to 1e-5) and looser for the 16-bit dtypes, whose rounding differs between a
batched decode step and a full teacher-forced pass.

Standalone on purpose: it imports only torch/transformers and the engine under test, so it runs in
the vLLM environment too (scripts/vllm_env.sh), whose transformers is older than the server's.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
import traceback
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from worker.engines.contract import EngineError, GenerationParams, TokenStep

PROMPT = [5, 17, 42, 99, 7, 300, 11, 64, 128, 9]
TOLERANCE = {"hf": 1e-4, "vllm": 1e-4}  # float32: reached on CPU 1e-6 to 1e-5 for both
HALF_TOLERANCE = {"bfloat16": 0.5, "float16": 0.1}  # 16-bit dtypes: a sanity bound, not exactness
DTYPES = ("float32", "bfloat16", "float16")


@dataclass
class Run:
    steps: list[TokenStep] = field(default_factory=list)

    @property
    def tokens(self) -> list[int]:
        return [t for s in self.steps for t in s.token_ids]

    @property
    def logprobs(self) -> list[float]:
        return [lp for s in self.steps for lp in s.logprobs]

    @property
    def last(self) -> TokenStep:
        return self.steps[-1]


def tolerance(engine: str, dtype: str) -> float:
    """The logprob tolerance of the teacher-forcing check for an engine and dtype."""
    return TOLERANCE[engine] if dtype == "float32" else HALF_TOLERANCE[dtype]


def no_tf32() -> None:
    """float32 matmuls (and cuDNN) in full IEEE float32 on CUDA, for the engine and the reference alike.
    PyTorch's default already is "highest"; this pins it against an environment that changed it."""
    import torch

    torch.set_float32_matmul_precision("highest")
    torch.backends.cudnn.allow_tf32 = False


class Contract:
    def __init__(
        self,
        engine_name: str,
        model: str,
        engine: object,
        *,
        device: str = "cpu",
        dtype: str = "float32",
        tol: float | None = None,
    ) -> None:
        self.name, self.model, self.engine = engine_name, model, engine
        self.device, self.dtype = device, dtype
        self.tol = tolerance(engine_name, dtype) if tol is None else tol
        self._ids = 0
        self.notes: list[str] = []

    async def run(self, prompt: list[int], params: GenerationParams) -> Run:
        self._ids += 1
        out = Run()
        async for step in self.engine.generate(f"req-{self._ids}", prompt, params):  # type: ignore[attr-defined]
            out.steps.append(step)
        return out

    # ---- checks ----------------------------------------------------------------------------------

    async def prompt_ids_echoed(self) -> str:
        out = await self.run(PROMPT, GenerationParams(max_new_tokens=3, temperature=0.0))
        assert out.steps[0].prompt_token_ids == PROMPT, f"engine reports {out.steps[0].prompt_token_ids}"
        assert all(s.prompt_token_ids is None for s in out.steps[1:]), "prompt ids after the first step"
        return f"cached={out.steps[0].num_cached_tokens}"

    async def prefix_cache_reported(self) -> str:
        prompt = [(7 * i) % 500 + 3 for i in range(600)]  # CPU vLLM caches whole blocks of 256
        params = GenerationParams(max_new_tokens=2, temperature=0.0)
        await self.run(prompt, params)
        out = await self.run(prompt, params)
        cached = out.steps[0].num_cached_tokens
        if self.name == "vllm":  # prefix caching is on by default in the vllm engine
            assert cached is not None and 0 < cached < len(prompt), f"num_cached_tokens={cached}"
        else:
            assert cached is None or 0 <= cached < len(prompt), f"num_cached_tokens={cached}"
        return f"repeat of a {len(prompt)}-token prompt: num_cached_tokens={cached}"

    async def max_new_tokens_length(self) -> str:
        out = await self.run(PROMPT, GenerationParams(max_new_tokens=17, temperature=0.0))
        assert len(out.tokens) == 17, f"{len(out.tokens)} tokens"
        assert len(out.logprobs) == 17, f"{len(out.logprobs)} logprobs"
        assert out.last.finish_reason == "length" and out.last.stop_reason is None, out.last
        assert all(s.finish_reason is None for s in out.steps[:-1]), "finish_reason before the last step"
        return "17 tokens, length"

    async def stop_token_ids(self) -> str:
        free = await self.run(PROMPT, GenerationParams(max_new_tokens=20, temperature=0.0))
        toks = free.tokens
        j = next(i for i in range(2, len(toks)) if toks[i] not in toks[:i])
        stop = toks[j]
        out = await self.run(PROMPT, GenerationParams(max_new_tokens=20, temperature=0.0, stop_token_ids=(stop, 3)))
        assert out.tokens == toks[: j + 1], f"{out.tokens} != {toks[: j + 1]}"
        assert out.last.finish_reason == "stop" and out.last.stop_reason == stop, out.last
        return f"stopped on {stop} after {j + 1} tokens"

    async def same_seed_same_tokens(self) -> str:
        params = GenerationParams(max_new_tokens=30, temperature=1.0, seed=1234)
        a, b = await self.run(PROMPT, params), await self.run(PROMPT, params)
        c = await self.run(PROMPT, GenerationParams(max_new_tokens=30, temperature=1.0, seed=4321))
        assert a.tokens == b.tokens, f"{a.tokens} != {b.tokens}"
        assert a.tokens != c.tokens, "another seed gave the same 30 tokens"
        return "same seed equal, other seed differs"

    async def unseeded_sampling(self) -> str:
        """No seed: the engine's own randomness (DESIGN D17), alone and batched with seeded requests."""
        unseeded = GenerationParams(max_new_tokens=30, temperature=1.0)
        a, b = await self.run(PROMPT, unseeded), await self.run(PROMPT, unseeded)
        assert len(a.tokens) == len(b.tokens) == 30 and a.last.finish_reason == "length", a.last
        assert a.tokens != b.tokens, "two unseeded runs gave the same 30 tokens"
        mixed = [GenerationParams(max_new_tokens=20, temperature=1.0, seed=7 if i % 2 else None) for i in range(6)]
        outs = await asyncio.gather(*(self.run(PROMPT[: 4 + i], p) for i, p in enumerate(mixed)))
        assert all(len(o.tokens) == 20 for o in outs), [len(o.tokens) for o in outs]
        return "unseeded runs differ; 6 seeded and unseeded requests batched"

    async def abort_within_a_step(self) -> str:
        rid = "abort-me"
        gen = self.engine.generate(rid, PROMPT, GenerationParams(max_new_tokens=1000, temperature=1.0, seed=1))  # type: ignore[attr-defined]
        before, after, final = 0, 0, None
        async for step in gen:
            if final is not None:
                raise AssertionError("step after the final one")
            if step.finish_reason is not None:
                final = step
            if before < 5 and final is None:
                before += len(step.token_ids)
                if before >= 5:
                    await self.engine.abort(rid)  # type: ignore[attr-defined]
            else:
                after += len(step.token_ids)
        assert final is not None and final.finish_reason == "abort", final
        assert after <= 2, f"{after} tokens arrived after abort"
        # the engine is still usable and the id can be reused
        again = await self.run(PROMPT, GenerationParams(max_new_tokens=2, temperature=0.0))
        assert len(again.tokens) == 2
        return f"{after} token(s) after abort"

    async def many_concurrent(self) -> str:
        n = 16
        solo = await self.run(PROMPT, GenerationParams(max_new_tokens=40, temperature=0.0))
        params = [GenerationParams(max_new_tokens=40 + i, temperature=0.9, seed=i) for i in range(n)]
        greedy = GenerationParams(max_new_tokens=40, temperature=0.0)
        start = time.perf_counter()
        outs = await asyncio.gather(
            *(self.run(PROMPT[: 3 + i % 7], p) for i, p in enumerate(params)), self.run(PROMPT, greedy)
        )
        elapsed = time.perf_counter() - start
        for i, out in enumerate(outs[:n]):
            assert out.steps[0].prompt_token_ids == PROMPT[: 3 + i % 7]
            assert len(out.tokens) == 40 + i and out.last.finish_reason == "length", (i, len(out.tokens), out.last)
        same = outs[n].tokens == solo.tokens
        if not same:
            self.notes.append("batched greedy tokens differ from the solo run (not batch-invariant)")
        return f"{n + 1} requests in {elapsed:.2f}s; batched greedy == solo: {same}"

    async def context_overflow(self) -> str:
        limit = self.engine.info.max_context  # type: ignore[attr-defined]
        try:
            await self.run([5] * limit, GenerationParams(max_new_tokens=2))
        except EngineError as exc:
            assert exc.code == "context_overflow", exc.code
            return f"max_context={limit}"
        raise AssertionError("no EngineError for a prompt that fills the context")

    async def logprobs_match_teacher_forcing(self) -> str:
        import torch
        from transformers import AutoModelForCausalLM

        from worker.sampling import gather_logprobs, teacher_forced_logprobs

        # the reference runs where the engine runs, in its dtype: the same kernels, the same rounding
        device = torch.device(self.device)
        model = AutoModelForCausalLM.from_pretrained(self.model, dtype=getattr(torch, self.dtype))
        torch.nn.Module.to(model, device)
        torch.nn.Module.eval(model)
        cases = {
            "greedy": GenerationParams(max_new_tokens=40, temperature=0.0, top_logprobs=3),
            "t=0.7": GenerationParams(max_new_tokens=40, temperature=0.7, seed=3, top_logprobs=3),
            "t=1.2,top_k=50": GenerationParams(max_new_tokens=40, temperature=1.2, top_k=50, seed=4),
            "top_p=0.9": GenerationParams(max_new_tokens=40, temperature=1.0, top_p=0.9, seed=5),
            "rep=1.3": GenerationParams(max_new_tokens=40, temperature=0.8, repetition_penalty=1.3, seed=6),
            "unseeded,top_k=20": GenerationParams(max_new_tokens=40, temperature=1.0, top_k=20),
        }
        worst, parts = 0.0, []
        for label, params in cases.items():
            out = await self.run(PROMPT, params)
            ids = PROMPT + out.tokens
            with torch.inference_mode():
                logits = model(input_ids=torch.tensor([ids], device=device)).logits[0]
            ref = teacher_forced_logprobs(logits, ids, len(PROMPT), params).cpu()
            expected = gather_logprobs(ref, out.tokens)
            got = torch.tensor(out.logprobs, dtype=torch.float32)
            assert torch.isfinite(got).all(), f"{label}: non-finite logprob {got.tolist()}"
            delta = float((got - expected).abs().max())
            if params.top_logprobs:
                for step_top, row in zip((t for s in out.steps for t in (s.top_logprobs or [])), ref, strict=True):
                    assert len(step_top) == params.top_logprobs, f"{label}: top logprobs {step_top}"
                    if self.dtype == "float32":
                        assert step_top[0][0] == int(row.argmax()), f"{label}: top-1 {step_top[0]} is not the argmax"
                    else:  # 16-bit: near-ties may swap; the top-1 must still be within tolerance of the max
                        gap = float(row.max() - row[step_top[0][0]])
                        assert gap < self.tol, f"{label}: top-1 {step_top[0]} is {gap:.2e} below the reference max"
                    for tid, lp in step_top:
                        delta = max(delta, abs(lp - float(row[tid])))
            worst = max(worst, delta)
            parts.append(f"{label} {delta:.1e}")
        tol = self.tol
        assert worst < tol, f"max |Δ| {worst:.2e} >= {tol:.0e} ({', '.join(parts)})"
        return f"max |Δ| {worst:.2e} < {tol:.0e} on {self.device} {self.dtype} ({', '.join(parts)})"


CHECKS: list[str] = [
    "prompt_ids_echoed",
    "prefix_cache_reported",
    "max_new_tokens_length",
    "stop_token_ids",
    "same_seed_same_tokens",
    "unseeded_sampling",
    "abort_within_a_step",
    "many_concurrent",
    "context_overflow",
    "logprobs_match_teacher_forcing",
]


def make_engine(name: str, model: str, device: str = "cpu", dtype: str = "float32") -> object:
    if name == "hf":
        from worker.engines.hf import HFEngine

        return HFEngine(model, device=device, dtype=dtype)
    from worker.engines.vllm import VLLMEngine

    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    return VLLMEngine(model, dtype=dtype, max_model_len=1024, gpu_memory_utilization=0.2)


def describe_device(device: str) -> str:
    import torch

    if device != "cuda":
        return f"torch {torch.__version__}, {device}"
    props = torch.cuda.get_device_properties(0)
    try:
        matmul, cudnn = torch.get_float32_matmul_precision(), torch.backends.cudnn.allow_tf32
        tf32 = f"float32 matmul precision {matmul}, cudnn tf32 {cudnn}"
    except RuntimeError as exc:  # e.g. torch refusing a read that mixes its legacy and new precision settings
        tf32 = f"precision settings unreadable: {exc}"
    return f"torch {torch.__version__}, cuda {torch.version.cuda}, {props.name}, {tf32}"


async def run_suite(
    name: str, model: str, device: str = "cpu", dtype: str = "float32", tol: float | None = None
) -> int:
    if device == "cuda":
        import torch

        if not torch.cuda.is_available():
            print(f"FAIL {name} setup: --device cuda but torch {torch.__version__} sees no GPU", flush=True)
            return 1
        no_tf32()
    engine = make_engine(name, model, device, dtype)
    start = time.perf_counter()
    await engine.start()  # type: ignore[attr-defined]
    print(f"[{name}] engine started in {time.perf_counter() - start:.1f}s ({describe_device(device)})", flush=True)
    contract = Contract(name, model, engine, device=device, dtype=dtype, tol=tol)
    passed = failed = 0
    try:
        for check in CHECKS:
            fn: Callable[[], Awaitable[str]] = getattr(contract, check)
            try:
                detail = await asyncio.wait_for(fn(), timeout=120)
            except Exception as exc:
                failed += 1
                print(f"FAIL {name} {check}: {exc!r}", flush=True)
                traceback.print_exc(limit=3)
            else:
                passed += 1
                print(f"ok   {name} {check}: {detail}", flush=True)
    finally:
        await engine.close()  # type: ignore[attr-defined]
    for note in contract.notes:
        print(f"note {name}: {note}")
    print(f"{passed} passed, {failed} failed")
    return 1 if failed else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--engine", choices=["hf", "vllm"], required=True)
    parser.add_argument("--model", required=True, help="model directory (e.g. `tokentrail model tiny --no-train`)")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="hf: where the engine runs")
    parser.add_argument("--dtype", choices=DTYPES, default="float32", help="the engine's and the reference's dtype")
    parser.add_argument(
        "--tolerance", type=float, help="max |Δ logprob| against teacher forcing (default: 1e-4 in float32)"
    )
    args = parser.parse_args(argv)
    return asyncio.run(run_suite(args.engine, args.model, args.device, args.dtype, args.tolerance))


if __name__ == "__main__":
    sys.exit(main())
