"""Per arm, from the driven conversations: TEF, EPB, SPR, TFLA, BF, FBR and the prefix cache (definitions in
the package docstring); the pure verdicts come from ``metrics.py``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from benchmarks.exactness.conversation import Conversation, Turn
from benchmarks.exactness.metrics import (
    TFLA_TOLERANCE,
    Agreement,
    PrefixCache,
    agreement,
    aligned_prefix,
    bridge_mismatch,
    cache_block_size,
    closer_mismatch,
    expected_stitch_suffix,
    extension_breaks,
    logprob_deltas,
    naive_training_view,
    prefix_cache,
    samples_per_rollout,
    share,
    tokens_exact,
    turn_closed,
    turn_end,
)
from benchmarks.exactness.reference import Reference, reference_render
from benchmarks.exactness.scorer import Scorer
from benchmarks.exactness.script import has_control_text
from shared.stitching import extends, merge_turns
from worker.chat_format import ChatFormat, template_message
from worker.prompt_builder import PromptBuilder


@dataclass
class ArmReport:
    counts: dict[str, int] = field(default_factory=dict)
    tef: tuple[int, int] = (0, 0)
    epb: tuple[int, int] = (0, 0)
    epb_written: tuple[int, int] = (0, 0)  # the pairs with a client-written assistant message between
    text_bridges: int = 0  # bridges compared as text: the template transforms message text (tojson)
    samples: int = 0
    tfla: Agreement = field(default_factory=Agreement)
    bf: tuple[int, int] | None = None
    closer: tuple[int, int] | None = None
    fbr: tuple[int, int] = (0, 0)
    fbr_by_construction: bool = False
    examples: list[str] = field(default_factory=list)  # first failures, for investigation
    errors: dict[str, int] = field(default_factory=dict)  # why turns failed (the worker's error), how often
    cache: PrefixCache | None = None  # None: the engine reports no prefix-cache hits (hf)
    cache_block: int | None = None

    def metrics(self) -> dict[str, Any]:
        conversations = self.counts.get("conversations", 0)
        out: dict[str, Any] = {
            "TEF": share(*self.tef),
            "TEF_counts": list(self.tef),
            "EPB": share(*self.epb),
            "EPB_counts": list(self.epb),
            "EPB_written": share(*self.epb_written),
            "EPB_written_counts": list(self.epb_written),
            "SPR": self.samples / conversations if conversations else None,
            "TFLA_share": self.tfla.share,
            "TFLA_max_abs_delta": self.tfla.max_delta,
            "TFLA_counts": [self.tfla.disagreements, self.tfla.positions],
            "TFLA_cut_ties": self.tfla.cut_ties,
            "BF": share(*self.bf) if self.bf else None,
            "BF_counts": list(self.bf) if self.bf else None,
            "BF_as_text": self.text_bridges,
            "closer_mismatches": list(self.closer) if self.closer else None,
            "FBR": 1.0 if self.fbr_by_construction else share(*self.fbr),
            "FBR_counts": None if self.fbr_by_construction else list(self.fbr),
            "prefix_cache": None
            if self.cache is None
            else {
                "served": self.cache.served,
                "ideal_served": self.cache.ideal_served,
                "mean_cached_prompt_share": self.cache.mean_prompt_share,
                "later_turns": self.cache.turns,
                "reusable_tokens": self.cache.reusable,
                "cached_tokens": self.cache.cached,
                "ideal_tokens": self.cache.ideal,
                "block_size": self.cache_block,
            },
        }
        return out


def cached_tokens(turn: Turn) -> int | None:
    """``num_cached_tokens`` of a stored turn: prompt tokens the engine served from its prefix cache."""
    value = turn.stored.get("num_cached_tokens")
    return None if value is None else int(value)


def infer_cache_block(convs: dict[str, list[Conversation]]) -> int | None:
    """The prefix cache's block size, inferred from every cached count of every arm."""
    return cache_block_size(cached_tokens(t) for cs in convs.values() for c in cs for t in c.turns)


class Evaluator:
    def __init__(self, fmt: ChatFormat, scorer: Scorer, cache_block: int | None = None) -> None:
        self.cache_block = cache_block
        self.fmt = fmt
        self.scorer = scorer
        shape = PromptBuilder(fmt).shape
        self.closers = shape.history_ends
        # a render that ends on an assistant turn may close it the generation way (gpt-oss <|return|>
        # where history has <|end|>): counting turns in such a render needs both kinds of ends
        self.turn_ends = self.closers | frozenset(c.generation[-1] for c in (shape.plain, shape.tool) if c.generation)
        self.specials = frozenset(int(i) for i in fmt.tokenizer.all_special_ids)
        self._cache: dict[tuple[int, int, bool], Reference | None] = {}

    def render(self, conv: Conversation, upto: int, gen: bool) -> list[int] | None:
        """Token ids of the template's render of ``conv.messages[:upto]`` (text encoded safely), or None
        if the template cannot render them safely (it rewrites text holding control-token strings)."""
        ref = self.reference(conv, upto, gen)
        return None if ref is None else ref.ids

    def reference(self, conv: Conversation, upto: int, gen: bool) -> Reference | None:
        key = (id(conv), upto, gen)
        if key not in self._cache:
            self._cache[key] = reference_render(self.fmt, conv.messages[:upto], conv.script.tools, gen)
        return self._cache[key]

    def counts(self, convs: list[Conversation]) -> dict[str, int]:
        turns = [t for c in convs for t in c.turns]
        stop_turns = [t for t in turns if t.sampling.get("stop_token_ids")]
        return {
            "conversations": len(convs),
            "turns": len(turns),
            "turn_pairs": sum(max(0, len(c.turns) - 1) for c in convs),
            "failed_turns": sum(len(c.failed) for c in convs),
            "tool_call_turns": sum(1 for t in turns if t.stored.get("tool_calls")),
            "tool_results": sum(1 for c in convs for m in c.messages if m.role == "tool"),
            "client_written_turns": sum(len(c.written_at()) for c in convs),
            "pairs_across_written": sum(sum(c.after_written()) for c in convs),
            "reasoning_turns": sum(1 for t in turns if t.stored.get("reasoning_content") is not None),
            "truncated_turns": sum(1 for t in turns if t.stored.get("finish_reason") == "length"),
            "synthetic_closer_turns": sum(1 for t in turns if t.stored.get("synthetic_token_count")),
            "stop_token_turns": len(stop_turns),
            "stopped_on_stop_token": sum(
                1
                for t in stop_turns
                if t.stored.get("finish_reason") == "stop"
                and t.stored.get("stop_reason") in t.sampling["stop_token_ids"]
            ),
            "control_string_turns": sum(1 for c in convs for t in c.turns if self._control_turn(c, t)),
        }

    @staticmethod
    def _control_turn(conv: Conversation, turn: Turn) -> bool:
        new = conv.messages[turn.new_from : turn.at]
        return any(has_control_text(m.content) for m in new)

    def evaluate(self, arm: str, convs: list[Conversation]) -> ArmReport:
        report = ArmReport(counts=self.counts(convs))
        for t in (t for c in convs for t in c.failed):
            report.errors[t.error or "?"] = report.errors.get(t.error or "?", 0) + 1
        tef = epb = pairs = later = forks = bf = closer = stitched = 0
        for conv in convs:
            turns = conv.turns
            if not turns:
                continue
            stored = [(t.prompt, t.completion) for t in turns]
            breaks = extension_breaks(stored)
            epb, pairs = epb + sum(breaks), pairs + len(breaks)
            across = [b for b, w in zip(breaks, conv.after_written(), strict=True) if w]
            report.epb_written = (report.epb_written[0] + sum(across), report.epb_written[1] + len(across))
            for turn, broke in zip(turns[1:], breaks, strict=True):
                if broke:
                    self._example(report, conv, turn, "extension break")
            report.samples += samples_per_rollout(stored)
            later += len(turns) - 1
            forks += sum(1 for t in turns[1:] if t.stored.get("fork"))
            for t in turns:
                if not self._exact(arm, conv, t):
                    tef += 1
                    self._example(report, conv, t, "token exactness")
            if arm == "stitch":
                report.tfla += self._tfla_stitch(turns)
                counted = self._bridges(report, conv)
                bf, closer, stitched = bf + counted[0], closer + counted[1], stitched + counted[2]
            else:
                report.tfla += self._tfla_naive(conv)
        report.tef, report.epb, report.fbr = (tef, report.counts["turns"]), (epb, pairs), (forks, later)
        report.cache_block = self.cache_block
        report.cache = prefix_cache(
            ([(t.prompt, t.completion, cached_tokens(t)) for t in c.turns] for c in convs), self.cache_block
        )
        if arm == "stitch":
            report.bf, report.closer = (bf, stitched), (closer, stitched)
        else:
            report.fbr_by_construction = True
        return report

    def _example(self, report: ArmReport, conv: Conversation, turn: Turn, what: str) -> None:
        if len(report.examples) < 5:
            report.examples.append(
                f"{what}: conversation {conv.script.index}, turn {turn.turn} round {turn.round}, message "
                f"{turn.message_id} (finish={turn.stored.get('finish_reason')}, stop={turn.stored.get('stop_reason')}, "
                f"fork={turn.stored.get('fork')})"
            )

    def _exact(self, arm: str, conv: Conversation, turn: Turn) -> bool:
        if arm == "stitch":
            return tokens_exact(
                turn.prompt, turn.completion, turn.logprobs, turn.prompt, turn.streamed_ids, turn.streamed_logprobs
            )
        prompt, through = self.render(conv, turn.at, True), self.render(conv, turn.at + 1, False)
        if prompt is None or through is None:
            return False
        view = naive_training_view(prompt, through, self.closers)
        return view is not None and view == (turn.prompt, turn.streamed_ids)

    def _tfla_stitch(self, turns: list[Turn]) -> Agreement:
        total = Agreement()
        for sample in merge_turns([(t.prompt, t.completion) for t in turns]):
            last = turns[sample[-1]]
            seq = [*last.prompt, *last.completion]
            logits = self.scorer.logits(seq)
            for k in sample:
                t = turns[k]
                rescored = self.scorer.rescored(logits, seq, len(t.prompt), len(t.completion), t.sampling)
                # the merge guarantees seq extends this turn's prompt + completion
                deltas = logprob_deltas(t.logprobs, rescored)
                tied = None
                if any(d > TFLA_TOLERANCE for d in deltas):
                    tied = self.scorer.cut_tied(logits, seq, len(t.prompt), len(t.completion), t.sampling)
                total += agreement(deltas, tied=tied)
        return total

    def _tfla_naive(self, conv: Conversation) -> Agreement:
        total = Agreement()
        final = self.render(conv, conv.turns[-1].at + 1, False)
        logits = self.scorer.logits(final) if final is not None else None
        for t in conv.turns:
            engine = t.streamed_ids
            prompt = self.render(conv, t.at, True)
            if final is None or prompt is None or not extends(prompt, final):
                total += agreement([math.inf] * len(engine))
                continue
            start = len(prompt)
            view = final[start : turn_end(final, start, self.closers)]
            n = aligned_prefix(view, engine)
            rescored = self.scorer.rescored(logits, final, start, n, t.sampling)
            deltas = logprob_deltas(t.streamed_logprobs[:n], rescored) + [math.inf] * (len(engine) - n)
            total += agreement(deltas)
        return total

    def _without_controls(
        self, conv: Conversation, at: int, prior_at: int
    ) -> tuple[Reference | None, list[int] | None, list[int] | None]:
        """(full, history, before) renders of ``conv`` with control-token strings removed from the texts
        of the history (messages up to the prior assistant turn)."""
        controls = self.fmt.control_strings

        def clean(text: str | None) -> str | None:
            if not text:
                return text
            for c in controls:
                text = text.replace(c, "")
            # a text that was only control strings (``</think>\n</think>``) would be empty or blank: the
            # template may then drop or strip it so that no text is left to locate; a word stands in
            return text if text.strip() else "x"

        # only the history: the new messages are what the bridge renders
        messages = [
            m.model_copy(update={"content": clean(m.content) or "", "reasoning_content": clean(m.reasoning_content)})
            if i <= prior_at
            else m
            for i, m in enumerate(conv.messages)
        ]
        tools = conv.script.tools
        full = reference_render(self.fmt, messages[:at], tools, True)
        history = reference_render(self.fmt, messages[: prior_at + 1], tools, False)
        before = reference_render(self.fmt, messages[:prior_at], tools, True)
        return full, history.ids if history else None, before.ids if before else None

    def _text_bridge(
        self, conv: Conversation, t: Turn, prior: Turn, reused: int, synthetic: int
    ) -> tuple[int, int] | None:
        """(bridge failure, closer mismatch) as text: the stored bridge decodes to the template's text of
        the new messages (the full render after the render of the history), and a synthetic closer to the
        end of that history render. None where even the texts do not line up (not counted)."""
        real = [template_message(m, m.content, m.reasoning_content) for m in conv.messages]
        tools = conv.script.tools
        try:
            full = self.fmt.render_text(real[: t.at], add_generation_prompt=True, tools=tools)
            history = self.fmt.render_text(real[: prior.at + 1], add_generation_prompt=False, tools=tools)
        except Exception:
            return None
        if not full.startswith(history):
            return None

        def text(ids: list[int]) -> str:
            return str(self.fmt.tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False))

        bridge = text(t.prompt[reused + synthetic :])
        closer = text(t.prompt[reused : reused + synthetic])
        return int(bridge != full[len(history) :]), int(bool(closer) and not history.endswith(closer))

    def _bridges(self, report: ArmReport, conv: Conversation) -> tuple[int, int, int]:
        """(bridge failures, closer mismatches, stitched turns) of one stitch-arm conversation."""
        bf = closer = stitched = 0
        by_id = {t.message_id: t for t in conv.turns}
        for t in conv.turns:
            prior = by_id.get(t.stored.get("prior_message_id") or "")
            if t.stored.get("fork") or prior is None:
                continue
            stitched += 1
            full = self.reference(conv, t.at, True)
            history = self.render(conv, prior.at + 1, False)
            before = self.render(conv, prior.at, True)
            if full is None or history is None:
                # A text of the history holds a control string that the template interprets (a
                # </think> the model wrote without opening reasoning): the texts cannot be isolated.
                # The bridge (closer, new messages, generation prompt) does not depend on them, so it
                # is measured on the same conversation with control strings taken out of its texts.
                full, history, before = self._without_controls(conv, t.at, prior.at)
            expected = None
            if full is not None and history is not None:
                anchor = full.text_end(prior.at)
                expected = expected_stitch_suffix(full.ids, history, self.turn_ends, self.specials, before, anchor)
            reused = int(t.stored.get("reused_prefix_len") or 0)
            synthetic = int(t.stored.get("synthetic_token_count") or 0)
            if expected is None and full is None:
                # The template transforms message text itself (llama 3.1 puts a tool result through
                # ``tojson``), so no token-level reference isolates the texts: compare the bridge as text.
                report.text_bridges += 1
                text = self._text_bridge(conv, t, prior, reused, synthetic)
                if text is not None:
                    bf += text[0]
                    closer += text[1]
                    if text[0] or text[1]:
                        self._example(report, conv, t, "bridge (as text)")
                    continue
            if expected is None or bridge_mismatch(t.prompt, reused, synthetic, expected[1]):
                bf += 1
                self._example(report, conv, t, "bridge")
            closed = turn_closed(
                prior.completion, prior.stored.get("finish_reason"), prior.stored.get("stop_reason"), self.turn_ends
            )
            if expected is None or closer_mismatch(t.prompt, reused, synthetic, expected[0], closed):
                closer += 1
                self._example(report, conv, t, "synthetic closer")
        return bf, closer, stitched
