"""``POST /v1/rewards``: an environment scores an assistant turn; ``done`` ends the episode there."""

from __future__ import annotations

from fastapi import APIRouter
from sqlalchemy import select

from server.api.deps import CurrentUser, SessionDep, StateDep
from server.errors import ApiError
from server.export.feed import assign_position
from server.models import Chat, Message, utcnow
from shared.api import MessageState, RewardRead, RewardRequest
from shared.errors import ErrorCode

router = APIRouter(tags=["rewards"])


@router.post("/v1/rewards")
async def post_reward(body: RewardRequest, user: CurrentUser, session: SessionDep, state: StateDep) -> RewardRead:
    """Store the reward of an assistant message (the ``tokentrail.message_id`` of a chat completion,
    Responses or Messages answer, or an OA message id). The key of the message's owner, or an admin's.
    Posting again replaces the reward; ``done`` once true stays true. The first ``done`` puts the
    rollout root -> message into the rollout feed (``GET /v1/rollouts``); a later reward is stored and
    exported but does not put it in the feed again."""
    owned = select(Message, Chat.user_id).join(Chat, Chat.id == Message.chat_id)
    row = (await session.execute(owned.where(Message.id == body.message_id))).first()
    if row is None or (row[1] != user.id and not user.is_admin):
        raise ApiError(ErrorCode.message_not_found, f"no message {body.message_id} of yours", param="message_id")
    msg: Message = row[0]
    if msg.role != "assistant":
        raise ApiError(
            ErrorCode.not_assistant_message, f"message {msg.id} is a {msg.role} message: only replies take rewards"
        )
    if msg.state != MessageState.complete.value:
        raise ApiError(
            ErrorCode.message_not_complete, f"message {msg.id} is {msg.state}: only a completed reply takes a reward"
        )
    msg.reward = body.reward
    msg.episode_done = msg.episode_done or body.done
    msg.rewarded_at = utcnow()
    finished = msg.episode_done and msg.feed_seq is None
    if finished:
        await session.flush()
        await assign_position(session, msg.id)
    await session.commit()
    state.hub.finished.forget([msg.id])  # readers here read the rewarded row, not the copy kept at its end
    if finished:
        state.feed.notify()
    return RewardRead(
        message_id=msg.id, chat_id=msg.chat_id, reward=body.reward, done=msg.episode_done, rewarded_at=msg.rewarded_at
    )
