"""An in-process stand-in for EtcdStore, on trio's clock, for the timing tests of
membership (fencing) that a real etcd cannot run under trio's MockClock.

Rules of this module: it keeps etcd's semantics where membership depends on them (a
lease is extended by its TTL when the keepalive is *handled*, its keys go when it
expires, revisions grow); ``down`` makes every call raise StoreUnavailable, ``hang``
makes calls never answer (until cancelled), ``delay`` handles a call after that long,
``reply_delay`` answers that long after handling it (a slow way back). Every
keepalive is logged with the time it was handled.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import trio

from dcp.producer.cluster.store import Entry, LeaseExpired, StoreUnavailable


@dataclass
class FakeHooks:
    events: list[tuple[float, str]] = field(default_factory=list)

    def fence(self, reason: str) -> None:
        self.events.append((trio.current_time(), "fence"))

    def restored(self) -> None:
        self.events.append((trio.current_time(), "restored"))

    def rejoined(self, lease: int) -> None:
        self.events.append((trio.current_time(), "rejoined"))

    def kinds(self) -> list[str]:
        return [k for _, k in self.events]


class FakeStore:
    def __init__(self, min_ttl: int = 2) -> None:
        self.kv: dict[str, Entry] = {}
        self.leases: dict[int, tuple[int, float]] = {}  # id -> (ttl, expires at)
        self.revision = 1
        self.min_ttl = min_ttl
        self.down = False
        self.hang = False
        self.delay = 0.0
        self.reply_delay = 0.0
        self.keepalives: list[float] = []
        self._next_lease = 100

    async def _call(self) -> None:
        if self.hang:
            await trio.sleep_forever()
        if self.delay:
            await trio.sleep(self.delay)
        if self.down:
            raise StoreUnavailable("fake etcd is down")
        self._expire()

    def _expire(self) -> None:
        now = trio.current_time()
        for lease, (_, at) in list(self.leases.items()):
            if at <= now:
                del self.leases[lease]
                self.kv = {k: e for k, e in self.kv.items() if e.lease != lease}

    def _write(self, key: str, value: bytes, lease: int) -> int:
        if lease and lease not in self.leases:
            raise LeaseExpired("fake: lease not found")
        self.revision += 1
        old = self.kv.get(key)
        created = old.create_revision if old else self.revision
        self.kv[key] = Entry(key, value, self.revision, created, lease)
        return self.revision

    async def get(self, key: str) -> Entry | None:
        await self._call()
        return self.kv.get(key)

    async def put(self, key: str, value: bytes, *, lease: int = 0) -> int:
        await self._call()
        return self._write(key, value, lease)

    async def compare_and_put(
        self, key: str, value: bytes, *, mod_revision: int, lease: int = 0
    ) -> int | None:
        await self._call()
        old = self.kv.get(key)
        if (old.mod_revision if old else 0) != mod_revision:
            return None
        return self._write(key, value, lease)

    async def grant_lease(self, ttl: int) -> tuple[int, int]:
        await self._call()
        ttl = max(ttl, self.min_ttl)
        self._next_lease += 1
        self.leases[self._next_lease] = (ttl, trio.current_time() + ttl)
        return self._next_lease, ttl

    async def refresh_lease(self, lease: int) -> int:
        await self._call()
        if lease not in self.leases:
            raise LeaseExpired("fake: lease expired")
        ttl, _ = self.leases[lease]
        now = trio.current_time()
        self.leases[lease] = (ttl, now + ttl)
        self.keepalives.append(now)
        if self.reply_delay:
            await trio.sleep(self.reply_delay)
        return ttl

    async def revoke_lease(self, lease: int) -> None:
        await self._call()
        if lease in self.leases:
            self.leases[lease] = (0, trio.current_time())
            self._expire()

    def lease_expires_at(self, lease: int) -> float:
        return self.leases[lease][1]
