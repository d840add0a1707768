"""``/admin/models/{model}/weights``: push new weights to every worker of a model (``server.weights``),
and the versions pushed so far."""

from __future__ import annotations

from fastapi import APIRouter

from server.api.deps import AdminUser, StateDep
from shared.api import PolicyVersionRead, PushWeightsRequest, PushWeightsResponse

router = APIRouter(prefix="/admin/models", tags=["admin"])


@router.post("/{model}/weights")
async def push_weights(model: str, body: PushWeightsRequest, admin: AdminUser, state: StateDep) -> PushWeightsResponse:
    """Load the checkpoint in ``path`` into every connected worker of ``model`` as ``version`` and answer
    once each serves it. ``drain``: running replies finish on the old weights while new work waits
    queued; ``inflight``: the switch happens between two engine steps and running replies go on under
    the new weights (their context recomputed). The checkpoint is checked on every worker first: a bad
    one (422), a version not above the current one (409) or an unknown model (404) changes nothing."""
    answer = await state.hub.pushes.push(model, body.version, body.path, body.mode, admin.id)
    return PushWeightsResponse.model_validate(answer)


@router.get("/{model}/weights")
async def weights_history(model: str, _admin: AdminUser, state: StateDep) -> list[PolicyVersionRead]:
    """The versions pushed to ``model``, oldest first (version 0, the weights its workers start with,
    has no entry)."""
    return [
        PolicyVersionRead(
            model=v.model, version=v.version, path=v.path, mode=v.mode, pushed_at=v.pushed_at, pushed_by=v.pushed_by
        )
        for v in await state.hub.registry.history(model)
    ]
