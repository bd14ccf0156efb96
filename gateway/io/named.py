"""Open connections by name, where a newer namesake replaces the older one.

2.x closed a TAP connection whose name was reused, and 3.0 a UPR connection
likewise. ``NamedConnections.running`` keeps a connection under its name,
inside a ``trio.CancelScope``, for as long as the block runs; opening one
under a name already taken cancels the older one's scope (its handler
returns and its socket closes). A connection unregisters only itself, so the
late exit of the old one cannot remove the new one.

The one exception is 2.x's registered TAP client: a CONNECT with
REGISTERED_CLIENT under the name of a connection that is streaming (and not
already being closed) was refused and the first kept streaming (ep_engine.cc,
``createTapQueue``). Callers ask ``holds`` before they open such a one, with
no checkpoint between the question and ``running``.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Generic, TypeVar

import trio

log = logging.getLogger(__name__)

C = TypeVar("C")


class NamedConnections(Generic[C]):
    def __init__(self, label: str) -> None:
        self.label = label
        """What the connections are, for the log (``"TAP"``, ``"UPR"``)."""
        self._entries: dict[str, tuple[C, trio.CancelScope]] = {}
        self.opened = 0
        self.replaced = 0

    @contextmanager
    def running(self, name: str, connection: C) -> Iterator[trio.CancelScope]:
        """Keep ``connection`` under ``name`` while the block runs; a later namesake
        cancels the block."""
        scope = trio.CancelScope()
        entry = (connection, scope)
        old = self._entries.get(name)
        if old is not None:
            log.info("%s connection %r reopened: closing the older one", self.label, name)
            self.replaced += 1
            old[1].cancel()
        self._entries[name] = entry
        self.opened += 1
        try:
            with scope:
                yield scope
        finally:
            if self._entries.get(name) is entry:
                del self._entries[name]

    def holds(self, name: str) -> bool:
        """Whether a connection runs under ``name`` that is not already being closed."""
        entry = self._entries.get(name)
        return entry is not None and not entry[1].cancel_called

    def get(self, name: str) -> C | None:
        entry = self._entries.get(name)
        return entry[0] if entry is not None else None

    def close(self, name: str) -> bool:
        """Cancel the connection under ``name``; whether there was one."""
        entry = self._entries.get(name)
        if entry is not None:
            entry[1].cancel()
        return entry is not None

    def __getitem__(self, name: str) -> C:
        return self._entries[name][0]

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, name: str) -> bool:
        return name in self._entries

    def values(self) -> list[C]:
        """The open connections (a copy: closing one while iterating is safe)."""
        return [connection for connection, _ in self._entries.values()]
