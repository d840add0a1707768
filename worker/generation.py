"""One message's generation, apart from the websocket: a work frame in, the frames that stream it out.

``Pipeline.frames`` builds the prompt, runs the engine and yields one tokens frame (``StepTokens``: a
``TokensFrame`` encoded without pydantic) per engine step that produced tokens, then the ``FinishedFrame``
with the ``GenerationRecord``. The caller sends each frame before asking for the next (a stop string's
abort follows the send of the frame that completed it). Failures are raised: ``EngineError`` and
``worker.chat_format.RenderError``, for the caller to report. A resumed attempt continues after the
tokens an earlier attempt streamed.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
from collections.abc import AsyncGenerator
from typing import Any

from shared.errors import ErrorCode
from shared.packing import to_float32
from shared.protocol import (
    FinishedFrame,
    FinishReason,
    GenerationRecord,
    ResumeState,
    TopLogprob,
    WorkFrame,
)
from worker.chat_format import ChatFormat
from worker.detokenizer import IncrementalDetokenizer, rust_backend
from worker.engines.contract import Engine, EngineError, GenerationParams, TokenStep
from worker.frames import StepTokens
from worker.output_parser import OutputParser, ParsedOutput
from worker.prompt_builder import BuiltPrompt, CloserPolicy, PromptBuilder, PromptMode

_MAX_BUILDERS = 16  # prompt builders kept for distinct chat-template arguments


class Pipeline:
    """Generates messages with one engine and chat format: ``frames`` once per work frame."""

    def __init__(
        self,
        engine: Engine,
        fmt: ChatFormat,
        *,
        prompt_mode: PromptMode = "stitch",
        closer_policy: CloserPolicy = "keep",
    ) -> None:
        self.engine = engine
        self.fmt = fmt
        self.prompts = Prompts(fmt, mode=prompt_mode, closer_policy=closer_policy)
        self.parser = OutputParser.for_tokenizer(fmt.tokenizer, fmt.template_for(None))
        self.texts = TokenTexts(fmt.tokenizer)

    async def frames(self, work: WorkFrame) -> AsyncGenerator[StepTokens | FinishedFrame, None]:
        gen = self._start(work)
        remaining = work.sampling.max_new_tokens - len(gen.token_ids)
        if remaining > 0 and gen.stops.found(gen.detok.text) is None:
            request_id = engine_request_id(work.message_id, work.attempt)
            engine_prompt = gen.prompt.prompt_ids + gen.token_ids
            first = True
            with self._running(request_id) as engine:
                async for step in engine.generate(request_id, engine_prompt, self._params(work, remaining)):
                    if first:
                        if step.prompt_token_ids is not None and step.prompt_token_ids != engine_prompt:
                            await self.engine.abort(request_id)
                            raise EngineError(
                                ErrorCode.engine_error.value, "the engine consumed other prompt tokens than were sent"
                            )
                        gen.num_cached_tokens = step.num_cached_tokens
                        first = False
                    if step.token_ids:
                        tokens, hit = gen.add(step)
                        yield tokens
                        if hit is not None:
                            await self.engine.abort(request_id)
                            gen.finish("stop", hit)
                            break
                    if step.finish_reason is not None:
                        gen.finish(step.finish_reason, step.stop_reason)
        elif remaining > 0:  # the resumed text already holds a stop string
            gen.finish("stop", gen.stops.found(gen.detok.text))
        yield FinishedFrame(message_id=work.message_id, attempt=work.attempt, record=gen.record(self.engine.info.name))

    async def cancel(self, message_id: str, attempt: int) -> None:
        """Stop generating for this attempt (its engine stream ends with finish_reason "abort")."""
        await self.engine.abort(engine_request_id(message_id, attempt))

    def _running(self, request_id: str) -> contextlib.AbstractContextManager[Engine]:
        """The engine to iterate for ``request_id``: a supervised engine's current one (its ``running``:
        no wrapper generator per step), else the engine itself."""
        running = getattr(self.engine, "running", None)
        return running(request_id) if running is not None else contextlib.nullcontext(self.engine)

    def _start(self, work: WorkFrame) -> Generation:
        prompt, check = self.prompts.build(work)
        max_context = self.engine.info.max_context
        if len(prompt.prompt_ids) >= max_context:
            raise EngineError(
                ErrorCode.context_overflow.value,
                f"the prompt has {len(prompt.prompt_ids)} tokens; the model's context holds {max_context}",
            )
        gen = Generation(work, prompt, check, self.fmt, self.parser, self.texts)
        if work.resume is not None:
            gen.resume(work.resume)
        return gen

    def _params(self, work: WorkFrame, max_new_tokens: int) -> GenerationParams:
        sampling = work.sampling
        model_stops = () if sampling.ignore_eos else self.fmt.stop_token_ids
        return GenerationParams(
            max_new_tokens=max_new_tokens,
            temperature=1.0 if sampling.temperature is None else sampling.temperature,
            top_k=sampling.top_k,
            top_p=sampling.top_p,
            typical_p=sampling.typical_p,
            min_p=sampling.min_p,
            repetition_penalty=sampling.repetition_penalty,
            seed=work.seed,
            stop_token_ids=tuple(dict.fromkeys([*sampling.stop_token_ids, *model_stops])),
            top_logprobs=sampling.top_logprobs,
        )


class Generation:
    """One message in progress: its prompt, the tokens so far (resumed ones included) with their text
    as streamed, and how it ended."""

    def __init__(
        self,
        work: WorkFrame,
        prompt: BuiltPrompt,
        prompt_check: str | None,
        fmt: ChatFormat,
        parser: OutputParser,
        texts: TokenTexts | None = None,
    ) -> None:
        self.work = work
        self.texts = texts or TokenTexts(fmt.tokenizer)
        self.prompt = prompt
        self.prompt_check = prompt_check  # how client-supplied prompt tokens compared with the built prompt
        self.fmt = fmt
        self.parser = parser
        self.chat = work.raw is None  # raw prompts get no channels and no reply parsing
        self.opens_think = self.chat and parser.opened_by(prompt.prompt_ids)
        self.tracker = parser.channels(prompt_opens_think=self.opens_think) if self.chat else None
        self.detok = IncrementalDetokenizer(fmt.tokenizer, rust=self.texts.rust)
        self.stops = StopStrings(work.sampling.stop)
        self.token_ids: list[int] = []
        self.logprobs: list[float | None] = []
        self.offsets: list[int] = []  # end offset in the text of each token's piece
        self.finish_reason: FinishReason = "length"
        self.stop_reason: int | str | None = None
        self.num_cached_tokens: int | None = None
        self.policy_versions: list[tuple[int, int]] = []  # [start, version] spans of token_ids
        self._prompt_sent = False  # the first frame of an attempt carries the prompt

    def resume(self, resume: ResumeState) -> None:
        if resume.compat_hash != self.fmt.compat_hash:
            raise EngineError(ErrorCode.bad_request.value, "cannot resume tokens of another tokenizer")
        for k, tid in enumerate(resume.token_ids):
            self.detok.add(tid)
            if self.tracker is not None:
                self.tracker.feed(tid, resume.texts[k] if k < len(resume.texts) else "")
        self.token_ids += resume.token_ids
        self.logprobs += resume.logprobs
        self.policy_versions += [(int(a), int(v)) for a, v in resume.policy_versions]
        # Keep the earlier attempt's text split exactly as readers already received it.
        pos = 0
        for piece in resume.texts:
            pos += len(piece)
            self.offsets.append(pos)
        self.detok.text = "".join(resume.texts)
        self.stops.seed(self.detok.text)

    def add(self, step: TokenStep) -> tuple[StepTokens, str | None]:
        """Add an engine step's tokens up to the one that completes a stop string; return their frame
        and that stop string (None if none)."""
        start = len(self.token_ids)
        step_ids = step.token_ids
        lps = to_float32(step.logprobs)
        top = step.top_logprobs if self.work.sampling.top_logprobs > 0 else None
        add = self.detok.add
        hit: str | None = None
        if self.stops.stops:
            texts: list[str] = []
            for k, tid in enumerate(step_ids):
                piece = add(tid)
                texts.append(piece)
                hit = self.stops.feed(piece)
                if hit is not None:  # keep the tokens up to the one completing the stop string
                    step_ids, lps, top = step_ids[: k + 1], lps[: k + 1], top[: k + 1] if top else top
                    break
        else:
            texts = [add(tid) for tid in step_ids]
        if step.finish_reason is not None and texts:
            # the reply ends here: what the detokenizer holds back (a character the reply stopped inside
            # of, decoded as U+FFFD) goes with the last token, so readers get the text that is stored
            texts[-1] += self.detok.flush()
        offsets = self.offsets
        end = offsets[-1] if offsets else 0
        for piece in texts:
            end += len(piece)
            offsets.append(end)
        if step_ids and (not self.policy_versions or self.policy_versions[-1][1] != step.policy_version):
            self.policy_versions.append((start, step.policy_version))
        self.token_ids += step_ids
        self.logprobs += lps
        with_prompt, self._prompt_sent = not self._prompt_sent, True
        tracker = self.tracker
        tokens = StepTokens(
            self.work.message_id,
            self.work.attempt,
            start,
            step_ids,
            lps,
            texts,
            None if tracker is None else "".join([tracker.feed(t, x) for t, x in zip(step_ids, texts, strict=True)]),
            self._top(top),
            self.prompt.prompt_ids if with_prompt else None,
            step.policy_version,
        )
        return tokens, hit

    def finish(self, reason: FinishReason, stop_reason: int | str | None) -> None:
        self.finish_reason, self.stop_reason = reason, stop_reason

    def record(self, engine: str) -> GenerationRecord:
        """The finished message: the text held back by the detokenizer, and the reply's fields parsed."""
        tail = self.detok.flush()
        if tail and self.offsets:
            self.offsets[-1] += len(tail)
        if self.chat:
            parsed = self.parser.parse(self.token_ids, prompt_opens_think=self.opens_think)
        else:
            parsed = ParsedOutput(self.detok.text)
        if isinstance(self.stop_reason, str):
            parsed = self.stops.cut(parsed, self.stop_reason)
        prompt, resume = self.prompt, self.work.resume
        return GenerationRecord(
            prompt_ids=prompt.prompt_ids,
            completion_ids=self.token_ids,
            logprobs=self.logprobs,
            text_offsets=self.offsets,
            completion_text=self.detok.text,
            content=parsed.content,
            reasoning_content=parsed.reasoning_content,
            tool_calls=parsed.tool_calls,
            finish_reason=self.finish_reason,
            stop_reason=self.stop_reason,
            engine=engine,
            tokenizer_hash=self.fmt.tokenizer_hash,
            template_hash=self.fmt.template_hash,
            prior_message_id=prompt.prior_message_id,
            reused_prefix_len=prompt.reused_prefix_len,
            synthetic_token_count=prompt.synthetic_token_count,
            fork=prompt.fork,
            prompt_method=prompt.method,
            num_cached_tokens=self.num_cached_tokens,
            resumed_at=[len(resume.token_ids)] if resume else [],
            prompt_check=self.prompt_check,
            policy_versions=self.policy_versions,
        )

    def _top(self, rows: list[list[tuple[int, float]]] | None) -> list[list[TopLogprob]] | None:
        if rows is None:
            return None
        text = self.texts.text
        return [[(i, float(lp), text(i)) for i, lp in row] for row in rows]


class TokenTexts:
    """Per tokenizer, computed once: its Rust backend for detokenizers, and each token's own text (top
    logprobs' alternatives; at most one string per vocabulary entry)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.rust = rust_backend(tokenizer)
        self._texts: dict[int, str] = {}

    def text(self, token_id: int) -> str:
        """``tokenizer.decode([token_id])``."""
        text = self._texts.get(token_id)
        if text is None:
            text = self._texts[token_id] = self.tokenizer.decode([token_id])
        return text


class Prompts:
    """The prompt a work frame generates from: its raw prompt, or one built from its messages by the
    prompt builder of its chat-template arguments (each set probed once, a few kept), which the
    client's own prompt tokens may replace."""

    def __init__(self, fmt: ChatFormat, *, mode: PromptMode, closer_policy: CloserPolicy) -> None:
        self.fmt = fmt
        self.mode = mode
        self.closer_policy = closer_policy
        self.default = PromptBuilder(fmt, mode=mode, closer_policy=closer_policy)
        self._builders: dict[str, PromptBuilder] = {}

    def build(self, work: WorkFrame) -> tuple[BuiltPrompt, str | None]:
        """The prompt to generate from, and how client-supplied prompt tokens compared with it."""
        raw = work.raw
        if raw is not None:
            if raw.token_ids is not None:
                ids = list(raw.token_ids)
            else:
                ids = list(self.fmt.tokenizer.encode(raw.text or "", add_special_tokens=raw.add_special_tokens))
            if not ids:
                raise EngineError(ErrorCode.bad_request.value, "the prompt is empty")
            return BuiltPrompt(ids, method="raw"), None
        built = self.builder(work.template_kwargs).build(work)
        check = None
        if work.required_prefix_ids is not None:
            required = work.required_prefix_ids
            at = _first_difference(built.prompt_ids[: len(required)], required)
            check = "prefix-match" if at is None else f"prefix-mismatch@{at}"
        client = work.client_prompt_ids
        if client is not None:
            at = _first_difference(built.prompt_ids, client)
            if at is None:
                return built, "match"
            # Tokens in: generate from what the client sent; it still extends the stored turn if it
            # agrees with the built prompt over the reused part.
            extends = at >= built.reused_prefix_len
            built = BuiltPrompt(
                list(client),
                prior_message_id=built.prior_message_id if extends else None,
                reused_prefix_len=built.reused_prefix_len if extends else 0,
                fork=built.fork or not extends,
                fork_reason=None if extends else "the client's prompt tokens differ from the stored chain",
                method="client",
            )
            check = f"mismatch@{at}"
        return built, check

    def builder(self, template_kwargs: dict[str, Any] | None) -> PromptBuilder:
        if not template_kwargs:
            return self.default
        key = json.dumps(template_kwargs, sort_keys=True, default=str)
        builder = self._builders.get(key)
        if builder is None:
            fmt = dataclasses.replace(self.fmt, template_kwargs={**self.fmt.template_kwargs, **template_kwargs})
            builder = PromptBuilder(fmt, mode=self.mode, closer_policy=self.closer_policy)
            if len(self._builders) >= _MAX_BUILDERS:
                self._builders.pop(next(iter(self._builders)))
            self._builders[key] = builder
        return builder


class StopStrings:
    """Stop strings (OpenAI ``stop``): generation ends after the token that completes one; the
    tokens stay in the record (the model produced them), the string and what follows are cut from
    the reply text."""

    def __init__(self, stops: list[str]) -> None:
        self.stops = [s for s in stops if s]
        self.longest = max((len(s) for s in self.stops), default=0)
        self._tail = ""  # the last ``longest - 1`` characters fed: a stop string may end in the next piece

    def found(self, text: str) -> str | None:
        """The stop string that occurs earliest in ``text``, or None."""
        if not self.stops:
            return None
        hits = [(text.find(s), s) for s in self.stops if s in text]
        return min(hits)[1] if hits else None

    def seed(self, text: str) -> None:
        """The text so far (a resumed attempt's): the next ``feed`` looks back into its end."""
        self._tail = text[max(0, len(text) - self.longest + 1) :] if self.longest > 1 else ""

    def feed(self, piece: str) -> str | None:
        """The next piece of text: the stop string it completes (the earliest one), or None."""
        if not piece:
            return None
        window = self._tail + piece
        self._tail = window[max(0, len(window) - self.longest + 1) :] if self.longest > 1 else ""
        return self.found(window)

    @staticmethod
    def cut(parsed: ParsedOutput, stop: str) -> ParsedOutput:
        at = parsed.content.find(stop)
        if at >= 0:
            parsed.content = parsed.content[:at]
        elif parsed.reasoning_content is not None and stop in parsed.reasoning_content:
            parsed.reasoning_content = parsed.reasoning_content[: parsed.reasoning_content.find(stop)]
        return parsed


def _first_difference(a: list[int], b: list[int]) -> int | None:
    """The first index where the sequences differ (or where the shorter one ends), None if equal."""
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def engine_request_id(message_id: str, attempt: int) -> str:
    """The engine request id of one attempt of a message."""
    return f"{message_id}:{attempt}"
