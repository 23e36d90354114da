"""Constrained requests that wait for their grammar (``WAITING_FOR_GRAMMAR``) before the
scheduler sees them."""

from __future__ import annotations

import concurrent.futures
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from radixserve.core.request import Request, RequestState
from radixserve.executor import grammar as _grammar
from radixserve.executor.grammar import GrammarService, timeout_message

# the one grammar timeout's default (``EngineConfig.grammar_compile_timeout_s``)
DEFAULT_COMPILE_TIMEOUT_S = 10.0


def parse_grammar(key: tuple[str, str]) -> Any:
    """The spec parsed, not compiled (``executor.grammar.parse_grammar``): what the serving
    frontend checks a request's grammar with."""
    return _grammar.parse_grammar(key)


@dataclass
class _Waiting:
    requests: list[Request]  # the samples of one prompt, all WAITING_FOR_GRAMMAR
    key: tuple[str, str]
    future: concurrent.futures.Future
    deadline: float


class GrammarWaitList:
    """Groups of samples whose grammar compiles in a worker thread.

    Invariants: every request here is in ``WAITING_FOR_GRAMMAR`` and unknown to the
    scheduler; ``poll`` never blocks on a compile: a group leaves when its grammar is ready
    (each sample gets its own matcher, moves to NEW and is handed to ``admit``), when the
    compile failed or passed its deadline (each sample is handed to ``fail`` with a message
    naming the field), or when aborted (``remove``).
    """

    def __init__(
        self,
        make_service: Callable[[], GrammarService],
        timeout_s: float = DEFAULT_COMPILE_TIMEOUT_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._make_service = make_service
        self._service: GrammarService | None = None
        self.timeout_s = timeout_s
        self.clock = clock
        self._groups: list[_Waiting] = []

    @property
    def service(self) -> GrammarService:
        if self._service is None:
            self._service = self._make_service()
        return self._service

    def __len__(self) -> int:
        return sum(len(g.requests) for g in self._groups)

    def add(self, requests: list[Request], key: tuple[str, str]) -> None:
        for req in requests:
            req.transition(RequestState.WAITING_FOR_GRAMMAR)
        future = self.service.submit(key)
        self._groups.append(_Waiting(list(requests), key, future, self.clock() + self.timeout_s))

    def poll(
        self,
        admit: Callable[[list[Request]], None],
        fail: Callable[[Request, str], None],
    ) -> None:
        """Move every group whose compile ended (or timed out) on."""
        if not self._groups:
            return
        now = self.clock()
        still: list[_Waiting] = []
        for group in self._groups:
            if not group.future.done():
                if now < group.deadline:
                    still.append(group)
                    continue
                message = timeout_message(group.key[0], self.timeout_s)
                for req in group.requests:
                    fail(req, message)
                continue
            exc = group.future.exception()
            if exc is not None:
                for req in group.requests:
                    fail(req, str(exc))
                continue
            compiled: Any = group.future.result()
            for req in group.requests:
                req.grammar = self.service.matcher(compiled)
                req.transition(RequestState.NEW)
            admit(group.requests)
        self._groups = still

    def wait(self, timeout_s: float) -> None:
        """Doze until some compile ends or ``timeout_s`` passes (an otherwise idle engine)."""
        pending = [g.future for g in self._groups if not g.future.done()]
        if pending and len(pending) == len(self._groups):
            concurrent.futures.wait(
                pending, timeout_s, return_when=concurrent.futures.FIRST_COMPLETED
            )

    def remove(self, request_id: str) -> Request | None:
        """Take a waiting sample out (abort); returns it, or None if it is not here."""
        for group in self._groups:
            for req in group.requests:
                if req.request_id == request_id:
                    group.requests.remove(req)
                    if not group.requests:
                        self._groups.remove(group)
                    return req
        return None

    def close(self) -> None:
        if self._service is not None:
            self._service.close()
