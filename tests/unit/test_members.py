"""Discovery's bookkeeping (kvbm.fleet.members) against an in-memory bucket: who is followed, when a member
is read again, when it expires, and that a bucket that cannot be asked drops nobody. The real thing (daemons,
SeaweedFS) is tests/integration/test_discovery.py."""

from __future__ import annotations

import asyncio

import msgspec

from kvbm.errors import TierUnavailableError
from kvbm.fleet.members import Discovery, Membership, member_key, members_prefix


class FakeBucket:
    """put_aux/get_aux/list_pages/delete_many over a dict; last-modified is a counter bumped by every PUT."""

    def __init__(self) -> None:
        self.prefix = "p"
        self.objects: dict[str, tuple[bytes, int]] = {}
        self.tick = 0
        self.down = False
        self.gets: dict[str, int] = {}

    def _check(self) -> None:
        if self.down:
            raise TierUnavailableError("down")

    async def put_aux(self, okey: str, body: bytes) -> None:
        self._check()
        self.tick += 1
        self.objects[okey] = (body, self.tick)

    async def get_aux(self, okey: str) -> bytes | None:
        self._check()
        self.gets[okey] = self.gets.get(okey, 0) + 1
        got = self.objects.get(okey)
        return got[0] if got else None

    async def list_pages(self, prefix: str):
        self._check()
        yield [(None, k, len(b), mt) for k, (b, mt) in sorted(self.objects.items()) if k.startswith(prefix)]

    async def delete_many(self, keys):
        self._check()
        for k in keys:
            self.objects.pop(k, None)
        return len(keys), []


def other(bucket: FakeBucket, node: str, endpoint: str, instance: str = "i1", ttl_s: float = 3.0) -> None:
    """Another daemon's (re)announcement."""
    m = Membership(node_id=node, instance=instance, events_endpoint=endpoint, started_at=0.0, ttl_s=ttl_s)
    bucket.tick += 1
    bucket.objects[member_key(bucket.prefix, node)] = (msgspec.json.encode(m), bucket.tick)


def test_join_reread_expire_and_outage() -> None:
    bucket = FakeBucket()
    now = [0.0]
    joined: list[str] = []
    left: list[str] = []
    d = Discovery(bucket, "me", "tcp://me:1", "", join=lambda m: joined.append(m.events_endpoint),
                  leave=left.append, interval_s=0.5, ttl_s=3.0, monotonic=lambda: now[0])

    async def go() -> None:
        other(bucket, "b", "tcp://b:1")
        await d.step()  # announces itself, finds b
        assert joined == ["tcp://b:1"] and members_prefix("p") + "me.json" in bucket.objects
        b_key = member_key("p", "b")
        gets = bucket.gets[b_key]
        for _ in range(4):  # b refreshes (same bytes, new last-modified): no GET, still followed
            now[0] += 0.5
            other(bucket, "b", "tcp://b:1")
            await d.scan()
        assert bucket.gets[b_key] == gets and d.members.keys() == {"b"} and left == []
        now[0] += 2.0  # a TTL since the last GET: read once again
        other(bucket, "b", "tcp://b:1")
        await d.scan()
        assert bucket.gets[b_key] == gets + 1
        other(bucket, "b", "tcp://b:22", instance="i2")  # restarted elsewhere (another size): followed anew
        now[0] += 0.5
        await d.scan()
        assert joined == ["tcp://b:1", "tcp://b:22"]
        bucket.down = True  # the bucket cannot be asked: nobody is dropped, however long
        now[0] += 60.0
        await d.step()
        assert d.members.keys() == {"b"} and d.stats.failed >= 1 and left == []
        bucket.down = False
        await d.scan()  # b did not refresh while we were blind, which we could not see: it gets a fresh TTL
        assert left == []
        now[0] += 3.5
        await d.scan()
        assert left == ["b"] and d.members == {}  # expired: not refreshed for its TTL

    asyncio.run(go())


def test_conflicting_node_id_and_bad_objects_are_counted() -> None:
    bucket = FakeBucket()
    d = Discovery(bucket, "me", "tcp://me:1", "", join=lambda m: None, leave=lambda n: None)

    async def go() -> None:
        await d.step()
        other(bucket, "me", "tcp://impostor:1", instance="someone-else")
        await bucket.put_aux(members_prefix("p") + "junk.json", b"{not json")
        await d.scan()
        assert d.stats.conflicts == 1 and d.stats.bad == 1 and d.members == {}
        await d.step()  # it puts its own membership back
        assert msgspec.json.decode(bucket.objects[d.key][0])["instance"] == d.me.instance
        await d.withdraw()  # a clean stop: gone, and no later step puts it back
        await d.step()
        assert d.key not in bucket.objects

    asyncio.run(go())
