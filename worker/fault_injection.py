"""Fault injection, for chaos runs and tests only: never enabled unless asked for.

With ``TOKENTRAIL_FAULT_INJECTION=engine`` in its environment a worker kills its own engine on SIGUSR1
(the hf engine's next model step raises on its thread; vLLM's engine-core processes are SIGKILLed), so
a harness can kill engines under load (benchmarks/chaos_engine.py) and watch the worker recover.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal

from worker.engine_health import SupervisedEngine

log = logging.getLogger(__name__)

ENV = "TOKENTRAIL_FAULT_INJECTION"
ENGINE_FAULT = "engine"
ENGINE_SIGNAL = signal.SIGUSR1


def install(engine: SupervisedEngine) -> bool:
    """Kill ``engine`` on SIGUSR1 if the environment asks for engine faults; True if installed."""
    if os.environ.get(ENV, "") != ENGINE_FAULT:
        return False
    asyncio.get_running_loop().add_signal_handler(ENGINE_SIGNAL, engine.inject_fault)
    log.warning("fault injection is on: SIGUSR1 kills this worker's engine (%s=%s)", ENV, ENGINE_FAULT)
    return True
