"""A set of background tasks that outlive no one: spawned, tracked, cancelled together.

Every task the daemon starts besides its main ones lives in a ``TaskSet``: it is kept in
a set until it finishes (``add_done_callback(discard)``), an exception it ends with is
logged rather than lost, and ``cancel`` stops and awaits all that are left.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any

import structlog

log = structlog.get_logger("pushsvc.tasks")


class TaskSet:
    def __init__(self, name: str) -> None:
        self.name = name
        self._tasks: set[asyncio.Task[Any]] = set()

    def spawn(self, coro: Coroutine[Any, Any, Any]) -> asyncio.Task[Any]:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._done)
        return task

    def _done(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            exc = task.exception()
            log.error("task_failed", tasks=self.name, task=task.get_coro().__qualname__,
                      error=f"{type(exc).__name__}: {exc}", exc_info=exc)

    async def cancel(self) -> None:
        tasks = list(self._tasks)
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def __len__(self) -> int:
        return len(self._tasks)

    def __repr__(self) -> str:
        return f"<TaskSet {self.name} running={len(self._tasks)}>"
