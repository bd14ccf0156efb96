"""Wake streams when a vbucket changes, without waking every stream on every write.

The store calls ``notify(vb)`` synchronously after each change (it runs on
the trio thread). A stream that has caught up awaits ``wait(vb)``; only the
streams of that vbucket wake. Events are created on demand and dropped once
fired, so idle vbuckets cost nothing.
"""

from __future__ import annotations

import trio


class ChangeFeed:
    def __init__(self) -> None:
        self._events: dict[int, trio.Event] = {}
        self._any = trio.Event()

    def notify(self, vbucket: int, *_: object) -> None:
        event = self._events.pop(vbucket, None)
        if event is not None:
            event.set()
        if self._any.statistics().tasks_waiting:
            self._any.set()
            self._any = trio.Event()

    async def wait(self, vbucket: int) -> None:
        """Until the next change of ``vbucket``."""
        event = self._events.get(vbucket)
        if event is None:
            event = self._events[vbucket] = trio.Event()
        await event.wait()

    async def wait_any(self) -> None:
        """Until the next change of any vbucket (streams over many vbuckets)."""
        await self._any.wait()
