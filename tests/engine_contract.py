"""Engine contract suite (DESIGN D6/D7), run against any engine: ``python tests/engine_contract.py
--engine hf|vllm --model DIR [--device cpu|cuda] [--dtype float32|bfloat16|float16] [--tolerance X]``.
Prints one line per check, then ``N passed, M failed``; exits 1 on failure.

``--device``/``--dtype`` place the hf engine (vLLM picks its own device) and the teacher-forced reference
that its logprobs are compared with: the same device and dtype, so that the comparison measures the
engine, not a CPU/GPU difference. On CUDA, TF32 is switched off for the whole process (the engine and
the reference share it): float32 matmuls stay IEEE float32, as on CPU. The default tolerance is 1e-4 in
float32 (reached on CPU: 1e-6 to 1e-5) and looser for the 16-bit dtypes, whose rounding differs between a
batched decode step and a full teacher-forced pass.

Standalone on purpose: it imports only torch/transformers/safetensors and the engine under test, so it
runs in the vLLM environment too (scripts/vllm_env.sh), whose transformers is older than the server's.

The weights-update checks run last, in order (they change the engine's weights): refused checkpoints
change nothing; ``drain`` and ``inflight`` updates to checkpoints built here (the suite's model with seeded
noise, saved with ``save_pretrained`` as a trainer would) tag every step with the version that computed
it and match teacher forcing under the weights of that version; concurrent updates run one at a time.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import sys
import tempfile
import time
import traceback
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from worker.engines.contract import EngineError, GenerationParams, TokenStep, WeightsError

PROMPT = [5, 17, 42, 99, 7, 300, 11, 64, 128, 9]
LONG_PROMPT = [(7 * i) % 500 + 3 for i in range(600)]  # CPU vLLM caches whole blocks of 256
NOISE = 0.02  # std of the noise added to every weight of a pushed checkpoint (the untrained init's scale)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")
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

    @property
    def versions(self) -> list[int]:
        """The policy version of each token."""
        return [s.policy_version for s in self.steps for _ in s.token_ids]


def perturbed_checkpoint(base: str, out: Path, seed: int) -> Path:
    """``base`` with seeded Gaussian noise added to every weight, saved as a trainer saves a checkpoint
    (``save_pretrained``: safetensors and config.json; tied weights once), tokenizer files copied over."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, param in sorted(model.named_parameters(), key=lambda item: item[0]):
            param.add_(torch.randn(param.shape, generator=generator) * NOISE)
    model.save_pretrained(out)  # safetensors (the only format transformers 5 writes)
    for name in TOKENIZER_FILES:
        if (Path(base) / name).is_file():
            shutil.copy(Path(base) / name, out / name)
    assert any(out.glob("*.safetensors")), f"save_pretrained wrote no safetensors in {out}"
    return out


def refused_checkpoints(base: str, root: Path) -> dict[str, tuple[Path, str]]:
    """Directories an update must refuse, with the ``WeightsError`` code each must raise."""
    import torch
    from safetensors.torch import load_file, save_file

    cases: dict[str, tuple[Path, str]] = {"missing directory": (root / "absent", "weights_not_found")}
    config = json.loads((Path(base) / "config.json").read_text())
    pickled = root / "pickle-only"
    pickled.mkdir()
    (pickled / "config.json").write_text(json.dumps(config))
    (pickled / "pytorch_model.bin").write_bytes(b"not a pickle, and never unpickled")  # the check never opens it
    cases["pytorch_model.bin only"] = (pickled, "weights_not_safetensors")
    tensors: dict[str, torch.Tensor] = {}
    for file in sorted(Path(base).glob("*.safetensors")):
        tensors.update(load_file(str(file)))
    name = min(n for n, t in tensors.items() if t.dim() == 2)
    tensors[name] = tensors[name][:-1].clone()  # one row short
    shape = root / "wrong-shape"
    shape.mkdir()
    save_file(tensors, str(shape / "model.safetensors"), metadata={"format": "pt"})
    (shape / "config.json").write_text(json.dumps(config))
    cases[f"{name} a row short"] = (shape, "weights_mismatch")
    other = root / "other-architecture"
    other.mkdir()
    for file in Path(base).glob("*.safetensors"):
        shutil.copy(file, other / file.name)
    (other / "config.json").write_text(
        json.dumps({**config, "model_type": "gpt_neox", "architectures": ["GPTNeoXForCausalLM"]})
    )
    cases["another architecture"] = (other, "weights_mismatch")
    return cases


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
        self._workdir: tempfile.TemporaryDirectory[str] | None = None
        self._checkpoints: dict[int, Path] = {}
        self._references: dict[str, Any] = {}

    def cleanup(self) -> None:
        if self._workdir is not None:
            self._workdir.cleanup()
            self._workdir = None

    def workdir(self) -> Path:
        if self._workdir is None:
            self._workdir = tempfile.TemporaryDirectory(prefix="contract-weights-")
        return Path(self._workdir.name)

    def checkpoint(self, seed: int) -> Path:
        """The suite's model perturbed with noise seed ``seed`` (built once)."""
        if seed not in self._checkpoints:
            out = self.workdir() / f"noise-{seed}"
            out.mkdir()
            self._checkpoints[seed] = perturbed_checkpoint(self.model, out, seed)
        return self._checkpoints[seed]

    def reference(self, path: str | Path) -> Any:
        """The teacher-forcing model of checkpoint ``path``, where the engine runs, in its dtype."""
        key = str(path)
        if key not in self._references:
            import torch
            from transformers import AutoModelForCausalLM

            model = AutoModelForCausalLM.from_pretrained(key, dtype=getattr(torch, self.dtype))
            torch.nn.Module.to(model, torch.device(self.device))
            torch.nn.Module.eval(model)
            self._references[key] = model
        return self._references[key]

    def expected(self, path: str | Path, prompt: list[int], tokens: list[int], params: GenerationParams) -> Any:
        """``[len(tokens), vocab]`` processed logprobs of each token's position under checkpoint ``path``."""
        import torch

        from worker.sampling import teacher_forced_logprobs

        ids = prompt + tokens
        with torch.inference_mode():
            logits = self.reference(path)(input_ids=torch.tensor([ids], device=torch.device(self.device))).logits[0]
        return teacher_forced_logprobs(logits, ids, len(prompt), params).cpu()

    def worst(self, path: str | Path, prompt: list[int], out: Run, params: GenerationParams) -> float:
        """max |engine logprob - teacher forcing under ``path``| over ``out``'s tokens."""
        import torch

        from worker.sampling import gather_logprobs

        expected = gather_logprobs(self.expected(path, prompt, out.tokens, params), out.tokens)
        got = torch.tensor(out.logprobs, dtype=torch.float32)
        assert torch.isfinite(got).all(), f"non-finite logprob {got.tolist()}"
        return float((got - expected).abs().max())

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

    # ---- weights updates: these change the engine's weights, so they run last, in this order -------

    def distinct(self, stale: float, label: str) -> None:
        """The old weights' logprobs must be far off (else a stale KV cache would go unnoticed)."""
        if self.dtype == "float32":
            assert stale > 10 * self.tol, f"{label}: the checkpoints are too close to tell apart ({stale:.1e})"
        elif stale <= 10 * self.tol:
            self.notes.append(f"{label}: old and new weights differ by only {stale:.1e} in {self.dtype}")

    async def weights_refused(self) -> str:
        """Refused checkpoints raise WeightsError with the right code; nothing changes, not even for a
        request running meanwhile."""
        params = GenerationParams(max_new_tokens=24, temperature=0.0)
        before = await self.run(PROMPT, params)
        running = asyncio.create_task(self.run(PROMPT, params))
        root = self.workdir() / "refused"
        root.mkdir()
        cases = await asyncio.to_thread(refused_checkpoints, self.model, root)
        for i, (label, (path, code)) in enumerate(cases.items()):
            mode = "drain" if i % 2 else "inflight"
            try:
                await self.engine.update_weights(str(path), 1, mode)  # type: ignore[attr-defined]
            except WeightsError as exc:
                assert exc.code == code, f"{label}: code {exc.code}, not {code} ({exc})"
            else:
                raise AssertionError(f"{label}: the update was accepted")
            assert self.engine.policy_version == 0, f"{label}: policy_version {self.engine.policy_version}"  # type: ignore[attr-defined]
        during = await running
        after = await self.run(PROMPT, params)
        for label, out in (("during", during), ("after", after)):
            assert out.tokens == before.tokens, f"{label}: {out.tokens} != {before.tokens}"
            delta = max(abs(a - b) for a, b in zip(out.logprobs, before.logprobs, strict=True))
            assert delta < self.tol, f"{label}: logprobs moved by {delta:.2e}"
            assert set(out.versions) == {0}, f"{label}: versions {set(out.versions)}"
        return f"{len(cases)} refused ({', '.join(cases)}); version 0 serves unchanged"

    async def _consume(
        self,
        prompt: list[int],
        params: GenerationParams,
        started: asyncio.Event,
        stop: Callable[[Run], bool],
        tokens: int = 1,
    ) -> Run:
        """Run a request, setting ``started`` once it has ``tokens`` tokens; abort it once ``stop(run)``."""
        self._ids += 1
        rid = f"req-{self._ids}"
        out = Run()
        aborted = False
        async for step in self.engine.generate(rid, prompt, params):  # type: ignore[attr-defined]
            out.steps.append(step)
            if len(out.tokens) >= tokens:
                started.set()
            if not aborted and step.finish_reason is None and stop(out):
                aborted = True
                await self.engine.abort(rid)  # type: ignore[attr-defined]
        return out

    async def weights_drain(self) -> str:
        """drain: requests running at the push finish on version 0; one sent during the push waits and
        runs on version 1, with no prefix cached under version 0."""
        new = await asyncio.to_thread(self.checkpoint, 1)
        greedy = GenerationParams(max_new_tokens=48, temperature=0.0)
        sampled = GenerationParams(max_new_tokens=48, temperature=0.8, seed=11)
        events = [asyncio.Event(), asyncio.Event()]
        old = [
            asyncio.create_task(self._consume(PROMPT, greedy, events[0], lambda _: False)),
            asyncio.create_task(self._consume(PROMPT[:6], sampled, events[1], lambda _: False)),
        ]
        await asyncio.gather(*(e.wait() for e in events))
        assert not any(t.done() for t in old), "a request finished before the push: nothing to drain"
        update = asyncio.create_task(self.engine.update_weights(str(new), 1, "drain"))  # type: ignore[attr-defined]
        await asyncio.sleep(0.05)  # the push has begun: a request sent now must wait for version 1
        waiting = GenerationParams(max_new_tokens=8, temperature=0.0)
        late = asyncio.create_task(self.run(LONG_PROMPT, waiting))
        await update
        assert self.engine.policy_version == 1, f"policy_version {self.engine.policy_version}"  # type: ignore[attr-defined]
        runs = await asyncio.gather(*old)
        out = await late
        parts = []
        for label, run, prompt, params in (
            ("greedy", runs[0], PROMPT, greedy),
            ("t=0.8", runs[1], PROMPT[:6], sampled),
        ):
            assert run.last.finish_reason == "length" and len(run.tokens) == 48, (label, run.last)
            assert set(run.versions) == {0}, f"{label}: versions {run.versions}"
            worst = self.worst(self.model, prompt, run, params)
            assert worst < self.tol, f"{label}: |Δ| {worst:.2e} under the old weights"
            parts.append(f"{label} {worst:.1e}")
        assert set(out.versions) == {1}, f"sent during the push: versions {out.versions}"
        cached = out.steps[0].num_cached_tokens
        assert not cached, f"{cached} prompt tokens served from a cache computed by the old weights"
        worst = self.worst(new, LONG_PROMPT, out, waiting)
        assert worst < self.tol, f"sent during the push: |Δ| {worst:.2e} under the new weights"
        stale = self.worst(self.model, LONG_PROMPT, out, waiting)
        self.distinct(stale, "sent during the push")
        return f"running on v0 ({', '.join(parts)}); waiting one on v1 {worst:.1e} (v0 would be {stale:.1e})"

    async def weights_inflight(self) -> str:
        """inflight: long requests (8 tokens in) switch from version 1 to 2 between two steps; every logprob matches
        teacher forcing of the whole sequence under the weights of its step's version (no stale KV)."""
        old, new = await asyncio.to_thread(self.checkpoint, 1), await asyncio.to_thread(self.checkpoint, 2)
        cases = {
            "greedy": (PROMPT, GenerationParams(max_new_tokens=900, temperature=0.0)),
            "t=0.8,top_k=50": (PROMPT[:7], GenerationParams(max_new_tokens=900, temperature=0.8, top_k=50, seed=21)),
        }
        events = [asyncio.Event() for _ in cases]

        def after_switch(run: Run) -> bool:  # four tokens on version 2 are enough, or give up at 600
            return sum(v == 2 for v in run.versions) >= 4 or len(run.tokens) >= 600

        tasks = [
            asyncio.create_task(self._consume(prompt, params, event, after_switch, tokens=8))
            for (prompt, params), event in zip(cases.values(), events, strict=True)
        ]
        await asyncio.gather(*(e.wait() for e in events))
        await self.engine.update_weights(str(new), 2, "inflight")  # type: ignore[attr-defined]
        assert self.engine.policy_version == 2, f"policy_version {self.engine.policy_version}"  # type: ignore[attr-defined]
        runs = await asyncio.gather(*tasks)
        parts = []
        for (label, (prompt, params)), run in zip(cases.items(), runs, strict=True):
            versions = run.versions
            assert versions == sorted(versions) and set(versions) == {1, 2}, f"{label}: versions {versions}"
            switch = versions.index(2)
            assert run.last.finish_reason == "abort", f"{label}: {run.last}"
            got = run.logprobs
            before = self.expected(old, prompt, run.tokens, params)
            after = self.expected(new, prompt, run.tokens, params)
            rows = [
                (before if v == 1 else after)[i, t] for i, (t, v) in enumerate(zip(run.tokens, versions, strict=True))
            ]
            deltas = [abs(g - float(r)) for g, r in zip(got, rows, strict=True)]
            old_worst, new_worst = max(deltas[:switch]), max(deltas[switch:])
            assert old_worst < self.tol, f"{label}: |Δ| {old_worst:.2e} before the switch (old weights)"
            assert new_worst < self.tol, f"{label}: |Δ| {new_worst:.2e} after the switch (new weights, full context)"
            stale = max(abs(g - float(before[i, t])) for i, (g, t) in enumerate(zip(got, run.tokens, strict=True)))
            self.distinct(stale, label)
            parts.append(f"{label}: {switch}+{len(versions) - switch} tokens, {old_worst:.1e}/{new_worst:.1e}")
        return "; ".join(parts)

    async def weights_serialised_then_fresh(self) -> str:
        """Concurrent updates run one at a time (the last one wins); then greedy decoding matches the new
        checkpoint (teacher forcing; for hf also a fresh engine started from it), prefix cache rebuilt."""
        first, last = await asyncio.to_thread(self.checkpoint, 1), await asyncio.to_thread(self.checkpoint, 3)
        await asyncio.gather(
            self.engine.update_weights(str(first), 3, "drain"),  # type: ignore[attr-defined]
            self.engine.update_weights(str(last), 4, "inflight"),  # type: ignore[attr-defined]
        )
        assert self.engine.policy_version == 4, f"policy_version {self.engine.policy_version}"  # type: ignore[attr-defined]
        params = GenerationParams(max_new_tokens=12, temperature=0.0, top_logprobs=2)
        runs = [await self.run(LONG_PROMPT, params), await self.run(LONG_PROMPT, params)]
        cached = [r.steps[0].num_cached_tokens for r in runs]
        assert not cached[0], f"{cached[0]} prompt tokens from a cache computed by older weights"
        parts = [f"num_cached_tokens {cached}"]
        for run in runs:
            assert set(run.versions) == {4}, f"versions {run.versions}"
            worst = self.worst(last, LONG_PROMPT, run, params)
            assert worst < self.tol, f"|Δ| {worst:.2e} under the new weights"
            reference = self.expected(last, LONG_PROMPT, run.tokens, params)
            for token, row in zip(run.tokens, reference, strict=True):
                gap = float(row.max() - row[token])
                assert gap < self.tol, f"greedy token {token} is {gap:.2e} below the new weights' argmax"
        parts.append(f"greedy == teacher forcing under the new weights, |Δ| {worst:.1e}")
        if self.name == "hf":
            fresh = make_engine("hf", str(last), self.device, self.dtype)
            await fresh.start()  # type: ignore[attr-defined]
            try:
                out = Run()
                async for step in fresh.generate("fresh", LONG_PROMPT, params):  # type: ignore[attr-defined]
                    out.steps.append(step)
            finally:
                await fresh.close()  # type: ignore[attr-defined]
            assert out.tokens == runs[0].tokens, f"fresh engine {out.tokens} != updated {runs[0].tokens}"
            delta = max(abs(a - b) for a, b in zip(out.logprobs, runs[0].logprobs, strict=True))
            assert delta < self.tol, f"fresh engine logprobs differ by {delta:.2e}"
            parts.append(f"== a fresh engine ({delta:.1e})")
        return "; ".join(parts)


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
    "weights_refused",
    "weights_drain",
    "weights_inflight",
    "weights_serialised_then_fresh",
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
        contract.cleanup()
    try:  # a closed engine refuses updates
        await engine.update_weights(model, 9, "drain")  # type: ignore[attr-defined]
    except EngineError as exc:
        passed += 1
        print(f"ok   {name} weights_after_close: {exc.code}", flush=True)
    except Exception as exc:
        failed += 1
        print(f"FAIL {name} weights_after_close: {exc!r}", flush=True)
    else:
        failed += 1
        print(f"FAIL {name} weights_after_close: a closed engine accepted an update", flush=True)
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
