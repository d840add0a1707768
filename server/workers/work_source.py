"""What a worker is sent for a queued item: the message's work, from this process's memory when it
has it (``server.chats.path_cache``), else from SQL.

A turn that a request of this process stored and queued a moment ago (the common case: one server
process, or the replica that took the request also holds a worker of the model) is dispatched from
memory: its work parameters were registered when it was queued and its parent's path was cached when
the messages were stored, so the dispatch costs one fenced UPDATE (``start``). Anything else (a retry,
a turn queued by another replica, a path the cache dropped) is read from SQL, which also seeds the
cache for the turns after it. Both ways give the same frame.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any

from server.chats.finished import Finished
from server.chats.path_cache import Node, PathCache, StoredChain
from server.chats.work_store import WorkStore, work_message
from server.models import Message, MessageTokens, snapshot
from server.queue.protocol import WorkItem
from shared.api import MessageState, WorkParameters
from shared.packing import pack_ids
from shared.protocol import GenerationRecord, PriorChain, RawPrompt, ResumeState, WorkFrame, WorkMessage


@dataclass
class Work:
    """One assistant message to generate, as dispatch needs it."""

    message_id: str
    chat_id: str
    parent_id: str | None
    created_at: datetime
    failures: int
    params: WorkParameters
    work_parameters: dict[str, Any]  # as stored (params is their parsed form)
    path: list[WorkMessage]  # root..parent, as the template sees them
    prior: PriorChain | None
    parent_chain: str | None  # the parent's prefix-index key (None: not indexed)
    from_memory: bool = False
    session_key: str | None = None
    engine_deaths: int = 0

    def stored(
        self, record: GenerationRecord, tokens: dict[str, Any], attempt: int, worker_id: str, chain_hash: str | None
    ) -> Finished:
        """The message and its token row as ``WorkStore.store`` just wrote them (complete)."""
        message = snapshot(
            Message,
            {
                "id": self.message_id,
                "chat_id": self.chat_id,
                "parent_id": self.parent_id,
                "role": "assistant",
                "content": record.content,
                "tool_call_id": None,
                "reasoning_content": record.reasoning_content,
                "tool_calls": record.tool_calls or None,
                "state": MessageState.complete.value,
                "created_at": self.created_at,
                "modified_at": tokens["created_at"],
                "score": 0,
                "voted_at": None,
                "model_config_name": self.params.model_config_name,
                "work_parameters": self.work_parameters,
                "attempt": attempt,
                "failures": self.failures,
                "engine_deaths": self.engine_deaths,
                "worker_id": worker_id,
                "error": None,
                "error_code": None,
                "finish_reason": record.finish_reason,
                "prompt_token_count": len(record.prompt_ids),
                "completion_token_count": len(record.completion_ids),
                "chain_hash": chain_hash,
                "session_key": self.session_key,
                "policy_versions": [list(span) for span in record.policy_versions] or None,
                # a reply takes a reward only once complete: ``POST /v1/rewards`` forgets this copy
                "reward": None,
                "episode_done": False,
                "rewarded_at": None,
                "feed_seq": None,
            },
        )
        return Finished(message, snapshot(MessageTokens, tokens))

    def frame(self, model_name: str, attempt: int, seed: int | None, resume: ResumeState | None) -> WorkFrame:
        params = self.params
        messages = self.path
        if params.system_prompt is not None:
            messages = [WorkMessage(id="system", role="system", content=params.system_prompt), *messages]
        return WorkFrame(
            message_id=self.message_id,
            attempt=attempt,
            chat_id=self.chat_id,
            model_name=model_name,
            messages=messages,
            sampling=params.sampling_parameters,
            seed=seed,
            tools=params.tools,
            prior=None if params.raw_prompt else self.prior,
            resume=resume,
            template_kwargs=params.template_kwargs,
            raw=RawPrompt.model_validate(params.raw_prompt) if params.raw_prompt else None,
            client_prompt_ids=params.client_prompt_ids,
            required_prefix_ids=params.required_prefix_ids,
        )


class WorkSource:
    def __init__(self, store: WorkStore, paths: PathCache) -> None:
        self.store = store
        self.paths = paths

    async def load(self, item: WorkItem) -> Work | None:
        """The work of ``item``; None when there is none (finished, deleted or superseded)."""
        pending = self.paths.take_pending(item.message_id, item.attempt)
        if pending is not None:
            cached = self.paths.path(pending.parent_id)
            if cached is not None:
                path, prior, parent_chain = cached
                return Work(
                    message_id=pending.message_id,
                    chat_id=pending.chat_id,
                    parent_id=pending.parent_id,
                    created_at=pending.created_at,
                    failures=0,
                    params=WorkParameters.model_validate(pending.work_parameters),
                    work_parameters=pending.work_parameters,
                    path=path,
                    prior=prior,
                    parent_chain=parent_chain,
                    from_memory=True,
                    session_key=pending.session_key,
                )
        return await self.from_db(item.message_id, item.attempt)

    async def from_db(self, message_id: str, attempt: int | None = None) -> Work | None:
        """The work as SQL has it (and the cache seeded with its path); with ``attempt``, None unless
        the message is open at that attempt."""
        loaded = await self.store.load(message_id)
        if loaded is None or (attempt is not None and not self.store.is_open(loaded[0], attempt)):
            return None
        msg, rows = loaded
        params = self.store.work_parameters(msg)
        prior = None if params.raw_prompt else await self.store.prior_chain(rows)
        self._seed(rows, prior)
        return Work(
            message_id=msg.id,
            chat_id=msg.chat_id,
            parent_id=msg.parent_id,
            created_at=msg.created_at,
            failures=msg.failures,
            params=params,
            work_parameters=msg.work_parameters or {},
            path=[work_message(m) for m in rows],
            prior=prior,
            parent_chain=rows[-1].chain_hash if rows else None,
            session_key=msg.session_key,
            engine_deaths=msg.engine_deaths,
        )

    def _seed(self, rows: list[Message], prior: PriorChain | None) -> None:
        """Cache a path read from SQL (with the prior chain's tokens, the only ones read)."""
        parent: Node | None = None
        for m in rows:
            chain = None
            if prior is not None and m.id == prior.message_id:
                chain = StoredChain(
                    pack_ids(prior.prompt_ids),
                    pack_ids(prior.completion_ids),
                    prior.finish_reason,
                    prior.stop_reason,
                    prior.tokenizer_hash,
                    prior.template_hash,
                    prior.system_prompt,
                    prior.tools,
                    prior.has_tool_calls,
                )
            worker = m.worker_id if m.role == "assistant" else None
            parent = self.paths.put(Node(work_message(m), m.state, m.chain_hash, parent, chain, worker))

    def finished(self, work: Work, record: GenerationRecord, chain_hash: str | None, worker_id: str) -> None:
        """Cache a reply just stored as complete: the next turn of its chat is dispatched from memory."""
        if work.params.raw_prompt is not None:
            return  # raw prompts are never continued
        chain = StoredChain(
            pack_ids(record.prompt_ids),
            pack_ids(record.completion_ids),
            record.finish_reason,
            record.stop_reason,
            record.tokenizer_hash,
            record.template_hash,
            work.params.system_prompt,
            work.params.tools,
            bool(record.tool_calls),
        )
        message = WorkMessage(
            id=work.message_id,
            role="assistant",
            content=record.content or "",
            tool_calls=record.tool_calls or None,
            reasoning_content=record.reasoning_content,
        )
        self.paths.add(work.parent_id, message, MessageState.complete.value, chain_hash, chain, worker_id)
