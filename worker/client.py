"""The worker's websocket client: connect, say hello, take work while credits last, stream tokens.

Reconnects with capped exponential backoff and jitter; a refused key or protocol version is
fatal. Generation runs as one task per message; losing the connection aborts them all (the
server re-queues and a worker resumes from the tokens already streamed).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
from dataclasses import dataclass

import websockets
from pydantic import ValidationError
from websockets.asyncio.client import ClientConnection

from shared.errors import ErrorCode
from shared.packing import to_float32
from shared.protocol import (
    PROTOCOL_VERSION,
    CancelFrame,
    CreditFrame,
    ErrorFrame,
    FailedFrame,
    FinishedFrame,
    FinishReason,
    GenerationRecord,
    HeartbeatFrame,
    HelloFrame,
    TokensFrame,
    WelcomeFrame,
    WorkFrame,
    server_frame_adapter,
)
from worker.chat_format import ChatFormat, RenderError
from worker.detokenizer import IncrementalDetokenizer
from worker.engines.contract import Engine, EngineError, GenerationParams
from worker.output_parser import OutputParser
from worker.prompt_builder import CloserPolicy, PromptBuilder, PromptMode, template_error

log = logging.getLogger(__name__)

FATAL_CODES = {ErrorCode.invalid_worker_key.value, ErrorCode.protocol_version_mismatch.value}


class FatalWorkerError(Exception):
    """The server refused this worker for a reason retrying cannot fix."""


@dataclass
class WorkerOptions:
    server_url: str
    api_key: str
    model_name: str
    max_parallel: int = 4
    reconnect_max_s: float = 30.0
    heartbeat_interval_s: float = 5.0
    # "naive" re-renders the whole history each turn: only for baselines in benchmarks
    prompt_mode: PromptMode = "stitch"
    closer_policy: CloserPolicy = "keep"


def websocket_url(server_url: str) -> str:
    base = server_url.rstrip("/")
    if base.startswith("http://"):
        base = "ws://" + base[len("http://") :]
    elif base.startswith("https://"):
        base = "wss://" + base[len("https://") :]
    elif not base.startswith(("ws://", "wss://")):
        base = "ws://" + base
    return base + "/workers/work"


class WorkerClient:
    def __init__(self, options: WorkerOptions, engine: Engine, fmt: ChatFormat) -> None:
        self.options = options
        self.engine = engine
        self.fmt = fmt
        self.prompts = PromptBuilder(fmt, mode=options.prompt_mode, closer_policy=options.closer_policy)
        self.parser = OutputParser.for_tokenizer(fmt.tokenizer, fmt.template_for(None))
        self._ws: ClientConnection | None = None
        self._send_lock = asyncio.Lock()
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self.connected = asyncio.Event()
        self.completed = 0

    def hello(self) -> HelloFrame:
        return HelloFrame(
            protocol_version=PROTOCOL_VERSION,
            model_name=self.options.model_name,
            engine=self.engine.info.name,
            tokenizer_hash=self.fmt.tokenizer_hash,
            template_hash=self.fmt.template_hash,
            compat_hash=self.fmt.compat_hash,
            capacity=self.options.max_parallel,
            max_context=self.engine.info.max_context,
        )

    async def run_forever(self) -> None:
        delay = 0.5
        while True:
            try:
                await self._session()
                delay = 0.5
            except FatalWorkerError:
                raise
            except (OSError, websockets.exceptions.WebSocketException, TimeoutError) as exc:
                log.warning("connection to %s failed: %s", self.options.server_url, exc)
            finally:
                self.connected.clear()
                await self._abort_all()
            sleep = delay * (0.5 + random.random())
            log.info("reconnecting in %.1fs", sleep)
            await asyncio.sleep(sleep)
            delay = min(delay * 2, self.options.reconnect_max_s)

    async def _session(self) -> None:
        url = websocket_url(self.options.server_url)
        headers = {"Authorization": f"Bearer {self.options.api_key}"}
        async with websockets.connect(url, additional_headers=headers, max_size=64 * 2**20) as ws:
            self._ws = ws
            await self._send(self.hello())
            first = server_frame_adapter.validate_json(await asyncio.wait_for(ws.recv(), timeout=30))
            if isinstance(first, ErrorFrame):
                self._raise_error(first)
            if not isinstance(first, WelcomeFrame):
                raise FatalWorkerError(f"expected welcome, got {first.type}")
            log.info("connected as %s to %s", first.worker_id, url)
            await self._send(CreditFrame(credits=self.options.max_parallel - len(self._tasks)))
            self.connected.set()
            beat = asyncio.create_task(self._heartbeat(first.heartbeat_interval_s))
            try:
                async for raw in ws:
                    try:
                        frame = server_frame_adapter.validate_json(raw)
                    except ValidationError as exc:
                        log.warning("ignoring a bad frame from the server: %s", exc)
                        continue
                    if isinstance(frame, WorkFrame):
                        key = frame.message_id
                        self._tasks[key] = asyncio.create_task(self._work(frame), name=f"work-{key}")
                    elif isinstance(frame, CancelFrame):
                        await self.engine.abort(_request_id(frame.message_id, frame.attempt))
                    elif isinstance(frame, ErrorFrame):
                        self._raise_error(frame)
            finally:
                beat.cancel()
                self._ws = None

    def _raise_error(self, frame: ErrorFrame) -> None:
        if frame.code in FATAL_CODES:
            raise FatalWorkerError(f"{frame.code}: {frame.message}")
        raise ConnectionError(f"server error {frame.code}: {frame.message}")

    async def _heartbeat(self, interval: float) -> None:
        while True:
            await asyncio.sleep(min(interval, self.options.heartbeat_interval_s))
            await self._send(HeartbeatFrame())

    async def _send(
        self, frame: HelloFrame | CreditFrame | TokensFrame | FinishedFrame | FailedFrame | HeartbeatFrame
    ) -> None:
        ws = self._ws
        if ws is None:
            raise ConnectionError("not connected")
        async with self._send_lock:
            await ws.send(frame.model_dump_json())

    async def _abort_all(self) -> None:
        tasks = list(self._tasks.values())
        for t in tasks:
            t.cancel()
        for t in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t
        self._tasks.clear()

    # ---- one message ---------------------------------------------------------------------
    async def _work(self, frame: WorkFrame) -> None:
        try:
            record = await self._generate(frame)
            await self._send(FinishedFrame(message_id=frame.message_id, attempt=frame.attempt, record=record))
            self.completed += 1
        except (RenderError, EngineError) as exc:
            code = exc.code if isinstance(exc, EngineError) else template_error(exc).code
            log.warning("message %s failed: %s", frame.message_id, exc)
            await self._send_quietly(
                FailedFrame(message_id=frame.message_id, attempt=frame.attempt, code=code, message=str(exc))
            )
        except asyncio.CancelledError:
            raise
        except (ConnectionError, websockets.exceptions.WebSocketException):
            return  # the connection is gone; the server re-queues the message
        except Exception as exc:
            log.exception("message %s failed unexpectedly", frame.message_id)
            await self._send_quietly(
                FailedFrame(
                    message_id=frame.message_id,
                    attempt=frame.attempt,
                    code=ErrorCode.engine_error.value,
                    message=f"{type(exc).__name__}: {exc}",
                    retryable=True,
                )
            )
        finally:
            self._tasks.pop(frame.message_id, None)
        await self._send_quietly(CreditFrame(credits=1))

    async def _send_quietly(self, frame: FailedFrame | CreditFrame) -> None:
        with contextlib.suppress(ConnectionError, websockets.exceptions.WebSocketException):
            await self._send(frame)

    async def _generate(self, frame: WorkFrame) -> GenerationRecord:
        built = self.prompts.build(frame)
        prompt_ids = built.prompt_ids
        max_context = self.engine.info.max_context
        if len(prompt_ids) >= max_context:
            raise EngineError(
                ErrorCode.context_overflow.value,
                f"the prompt has {len(prompt_ids)} tokens; the model's context holds {max_context}",
            )
        detok = IncrementalDetokenizer(self.fmt.tokenizer)
        completion: list[int] = []
        logprobs: list[float | None] = []
        offsets: list[int] = []
        resume = frame.resume
        if resume is not None:
            if resume.compat_hash != self.fmt.compat_hash:
                raise EngineError(ErrorCode.bad_request.value, "cannot resume tokens of another tokenizer")
            for tid in resume.token_ids:
                detok.add(tid)
            completion += resume.token_ids
            logprobs += resume.logprobs
            # Keep the earlier attempt's text split exactly as readers already received it.
            pos = 0
            for piece in resume.texts:
                pos += len(piece)
                offsets.append(pos)
            detok.text = "".join(resume.texts)
        sampling = frame.sampling
        remaining = sampling.max_new_tokens - len(completion)
        stops = tuple(dict.fromkeys([*sampling.stop_token_ids, *self.fmt.stop_token_ids]))
        finish_reason: FinishReason = "length"
        stop_reason: int | None = None
        num_cached: int | None = None
        if remaining > 0:
            params = GenerationParams(
                max_new_tokens=remaining,
                temperature=1.0 if sampling.temperature is None else sampling.temperature,
                top_k=sampling.top_k,
                top_p=sampling.top_p,
                typical_p=sampling.typical_p,
                repetition_penalty=sampling.repetition_penalty,
                seed=frame.seed,
                stop_token_ids=stops,
                top_logprobs=sampling.top_logprobs,
            )
            engine_prompt = prompt_ids + completion
            first = True
            async for step in self.engine.generate(_request_id(frame.message_id, frame.attempt), engine_prompt, params):
                if first and step.prompt_token_ids is not None and step.prompt_token_ids != engine_prompt:
                    await self.engine.abort(_request_id(frame.message_id, frame.attempt))
                    raise EngineError(
                        ErrorCode.engine_error.value, "the engine consumed other prompt tokens than were sent"
                    )
                if first:
                    num_cached = step.num_cached_tokens
                first = False
                if step.token_ids:
                    start = len(completion)
                    lps = to_float32(step.logprobs)
                    texts = [detok.add(t) for t in step.token_ids]
                    for piece in texts:
                        offsets.append((offsets[-1] if offsets else 0) + len(piece))
                    completion += step.token_ids
                    logprobs += lps
                    await self._send(
                        TokensFrame(
                            message_id=frame.message_id,
                            attempt=frame.attempt,
                            start=start,
                            token_ids=step.token_ids,
                            logprobs=list(lps),
                            texts=texts,
                        )
                    )
                if step.finish_reason is not None:
                    finish_reason, stop_reason = step.finish_reason, step.stop_reason
        tail = detok.flush()
        if tail and offsets:
            offsets[-1] += len(tail)
        parsed = self.parser.parse(completion)
        return GenerationRecord(
            prompt_ids=prompt_ids,
            completion_ids=completion,
            logprobs=logprobs,
            text_offsets=offsets,
            completion_text=detok.text,
            content=parsed.content,
            reasoning_content=parsed.reasoning_content,
            tool_calls=parsed.tool_calls,
            finish_reason=finish_reason,
            stop_reason=stop_reason,
            engine=self.engine.info.name,
            tokenizer_hash=self.fmt.tokenizer_hash,
            template_hash=self.fmt.template_hash,
            prior_message_id=built.prior_message_id,
            reused_prefix_len=built.reused_prefix_len,
            synthetic_token_count=built.synthetic_token_count,
            fork=built.fork,
            prompt_method=built.method,
            num_cached_tokens=num_cached,
            resumed_at=[len(resume.token_ids)] if resume else [],
        )


def _request_id(message_id: str, attempt: int) -> str:
    return f"{message_id}:{attempt}"
