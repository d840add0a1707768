"""Recently used chat paths of this server process, so that dispatching a turn reads nothing back.

A turn's work frame needs its message's path (root to parent, as the template sees it) and the stored
tokens of the nearest complete assistant ancestor (DESIGN section 5). This process usually knows both
already: it stored the previous reply a moment ago (``finished``) and the new messages of this request
(``added``). The cache keeps those as nodes linked to their parents; a dispatch that finds its parent
here builds the frame from memory, and one that does not (another replica stored the turn, the cache
dropped it, a retry) reads the path from SQL as before and seeds the cache with it.

Nodes hold exactly what SQL would return (stored content, tool calls, reasoning, state; an assistant's
tokens packed as in ``message_tokens``), and messages never change once stored, so a node is never
stale: a deleted chat's messages are simply not dispatched (the fenced ``start`` fails). Memory is
bounded by the number of cached tokens (LRU); evicted nodes live on only while a cached child refers
to them.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from server.chats.work_store import work_message
from server.models import Message
from shared.api import MessageState
from shared.packing import unpack_ids
from shared.protocol import PriorChain, WorkMessage


@dataclass(frozen=True, slots=True)
class StoredChain:
    """An assistant message's stored tokens and what the prompt builder needs with them."""

    prompt_ids: bytes  # packed as in message_tokens
    completion_ids: bytes
    finish_reason: str
    stop_reason: int | str | None
    tokenizer_hash: str
    template_hash: str
    system_prompt: str | None
    tools: list[dict[str, Any]] | None
    has_tool_calls: bool

    @property
    def tokens(self) -> int:
        return (len(self.prompt_ids) + len(self.completion_ids)) // 4

    def prior(self, message_id: str) -> PriorChain:
        return PriorChain(
            message_id=message_id,
            prompt_ids=unpack_ids(self.prompt_ids),
            completion_ids=unpack_ids(self.completion_ids),
            finish_reason=self.finish_reason,
            stop_reason=self.stop_reason,
            tokenizer_hash=self.tokenizer_hash,
            template_hash=self.template_hash,
            system_prompt=self.system_prompt,
            tools=self.tools,
            has_tool_calls=self.has_tool_calls,
        )


@dataclass(frozen=True, slots=True)
class Node:
    message: WorkMessage  # as the template sees it (stored content)
    state: str
    chain_hash: str | None  # the message's prefix-index key (None: the path is not indexed)
    parent: Node | None
    chain: StoredChain | None = None  # a complete assistant message's tokens (None: none stored)
    worker_id: str | None = None  # the worker that generated it (assistant messages)


@dataclass(frozen=True, slots=True)
class PendingWork:
    """An assistant message a request of this process just stored and queued (attempt 1)."""

    message_id: str
    chat_id: str
    parent_id: str
    attempt: int
    work_parameters: dict[str, Any]
    created_at: datetime
    session_key: str | None = None


class PathCache:
    def __init__(self, max_tokens: int = 20_000_000, max_nodes: int = 200_000, max_pending: int = 100_000) -> None:
        self.max_tokens = max_tokens
        self.max_nodes = max_nodes
        self.max_pending = max_pending
        self._nodes: OrderedDict[str, Node] = OrderedDict()
        self._tokens = 0
        self._pending: OrderedDict[str, PendingWork] = OrderedDict()
        self.hits = 0
        self.misses = 0

    # ---- nodes ----------------------------------------------------------------------------------
    def get(self, message_id: str | None) -> Node | None:
        if message_id is None:
            return None
        node = self._nodes.get(message_id)
        if node is not None:
            self._nodes.move_to_end(message_id)
        return node

    def put(self, node: Node) -> Node:
        old = self._nodes.pop(node.message.id, None)
        if old is not None and old.chain is not None:
            self._tokens -= old.chain.tokens
        self._nodes[node.message.id] = node
        if node.chain is not None:
            self._tokens += node.chain.tokens
        while self._nodes and (self._tokens > self.max_tokens or len(self._nodes) > self.max_nodes):
            _, dropped = self._nodes.popitem(last=False)
            if dropped.chain is not None:
                self._tokens -= dropped.chain.tokens
        return node

    def add(
        self,
        parent_id: str | None,
        message: WorkMessage,
        state: str,
        chain_hash: str | None,
        chain: StoredChain | None = None,
        worker_id: str | None = None,
    ) -> Node | None:
        """Cache a stored message under its parent; nothing (None) when the parent is not cached."""
        parent = self.get(parent_id)
        if parent_id is not None and parent is None:
            return None
        return self.put(Node(message, state, chain_hash, parent, chain, worker_id))

    def remember(self, messages: list[Message]) -> None:
        """Cache messages a request just stored (each under the one before it or a cached parent)."""
        for m in messages:
            self.add(m.parent_id, work_message(m), m.state, m.chain_hash)

    # ---- pending work ---------------------------------------------------------------------------
    def pending(self, work: PendingWork) -> None:
        self._pending[work.message_id] = work
        while len(self._pending) > self.max_pending:
            self._pending.popitem(last=False)

    def take_pending(self, message_id: str, attempt: int) -> PendingWork | None:
        work = self._pending.pop(message_id, None)
        return work if work is not None and work.attempt == attempt else None

    # ---- reading ----------------------------------------------------------------------------------
    def holder(self, parent_id: str | None) -> str | None:
        """The worker that generated the nearest complete assistant message at or above ``parent_id``
        (its engine computed the prefix the next prompt is stitched onto); None when not known here."""
        cur = self._nodes.get(parent_id) if parent_id is not None else None
        while cur is not None:
            if cur.message.role == "assistant" and cur.state == MessageState.complete.value:
                return cur.worker_id
            cur = cur.parent
        return None

    def path(self, parent_id: str) -> tuple[list[WorkMessage], PriorChain | None, str | None] | None:
        """The path root..``parent_id`` (root first), the prior chain (the nearest complete assistant
        with stored tokens), and the parent's chain hash; None when any of it is not known here."""
        node = self.get(parent_id)
        if node is None:
            self.misses += 1
            return None
        messages: list[WorkMessage] = []
        prior: PriorChain | None = None
        prior_known = False
        cur: Node | None = node
        while cur is not None:
            messages.append(cur.message)
            if not prior_known and cur.message.role == "assistant" and cur.state == MessageState.complete.value:
                if cur.chain is None:
                    self.misses += 1
                    return None  # its tokens are stored but not cached: ask SQL
                prior, prior_known = cur.chain.prior(cur.message.id), True
            cur = cur.parent
        messages.reverse()
        self.hits += 1
        return messages, prior, node.chain_hash
