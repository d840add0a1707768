"""A reply's streamed text, assembled from per-token texts and channels (``shared.protocol`` CHANNEL_*)
so that the deltas add up to the parsed message, character for character (DESIGN D19).

The parsed message is the authority: its ``content`` and ``reasoning_content`` are stripped, its stop
string cut off, and a tool-call block stays text unless it parsed. So a stream only sends text that the
message will surely hold: it holds back leading and trailing whitespace, a possible start of a stop
string, and tool-call text until the worker says whether it parsed. At the end ``finish`` gives what
the message adds to what was sent (the held text of an unclosed block or of a call that did not parse,
the whitespace inside it...). Whatever was sent is a prefix of the message, so the client that echoes
what it assembled echoes the stored message.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from shared.protocol import CHANNEL_CONTENT, CHANNEL_HIDDEN, CHANNEL_REASONING, CHANNEL_TOOL, CHANNEL_UNPARSED

__all__ = ["Delta", "ReplyStream"]


@dataclass
class Delta:
    content: str = ""
    reasoning: str = ""


def _partial_stop(text: str, stop: str) -> int:
    """The length of the longest end of ``text`` that begins ``stop`` (and is shorter than it)."""
    for k in range(min(len(stop) - 1, len(text)), 0, -1):
        if text.endswith(stop[:k]):
            return k
    return 0


class _Text:
    """One channel's text: what was sent, and what is held after it."""

    def __init__(self, stops: Sequence[str], strip: bool) -> None:
        self.stops = stops
        self.strip = strip
        self.sent = ""
        self.held = ""
        self.stopped = False  # a stop string was seen: the message ends before it

    def push(self, text: str) -> str:
        if self.strip and not self.sent and not self.held:
            text = text.lstrip()  # the message is stripped
        self.held += text
        if self.stopped or not self.held:
            return ""
        # trailing whitespace only goes out once text follows it
        cut = len(self.held.rstrip()) if self.strip else len(self.held)
        for stop in self.stops:
            at = self.held.find(stop)
            if at >= 0:
                cut, self.stopped = min(cut, at), True
            else:
                cut = min(cut, len(self.held) - _partial_stop(self.held, stop))
        out, self.held = self.held[:cut], self.held[cut:]
        self.sent += out
        return out

    def release(self) -> str:
        """The channel has ended (another channel's text follows): text held as a possible start of a
        stop string can no longer become one here, so it goes out; trailing whitespace, which the
        stripped message drops, is dropped (nothing stays held: the next token does not look again)."""
        if self.stopped:
            return ""
        out = self.held.rstrip() if self.strip else self.held
        self.held = ""
        self.sent += out
        return out

    def rest(self, final: str) -> str | None:
        """What ``final`` adds to the text sent; None when it does not begin with it."""
        if not final.startswith(self.sent):
            return None
        tail = final[len(self.sent) :]
        self.sent, self.held = final, ""
        return tail


class ReplyStream:
    """Feed each batch's token texts and channels; ``finish`` with the parsed message. Channels it does
    not know (a newer worker's) hold everything from there to the end: safe, only later. ``strip``:
    the message is stripped (a chat reply; a raw completion's text is not)."""

    def __init__(self, stops: Sequence[str] = (), *, strip: bool = True) -> None:
        stops = [s for s in stops if s]
        self.content = _Text(stops, strip)
        self.reasoning = _Text(stops, strip)
        self._tool: list[str] = []  # texts of held tool-call tokens
        self._frozen = False  # hold everything to the end
        self.mismatch: list[str] = []  # channels whose sent text the message did not begin with

    def feed(self, texts: Sequence[str], channels: str) -> Delta:
        """The text this batch adds (``channels`` empty: all content, e.g. a raw prompt's reply)."""
        delta = Delta()
        if self._frozen:
            return delta
        for k, text in enumerate(texts):
            ch = channels[k] if channels else CHANNEL_CONTENT
            if ch == CHANNEL_TOOL:
                self._tool.append(text)
                continue
            if ch in (CHANNEL_CONTENT, CHANNEL_UNPARSED) and self.reasoning.held:
                # reasoning is over: send what it held, so that it does not trail the content
                delta.reasoning += self.reasoning.release()
            if ch == CHANNEL_UNPARSED:
                delta.content += self.content.push("".join(self._tool) + text)
            elif ch not in (CHANNEL_CONTENT, CHANNEL_REASONING, CHANNEL_HIDDEN):
                self._frozen = True
                return delta
            self._tool.clear()  # held markup followed by another channel: the call parsed
            if ch == CHANNEL_CONTENT:
                delta.content += self.content.push(text)
            elif ch == CHANNEL_REASONING:
                delta.reasoning += self.reasoning.push(text)
        return delta

    def finish(self, content: str | None, reasoning: str | None) -> Delta:
        """What the parsed message adds to the text sent; a channel whose sent text it does not begin
        with (which cannot be taken back) adds nothing and is named in ``mismatch``."""
        delta = Delta()
        for name, text, final in (("content", self.content, content), ("reasoning", self.reasoning, reasoning)):
            tail = text.rest(final or "")
            if tail is None:
                self.mismatch.append(name)
            elif name == "content":
                delta.content = tail
            else:
                delta.reasoning = tail
        self._tool.clear()
        return delta
