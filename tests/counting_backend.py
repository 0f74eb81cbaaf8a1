"""A NumPy backend that records what it allocates, for the tests of host and arena memory.

Shared by the session tests (`tests/runtime`) and the generation tests (`tests/models`):
both count arenas and host buffers and hold weak references to them, to check that a
session allocates what the plans state and that closing it frees everything.
"""

from __future__ import annotations

import weakref

from runtime.numpy_backend import NumpyBackend


class Counting(NumpyBackend):
    """NumPy (with host staging when `staging`), recording every arena and host
    allocation, with weak references to what it handed out."""

    name = "counting"

    def __init__(self, staging: bool = False, timeout: float = 300.0):
        super().__init__(timeout=timeout)
        self.host_staging = staging
        self.arenas: list[int] = []
        self.hosts: list[int] = []
        self.buffers: list[weakref.ref] = []

    def allocate_arena(self, nbytes):
        self.arenas.append(nbytes)
        arena = super().allocate_arena(nbytes)
        self.buffers.append(weakref.ref(arena))
        return arena

    def allocate_host(self, nbytes):
        self.hosts.append(nbytes)
        host = super().allocate_host(nbytes)
        self.buffers.append(weakref.ref(host))
        return host
