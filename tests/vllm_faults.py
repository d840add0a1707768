"""Engine faults of the vllm engine on CPU, run with the vLLM environment's python
(tests/test_vllm_faults.py): ``--model DIR [--chunked-prefill on|off|auto]``. Prints one line per check,
exits 1 on failure. Small on purpose: vLLM on CPU busy-polls its cores.

1. seeded long prompts sharing one step's token budget: with chunked prefill (vLLM's default, and this
   adapter's before issue 23) the second prompt is prefilled in parts, vLLM rewinds its seeded CPU
   generator and the engine core dies (``CPU Generator does not use offset``). The adapter's default on
   CPU (no chunked prefill) must serve them all; ``--chunked-prefill on`` must refuse the seeded requests
   with ``unsupported_parameter`` instead of dying.
2. the engine core killed (fault injection): every stream and the next request end with ``EngineDead``,
   and ``failure()`` says why.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time

from worker.engines.contract import EngineError, GenerationParams
from worker.engines.vllm import VLLMEngine

BUDGET = 256  # max_model_len = max_num_batched_tokens: two 200-token prompts cannot share a step
PROMPT = 200


def prompt(i: int) -> list[int]:
    return [(7 * i + k) % 200 + 5 for k in range(PROMPT)]


async def one(engine: VLLMEngine, i: int, seed: int | None, tokens: int = 4) -> str:
    """How request ``i`` ended: "length", or the error's code."""
    try:
        async for step in engine.generate(f"r{i}", prompt(i), GenerationParams(max_new_tokens=tokens, seed=seed)):
            if step.finish_reason is not None:
                return step.finish_reason
        return "no finish"
    except EngineError as exc:
        return exc.code


async def seeded_long_prompts(engine: VLLMEngine, chunked: bool | None) -> str:
    ends = await asyncio.gather(*(one(engine, i, seed=100 + i) for i in range(3)))
    expected = ["unsupported_parameter"] * 3 if chunked else ["length"] * 3
    assert ends == expected, f"seeded long prompts ended {ends}, expected {expected}"
    assert engine.failure() is None, engine.failure()
    # the engine is alive: an unseeded request is served too
    assert await one(engine, 9, seed=None) == "length"
    return f"3 concurrent seeded {PROMPT}-token prompts in a {BUDGET}-token step budget: {ends}"


async def engine_core_killed(engine: VLLMEngine) -> str:
    stream = engine.generate("r20", [5, 6, 7], GenerationParams(max_new_tokens=200))
    await anext(stream)  # streaming when the engine core is killed
    engine.inject_fault()
    try:
        async for _ in stream:
            pass
        ended = "finished"
    except EngineError as exc:
        ended = exc.code
    assert ended == "engine_dead", f"the running stream ended {ended!r}"
    for _ in range(150):  # up to 30 s for vLLM's monitor to notice
        if engine.failure() is not None:
            break
        await asyncio.sleep(0.2)
    failure = engine.failure()
    assert failure is not None, "failure() did not report the dead engine core"
    after = await one(engine, 21, seed=None)
    assert after == "engine_dead", f"a request after the death ended {after!r}, not engine_dead"
    return f"the running stream and the next request ended engine_dead; failure(): {failure[:60]}"


async def main(model: str, chunked: bool | None) -> int:
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    engine = VLLMEngine(
        model,
        dtype="float32",
        max_model_len=BUDGET,
        max_num_seqs=4,
        max_num_batched_tokens=BUDGET,
        enable_chunked_prefill=chunked,
        enforce_eager=True,  # what is tested is not compiled code; compiling costs ~35 s a start here
    )
    start = time.perf_counter()
    await engine.start()
    print(f"[vllm] engine started in {time.perf_counter() - start:.1f}s", flush=True)
    failed = 0
    try:
        for name, check in (
            ("seeded_long_prompts", seeded_long_prompts(engine, chunked)),
            ("engine_core_killed", engine_core_killed(engine)),
        ):
            try:
                print(f"ok   {name}: {await asyncio.wait_for(check, timeout=180)}", flush=True)
            except Exception as exc:
                failed += 1
                print(f"FAIL {name}: {exc!r}", flush=True)
    finally:
        await engine.close()
    return 1 if failed else 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--model", required=True)
    parser.add_argument("--chunked-prefill", choices=["on", "off", "auto"], default="auto")
    args = parser.parse_args()
    sys.exit(asyncio.run(main(args.model, {"on": True, "off": False, "auto": None}[args.chunked_prefill])))
