"""The ``hf`` engine on a tiny random Llama (CPU fp32): batching, seeds, stops, abort, exact logprobs."""

from __future__ import annotations

import asyncio
import warnings
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.generation.logits_process import (
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
    TypicalLogitsWarper,
)

from worker.engines.contract import EngineError, GenerationParams, TokenStep
from worker.engines.hf import HFEngine, _cache_argument
from worker.sampling import gather_logprobs, presence_mask, process_logits, teacher_forced_logprobs

VOCAB = 512


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        # A random init gives near-uniform next-token distributions; sharpen them (entropy ~1.6 nats)
        # so that top-p/typical-p really filter and tokens repeat (exercising the repetition penalty).
        model.lm_head.weight.mul_(30.0)
    path = tmp_path_factory.mktemp("tiny-llama")
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def reference(model_dir: Path) -> LlamaForCausalLM:
    model: LlamaForCausalLM = LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    return model


@pytest.fixture
async def engine(model_dir: Path) -> AsyncIterator[HFEngine]:
    eng = HFEngine(str(model_dir))
    await eng.start()
    yield eng
    await eng.close()


@dataclass
class Result:
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


async def collect(
    eng: HFEngine,
    request_id: str,
    prompt: list[int],
    params: GenerationParams,
    started: asyncio.Event | None = None,
) -> Result:
    """Run one request to the end; ``started`` is set once 3 steps have arrived."""
    result = Result()
    async for step in eng.generate(request_id, prompt, params):
        result.steps.append(step)
        if started is not None and len(result.steps) == 3:
            started.set()
    return result


def prompt_of(length: int, salt: int = 0) -> list[int]:
    return [(31 * i + 17 * salt + 5) % VOCAB for i in range(length)]


def reference_logprobs(
    model: LlamaForCausalLM, prompt: list[int], completion: list[int], params: GenerationParams
) -> torch.Tensor:
    """Teacher forcing: one unbatched fp32 forward over prompt + completion, then the same processing."""
    sequence = prompt + completion
    with torch.no_grad():
        logits = model(torch.tensor([sequence])).logits[0]
    return teacher_forced_logprobs(logits, sequence, len(prompt), params)


# ---- logits processing ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "params",
    [
        GenerationParams(1, temperature=0.7, top_k=20),
        GenerationParams(1, top_p=0.9),
        GenerationParams(1, temperature=1.3, typical_p=0.8),
        GenerationParams(1, temperature=0.5, top_k=50, top_p=0.8, typical_p=0.95, repetition_penalty=1.3),
    ],
)
def test_process_logits_matches_transformers(params: GenerationParams) -> None:
    torch.manual_seed(1)
    logits = torch.randn(4, VOCAB) * 3
    prev = torch.randint(0, VOCAB, (4, 30))
    expected = logits.clone()
    if params.repetition_penalty:
        expected = RepetitionPenaltyLogitsProcessor(params.repetition_penalty)(prev, expected)
    expected = TemperatureLogitsWarper(params.temperature)(prev, expected)
    if params.top_k:
        expected = TopKLogitsWarper(params.top_k)(prev, expected)
    if params.top_p:
        expected = TopPLogitsWarper(params.top_p)(prev, expected)
    if params.typical_p:
        expected = TypicalLogitsWarper(params.typical_p)(prev, expected)
    got = process_logits(logits, params, presence_mask(prev.tolist(), VOCAB, logits.device))
    assert torch.equal(torch.isinf(got), torch.isinf(expected))
    torch.testing.assert_close(got, torch.log_softmax(expected, dim=-1), rtol=0, atol=1e-6)


def test_greedy_logprobs_are_penalised_temperature_one() -> None:
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0]])
    params = GenerationParams(1, temperature=0.0, top_k=1, repetition_penalty=2.0)
    got = process_logits(logits, params, torch.tensor([[False, True, False, True]]))
    torch.testing.assert_close(got, torch.log_softmax(torch.tensor([[2.0, -2.0, 0.5, 1.5]]), dim=-1))


# ---- engine --------------------------------------------------------------------------------------


async def test_info_and_prompt_ids_reported(engine: HFEngine) -> None:
    assert engine.info.name == "hf" and engine.info.max_context == 256
    prompt = prompt_of(11)
    result = await collect(engine, "a", prompt, GenerationParams(5, seed=1))
    assert result.steps[0].prompt_token_ids == prompt
    assert all(s.prompt_token_ids is None for s in result.steps[1:])
    assert [len(s.token_ids) for s in result.steps] == [1] * 5
    assert [s.finish_reason for s in result.steps] == [None] * 4 + ["length"]
    assert result.last.stop_reason is None


async def test_stop_token(engine: HFEngine) -> None:
    prompt = prompt_of(8, salt=3)
    free = await collect(engine, "free", prompt, GenerationParams(12, temperature=0.0))
    stop = free.tokens[4]
    cut = free.tokens.index(stop) + 1
    result = await collect(engine, "stop", prompt, GenerationParams(12, temperature=0.0, stop_token_ids=(stop,)))
    assert result.tokens == free.tokens[:cut]  # the stop token is included
    assert result.last.finish_reason == "stop" and result.last.stop_reason == stop


async def test_same_seed_alone_and_batched(engine: HFEngine) -> None:
    prompt, params = prompt_of(9, salt=1), GenerationParams(24, temperature=1.0, top_p=0.95, seed=1234)
    alone = await collect(engine, "alone", prompt, params)
    early_started = asyncio.Event()
    early = asyncio.create_task(
        collect(engine, "early", prompt_of(40, salt=2), GenerationParams(40, seed=1), early_started)
    )
    await early_started.wait()  # the request under test joins a batch that is already decoding
    batched, *_ = await asyncio.gather(
        collect(engine, "batched", prompt, params),
        collect(engine, "x", prompt_of(3, salt=4), GenerationParams(30, temperature=0.8, seed=2)),
        collect(engine, "y", prompt_of(25, salt=5), GenerationParams(30, temperature=0.0)),
    )
    await early
    assert engine.stats.max_batch_size_seen >= 3
    assert batched.tokens == alone.tokens
    assert max(abs(a - b) for a, b in zip(alone.logprobs, batched.logprobs, strict=True)) < 1e-4


SAMPLING = [
    GenerationParams(32, temperature=0.7, top_k=20, seed=11, top_logprobs=5),
    GenerationParams(32, temperature=1.0, top_p=0.9, seed=12),
    GenerationParams(32, temperature=0.0, top_logprobs=3),
    GenerationParams(32, temperature=1.0, repetition_penalty=1.3, seed=13),
    GenerationParams(32, temperature=1.2, typical_p=0.9, seed=14, top_logprobs=4),
    GenerationParams(32, temperature=0.9, top_k=40, top_p=0.8, repetition_penalty=1.3, seed=15),
]


async def test_logprobs_match_teacher_forcing(engine: HFEngine, reference: LlamaForCausalLM) -> None:
    prompts = [prompt_of(n, salt=i) for i, n in enumerate([3, 17, 40, 9, 26, 1])]
    # Two waves: the second joins while the first is mid-decode, so caches of different lengths merge.
    first = [asyncio.Event() for _ in range(3)]
    wave1 = [asyncio.create_task(collect(engine, f"w1-{i}", prompts[i], SAMPLING[i], first[i])) for i in range(3)]
    await asyncio.gather(*(e.wait() for e in first))
    wave2 = [collect(engine, f"w2-{i}", prompts[i], SAMPLING[i]) for i in range(3, 6)]
    results = await asyncio.gather(*wave1, *wave2)
    assert engine.stats.max_batch_size_seen == 6

    worst = 0.0
    for prompt, params, result in zip(prompts, SAMPLING, results, strict=True):
        assert result.last.finish_reason == "length" and len(result.tokens) == 32
        expected = reference_logprobs(reference, prompt, result.tokens, params)
        got = torch.tensor(result.logprobs)
        worst = max(worst, (gather_logprobs(expected, result.tokens) - got).abs().max().item())
        if params.temperature == 0.0:
            assert result.tokens == expected.argmax(dim=-1).tolist()
        for j, step in enumerate(result.steps):
            if params.top_logprobs:
                assert step.top_logprobs is not None
                ids = [i for i, _ in step.top_logprobs[0]]
                values = torch.tensor([v for _, v in step.top_logprobs[0]])
                ref_values = expected[j].topk(len(ids)).values
                assert (values - ref_values).abs().max().item() < 1e-4
            else:
                assert step.top_logprobs is None
    print(f"max |logprob - teacher forced| = {worst:.3g}")
    assert worst < 1e-4


async def test_top_logprobs_contain_sampled_token(engine: HFEngine) -> None:
    params = GenerationParams(20, temperature=1.0, top_k=30, seed=5, top_logprobs=10)
    result = await collect(engine, "top", prompt_of(6), params)
    hits = 0
    for step in result.steps:
        assert step.top_logprobs is not None and len(step.top_logprobs[0]) <= 10
        top = dict(step.top_logprobs[0])
        values = list(top.values())
        assert values == sorted(values, reverse=True)
        token, logprob = step.token_ids[0], step.logprobs[0]
        if token in top:
            hits += 1
            assert top[token] == logprob
        else:
            assert logprob <= min(values)
    assert hits > 0


async def test_many_concurrent_requests_are_batched(engine: HFEngine) -> None:
    n, tokens = 10, 20
    results = await asyncio.gather(
        *(collect(engine, f"r{i}", prompt_of(2 + 3 * i, salt=i), GenerationParams(tokens, seed=i)) for i in range(n))
    )
    assert all(r.last.finish_reason == "length" and len(r.tokens) == tokens for r in results)
    stats = engine.stats
    assert stats.tokens_generated == n * tokens
    assert stats.max_batch_size_seen >= 8
    assert stats.forward_passes < stats.tokens_generated / 4  # one forward advances many requests
    assert engine.batch_size == 0


async def test_abort(engine: HFEngine) -> None:
    await engine.abort("unknown")  # no-op
    stream = engine.generate("ab", prompt_of(5), GenerationParams(200, seed=3))
    steps = [await anext(stream) for _ in range(3)]
    await engine.abort("ab")
    rest = [step async for step in stream]
    assert sum(len(s.token_ids) for s in rest) <= 1  # ends within one step
    assert rest[-1].finish_reason == "abort" and rest[-1].token_ids == [] and rest[-1].logprobs == []
    assert all(s.finish_reason is None for s in steps)
    await engine.abort("ab")  # finished: no-op
    # The id is free again and the engine still serves requests.
    result = await collect(engine, "ab", prompt_of(5), GenerationParams(3, seed=3))
    assert result.tokens == [s.token_ids[0] for s in steps]
    assert engine.batch_size == 0


async def test_consumer_leaving_removes_request(engine: HFEngine) -> None:
    stream = engine.generate("gone", prompt_of(5), GenerationParams(200, seed=3))
    await anext(stream)
    await anext(stream)
    assert engine.batch_size == 1
    await stream.aclose()
    for _ in range(100):
        if engine.batch_size == 0:
            break
        await asyncio.sleep(0.01)
    assert engine.batch_size == 0
    assert engine.stats.tokens_generated < 50


async def test_no_warnings_from_loading_and_batched_decoding(model_dir: Path) -> None:
    """The engine passes transformers only current arguments (the KV cache as ``cache``, not the deprecated
    ``past_key_values``): no FutureWarning or other warning, which a worker would print at start-up."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        eng = HFEngine(str(model_dir))
        await eng.start()
        try:
            first = asyncio.Event()
            early = asyncio.create_task(collect(eng, "early", prompt_of(7), GenerationParams(12, seed=1), first))
            await first.wait()  # the others join a batch that is decoding: prefill, merge, batched decode
            await asyncio.gather(
                early,
                *(collect(eng, f"r{i}", prompt_of(3 + 5 * i, salt=i), GenerationParams(6, seed=i)) for i in range(2)),
            )
        finally:
            await eng.close()
    assert eng.stats.max_batch_size_seen >= 2
    # ResourceWarnings come from whatever the garbage collector happens to finalize meanwhile.
    shown = [
        f"{w.filename}:{w.lineno}: {w.category.__name__}: {w.message}"
        for w in caught
        if w.category is not ResourceWarning
    ]
    assert not shown, shown


def test_cache_argument_follows_the_forward_signature() -> None:
    class Current:
        def forward(self, input_ids: object = None, cache: object = None, **kwargs: object) -> None: ...

    class Legacy:  # transformers before the rename, and remote-code models
        def forward(self, input_ids: object = None, past_key_values: object = None, **kwargs: object) -> None: ...

    class Neither:  # would swallow a cache in **kwargs and ignore it
        def forward(self, input_ids: object = None, **kwargs: object) -> None: ...

    assert _cache_argument(Current().forward) == "cache"
    assert _cache_argument(Legacy().forward) == "past_key_values"
    with pytest.raises(RuntimeError, match="neither"):
        _cache_argument(Neither().forward)


async def test_context_limits_and_validation(model_dir: Path) -> None:
    eng = HFEngine(str(model_dir), max_context=32)
    await eng.start()
    try:
        assert eng.info.max_context == 32
        result = await collect(eng, "cap", prompt_of(30), GenerationParams(10, seed=1))
        assert len(result.tokens) == 2 and result.last.finish_reason == "length"
        with pytest.raises(EngineError) as overflow:
            await collect(eng, "over", prompt_of(32), GenerationParams(10))
        assert overflow.value.code == "context_overflow"
        with pytest.raises(EngineError) as empty:
            await collect(eng, "empty", [], GenerationParams(10))
        assert empty.value.code == "bad_request"
        with pytest.raises(EngineError) as bad_id:
            await collect(eng, "bad", [1, VOCAB], GenerationParams(10))
        assert bad_id.value.code == "bad_request"
        with pytest.raises(EngineError) as bad_params:
            await collect(eng, "hot", [1, 2], GenerationParams(10, temperature=-1.0))
        assert bad_params.value.code == "bad_request"
        assert eng.stats.prefills == 1  # rejected requests never reached the model
    finally:
        await eng.close()


async def test_close_aborts_in_flight(model_dir: Path) -> None:
    eng = HFEngine(str(model_dir))
    await eng.start()
    stream = eng.generate("long", prompt_of(5), GenerationParams(200, seed=3))
    await anext(stream)
    await eng.close()
    rest = [step async for step in stream]
    assert rest[-1].finish_reason == "abort"
    with pytest.raises(EngineError):
        await collect(eng, "late", prompt_of(5), GenerationParams(3))
