"""The worker's side of a weights push (``server.weights``): ``check_weights`` checks a checkpoint
against the model the worker serves (headers only, nothing loaded), ``load_weights`` loads it into the
engine in place and answers once the new version serves. Both answer as ``rpc_result`` frames."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, cast

from shared.errors import ErrorCode
from shared.protocol import RpcFrame, RpcResultFrame
from worker.checkpoint import check_checkpoint
from worker.engines.contract import Engine, EngineError, WeightsMode

log = logging.getLogger(__name__)

_MODES = ("drain", "inflight")


class _BadCall(Exception):
    pass


def serves_weights(engine: Engine) -> bool:
    """Whether the engine takes weight updates (every real engine; a test's fake may not)."""
    return callable(getattr(engine, "update_weights", None))


def policy_version(engine: Engine) -> int:
    return int(getattr(engine, "policy_version", 0))


async def weights_call(engine: Engine, model_path: str | None, frame: RpcFrame) -> RpcResultFrame:
    """Run one ``check_weights`` or ``load_weights`` call; errors become the answer's code."""
    started = time.monotonic()
    try:
        path = _param(frame.params, "path", str)
        if frame.method == "check_weights":
            base = model_path or engine.info.extra.get("model_path")
            if not base:
                raise EngineError(ErrorCode.engine_error.value, "this worker does not know its model's directory")
            shapes = await asyncio.to_thread(check_checkpoint, path, base)
            return RpcResultFrame(id=frame.id, result={"tensors": len(shapes)})
        version = _param(frame.params, "version", int)
        mode = _param(frame.params, "mode", str)
        if mode not in _MODES:
            raise _BadCall(f"mode must be drain or inflight, not {mode!r}")
        if not serves_weights(engine):
            raise EngineError(ErrorCode.engine_error.value, f"the {engine.info.name} engine cannot update weights")
        if policy_version(engine) != version:
            log.info("loading weights version %d from %s (%s)", version, path, mode)
            await engine.update_weights(path, version, cast(WeightsMode, mode))
            log.info("weights version %d serves (%.2fs)", version, time.monotonic() - started)
        seconds = round(time.monotonic() - started, 3)
        return RpcResultFrame(id=frame.id, result={"version": policy_version(engine), "seconds": seconds})
    except _BadCall as exc:
        return RpcResultFrame(id=frame.id, code=ErrorCode.bad_request.value, message=str(exc))
    except EngineError as exc:
        log.warning("%s %s refused: %s", frame.method, frame.params.get("path"), exc)
        return RpcResultFrame(id=frame.id, code=str(exc.code), message=str(exc))
    except Exception as exc:
        log.exception("%s failed", frame.method)
        return RpcResultFrame(
            id=frame.id, code=ErrorCode.weights_load_failed.value, message=f"{type(exc).__name__}: {exc}"
        )


def _param(params: dict[str, Any], name: str, kind: type) -> Any:
    value = params.get(name)
    if not isinstance(value, kind) or isinstance(value, bool):
        raise _BadCall(f"{name} must be a {kind.__name__}")
    return value
