"""The registry's compact index: memory per block, and LRU/pin/footprint semantics kept exactly."""

import gc
import os
import tracemalloc

import pytest

from kvbm.blocks import BlockKey
from kvbm.index.registry import Registry

NS_A = "m-0123456789abcdef"
NS_B = "m-fedcba9876543210"


def k(i: int, ns: str = NS_A, n: int = 16) -> BlockKey:
    return BlockKey(ns, i.to_bytes(n, "big"))


def _retained_per_block(n: int, tiers: list[str]) -> float:
    """Heap the registry keeps per block once the caller's keys are gone (what a daemon pays)."""
    raw = os.urandom(16 * n)
    gc.collect()
    tracemalloc.start()
    try:
        reg = Registry(["G1", "G2", "G3", "G4"])
        base, _ = tracemalloc.get_traced_memory()
        for i in range(n):
            key = BlockKey(NS_A, raw[i * 16 : (i + 1) * 16])  # a fresh key per event, as decoded from a message
            for t in tiers:
                reg.add(t, key, 8 << 20)
        del key
        gc.collect()
        cur, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert reg.count(tiers[0]) == n and len(reg) == n
    return (cur - base) / n


def test_index_memory_per_block_one_tier():
    # Measured at 200k: 186 B/block before the compact index (BlockKey + bytes + OrderedDict node), 100 after.
    per = _retained_per_block(200_000, ["G3"])
    assert per < 130, f"{per:.0f} bytes per block"


def test_index_memory_per_block_two_tiers():
    # A block in G2 and G3 shares its key; at 200k before: 292 B/block, after: 153.
    per = _retained_per_block(200_000, ["G2", "G3"])
    assert per < 170, f"{per:.0f} bytes per block"


def test_lru_order_is_per_tier_and_global_across_namespaces():
    r = Registry(["G2", "G3"])
    order = [k(1), k(1, NS_B), k(2), k(2, NS_B)]
    for key in order:
        r.add("G2", key, 10)
    r.add("G3", k(2), 10)
    r.add("G3", k(1), 10)
    assert r.keys("G2") == order
    assert r.keys("G3") == [k(2), k(1)]
    assert r.victims("G2", 20, 40) == [k(1), k(1, NS_B)]
    # touch moves to the end of one tier only; record_hit moves in every tier holding the block
    r.touch("G2", k(1))
    assert r.keys("G2") == [k(1, NS_B), k(2), k(2, NS_B), k(1)] and r.keys("G3") == [k(2), k(1)]
    r.record_hit([k(2)])
    assert r.keys("G2")[-1] == k(2) and r.keys("G3") == [k(1), k(2)]
    assert r.victims("G3", 10, 20) == [k(1)]
    # the same hash in two namespaces is two blocks
    assert r.where(k(1, NS_B)) == ["G2"] and r.where(k(1)) == ["G2", "G3"]
    assert len(r) == 4
    r.remove("G2", k(1, NS_B))
    assert r.where(k(1)) == ["G2", "G3"] and not r.holds("G2", k(1, NS_B))


def test_keys_round_trip_any_hash_length_and_leading_zeros():
    r = Registry(["G3"])
    keys = [BlockKey(NS_A, b""), BlockKey(NS_A, b"\x00"), BlockKey(NS_A, b"\x00\x00\x01"),
            BlockKey(NS_A, bytes(16)), BlockKey(NS_A, b"\xff" * 32), BlockKey(NS_B, b"\x00\x00\x01")]
    for key in keys:
        r.add("G3", key, 1)
    assert r.keys("G3") == keys and r.count("G3") == len(keys) == len(r)
    assert all(r.holds("G3", key) for key in keys)
    assert r.match_prefix(keys) == ["G3"] * len(keys)
    unknown = BlockKey("m-unknown0000000000", b"\x01")
    assert r.match_prefix([unknown, *keys]) == []
    assert r.match_prefix([*keys, unknown, keys[0]]) == ["G3"] * len(keys)
    assert not r.holds("G3", unknown) and r.where(unknown) == [] and r.hits(unknown) == 0
    # the same answer from the hashes a Lookup message carries
    a = [key for key in keys if key.namespace == NS_A]
    assert r.match_hashes(NS_A, [key.hash for key in a]) == r.match_prefix(a) == ["G3"] * len(a)
    assert r.match_hashes(NS_A, [a[0].hash, b"\x07", a[1].hash]) == ["G3"]
    assert r.match_hashes("m-unknown0000000000", [a[0].hash]) == []


def test_used_bytes_follow_each_blocks_footprint():
    r = Registry(["G2"])
    r.add("G2", k(1), 100)
    r.add("G2", k(2), 40)  # a partial last block
    r.add("G2", k(3), 100)
    assert r.used("G2") == 240
    r.add("G2", k(1), 60)  # re-added with another footprint: replaced, not added
    assert r.used("G2") == 200 and r.count("G2") == 3
    # victims count each block's own footprint: k(2)=40 then k(3)=100 (k(1) was re-added last)
    assert r.victims("G2", 100, 200) == [k(2), k(3)]
    assert r.remove("G2", k(2)) and r.used("G2") == 160
    r.add("G2", k(3), 100)
    assert r.remove("G2", k(1)) and r.used("G2") == 100
    assert not r.remove("G2", k(1)) and r.used("G2") == 100
    assert r.remove("G2", k(3)) and r.used("G2") == 0 and len(r) == 0


def test_pins_per_tier_and_everywhere_and_hits_live_while_any_tier_holds():
    r = Registry(["G2", "G3"])
    for i in range(3):
        r.add("G2", k(i), 10)
        r.add("G3", k(i), 10)
    r.pin([k(0)], "G2")
    assert r.is_pinned(k(0), "G2") and not r.is_pinned(k(0), "G3") and not r.is_pinned(k(0))
    assert r.victims("G2", 10, 30) == [k(1)] and r.victims("G3", 10, 30) == [k(0)]
    with r.pinned([k(1), k(1)]):  # counted: two pins need two unpins
        assert r.is_pinned(k(1), "G3") and r.victims("G3", 10, 30) == [k(0)]
        r.unpin([k(1)])
        assert r.is_pinned(k(1))
    assert not r.is_pinned(k(1)) and r.victims("G3", 20, 30) == [k(0), k(1)]
    with pytest.raises(LookupError):
        r.victims("G2", 30, 30)  # k(0) is pinned in G2
    r.unpin([k(0)], "G2")
    assert r.victims("G2", 30, 30) == [k(0), k(1), k(2)]
    r.record_hit([k(2), k(2)])
    assert r.hits(k(2)) == 2
    r.remove("G2", k(2))
    assert r.hits(k(2)) == 2  # still in G3
    r.remove("G3", k(2))
    assert r.hits(k(2)) == 0


def test_listeners_hear_new_blocks_and_removals_once():
    r = Registry(["G2", "G3"])
    heard: list[tuple[str, str, BlockKey]] = []
    r.listeners.append(lambda kind, tier, keys: heard.extend((kind, tier, key) for key in keys))
    r.add("G2", k(1), 1)
    r.add("G2", k(1), 1)  # re-add: not a new block in G2
    r.add("G3", k(1), 1)
    r.remove("G2", k(1))
    r.remove("G2", k(1))  # not there: no event
    assert heard == [("stored", "G2", k(1)), ("stored", "G3", k(1)), ("removed", "G2", k(1))]


def test_random_operations_match_a_plain_model():
    """Random adds (two footprints, the rare one first), removes, touches, hits and pins against an
    OrderedDict model of what the registry promises: membership, LRU order, used bytes, victims."""
    import random
    from collections import OrderedDict

    rnd = random.Random(7)
    tiers = ["G2", "G3"]
    r = Registry(tiers)
    model: dict[str, OrderedDict[BlockKey, int]] = {t: OrderedDict() for t in tiers}
    keys = [k(i, NS_A if i % 3 else NS_B) for i in range(300)]
    r.add("G2", keys[0], 40)  # a partial block first: most blocks then differ from the first footprint
    model["G2"][keys[0]] = 40
    for step in range(6000):
        op = rnd.random()
        key, t = rnd.choice(keys), rnd.choice(tiers)
        if op < 0.5:
            fp = 40 if rnd.random() < 0.05 else 100
            r.add(t, key, fp)
            model[t].pop(key, None)
            model[t][key] = fp
        elif op < 0.75:
            assert r.remove(t, key) == (model[t].pop(key, None) is not None)
        elif op < 0.85:
            r.touch(t, key)
            if key in model[t]:
                model[t].move_to_end(key)
        else:
            r.record_hit([key])
            for m in model.values():
                if key in m:
                    m.move_to_end(key)
        if step % 500 == 0 or step == 5999:
            for tier in tiers:
                assert r.keys(tier) == list(model[tier])
                assert r.used(tier) == sum(model[tier].values()) and r.count(tier) == len(model[tier])
                pinned = set(rnd.sample(list(model[tier]), min(5, len(model[tier]))))
                r.pin(pinned, tier)
                want, need = [], 350
                for kk, fp in model[tier].items():
                    if kk in pinned:
                        continue
                    want.append(kk)
                    need -= fp
                    if need <= 0:
                        break
                if need > 0:
                    with pytest.raises(LookupError):
                        r.victims(tier, 350, r.used(tier))
                else:
                    assert r.victims(tier, 350, r.used(tier)) == want
                r.unpin(pinned, tier)
    assert len(r) == len(set(model["G2"]) | set(model["G3"]))
    # Memory: the common footprint is the tier's base and the rare one the exception, whichever came first.
    g2 = r._ti["G2"]
    assert r._sizes[g2].base == 100 and len(r._sizes[g2].odd) < r.count("G2") / 4


def test_marking_held_blocks_partial_keeps_their_lru_place_and_spares_hit_and_removed_ones() -> None:
    """Blocks found partial after they were indexed (a bucket listing shows no header flags) are marked in place:
    evicted first from then on, their LRU place and the listeners untouched; a block hit since, or removed since
    (while the listing's pass yielded), is left as it is."""
    reg = Registry(["G2", "G4"])
    heard: list[tuple[str, str, list[BlockKey]]] = []
    for i in range(5):
        reg.add("G4", k(i), 100)
    reg.listeners.append(lambda kind, tier, keys: heard.append((kind, tier, keys)))
    reg.record_hit([k(1)])
    reg.remove("G4", k(2))
    heard.clear()
    before = list(reg.iter_keys("G4"))
    assert reg.mark_partial("G4", [k(1), k(2), k(3)]) == 1  # 1 was hit, 2 is gone
    assert [reg.is_partial(k(i)) for i in range(5)] == [False, False, False, True, False]
    assert list(reg.iter_keys("G4")) == before and not heard and not reg.holds("G4", k(2))
    assert reg.victims("G4", 100, 400) == [k(3)]  # a never-hit partial block goes first, ahead of older ones
    assert reg.mark_partial("G4", [k(3)]) == 0  # already marked
