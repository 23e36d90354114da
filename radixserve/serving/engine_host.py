"""An engine on a thread of the frontend's process, handled as the engine process is.

``EngineThread`` runs ``engine_process.serve_engine`` (the same loop, sockets and
messages as the engine process) and answers ``poll``, ``terminate``, ``kill`` and
``wait`` as ``subprocess.Popen`` does, so the client and its supervision treat both alike.
"""

from __future__ import annotations

import logging
import subprocess
import threading

from radixserve.engine.config import EngineConfig

logger = logging.getLogger(__name__)


class EngineThread:
    """One engine loop on a daemon thread.

    Invariants: ``returncode`` is None while the thread runs, then the loop's exit code (1
    if it raised: the error is logged); ``terminate`` and ``kill`` both ask the loop to stop
    after its current step (a thread cannot be killed: a hung one is abandoned, and being a
    daemon it does not keep the process alive)."""

    def __init__(self, config: EngineConfig, inbox: str, outbox: str) -> None:
        self._stop = threading.Event()
        self.returncode: int | None = None
        self._thread = threading.Thread(
            target=self._run, args=(config, inbox, outbox), name="radixserve-engine", daemon=True
        )
        self._thread.start()

    def _run(self, config: EngineConfig, inbox: str, outbox: str) -> None:
        from radixserve.serving.engine_process import serve_engine

        code = 1
        try:
            code = serve_engine(config, inbox, outbox, self._stop.is_set)
        except BaseException:
            logger.exception("the in-process engine failed")
        finally:
            self.returncode = code

    def poll(self) -> int | None:
        return None if self._thread.is_alive() else self.returncode

    def terminate(self) -> None:
        self._stop.set()

    kill = terminate

    def wait(self, timeout: float | None = None) -> int:
        self._thread.join(timeout)
        if self._thread.is_alive():
            raise subprocess.TimeoutExpired("radixserve-engine", timeout or 0.0)
        assert self.returncode is not None
        return self.returncode
