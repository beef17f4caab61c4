"""The KV directory's bookkeeping, plain asyncio (the pools run it as a Ray actor)."""
import asyncio

from keyacc_ray.serve.kv_directory import KVDirectory


class Clock:
    t = 0.0

    def __call__(self):
        return self.t


def test_put_then_take():
    d = KVDirectory()

    async def go():
        await d.put("a", ["ref-a"])
        return await d.take("a", 1.0), await d.size()

    assert asyncio.run(go()) == (["ref-a"], 0)


def test_take_waits_for_a_late_put_and_gives_up_after_its_timeout():
    d = KVDirectory()

    async def go():
        waiter = asyncio.create_task(d.take("b", 2.0))
        await asyncio.sleep(0.05)
        await d.put("b", ["ref-b"])
        missing = await d.take("never", 0.05)
        return await waiter, missing

    assert asyncio.run(go()) == (["ref-b"], [])


def test_untaken_entries_expire():
    clock = Clock()
    d = KVDirectory(ttl_s=60.0, clock=clock)

    async def go():
        await d.put("old", ["x"])
        clock.t = 30.0
        await d.put("new", ["y"])
        clock.t = 61.0
        return await d.size(), await d.take("old", 0.01), await d.take("new", 0.01)

    assert asyncio.run(go()) == (1, [], ["y"])


def test_an_entry_written_again_lives_from_its_last_write():
    """Expiry reads the oldest entries first and stops at a fresh one: an entry put again (a
    hop's KV put back under its key) or taken again counts from then, and one behind it that is
    older still expires."""
    clock = Clock()
    d = KVDirectory(ttl_s=60.0, clock=clock, taken_keep_s=30.0)

    async def go():
        await d.put("a", ["x"])
        clock.t = 10.0
        await d.put("b", ["y"])
        clock.t = 20.0
        await d.put("a", ["x2"])  # again: from t=20
        clock.t = 75.0  # b (t=10) expired, a (t=20) not
        sizes = [await d.size()]
        got = [await d.take("b", 0.01), await d.take("a", 0.01)]  # a taken at t=75
        await d.put("c", ["z"])
        got.append(await d.take("c", 0.01))  # c taken at t=75 too
        clock.t = 90.0
        got.append(await d.take("c", 0.01))  # again within taken_keep_s: kept from t=90
        clock.t = 110.0  # a's take (t=75) is past taken_keep_s, c's last (t=90) not
        got += [await d.take("a", 0.01), await d.take("c", 0.01)]
        return sizes, got

    assert asyncio.run(go()) == ([1], [[], ["x2"], ["z"], ["z"], [], ["z"]])


def test_a_taken_entry_answers_a_second_take_of_its_key_for_a_while():
    """A driver that gave a hop up sends the same hand-off (the same key) to the next hop, and the
    replica it gave up on may have taken the KV all the same (a call Serve assigned just as it
    was cancelled runs to its end: the 2x soak lost the KV of every hop given up, hundreds
    prefilled again). The second take gets the same references, also over an empty entry that hop
    put back (it made tokens nobody received); after `taken_keep_s` the key is gone."""
    clock = Clock()
    d = KVDirectory(ttl_s=60.0, clock=clock, taken_keep_s=30.0)

    async def go():
        await d.put("k", ["ref"])
        first = await d.take("k", 1.0)
        clock.t = 5.0
        second = await d.take("k", 0.01)
        await d.give_back("k", [])  # the hop given up on ran and made tokens: gives back nothing
        third = await d.take("k", 0.01)
        clock.t = 40.0  # 30 s after the last take
        gone = await d.take("k", 0.01)
        await d.put("other", ["x"])
        return first, second, third, gone, await d.take("never", 0.01), await d.size()

    assert asyncio.run(go()) == (["ref"], ["ref"], ["ref"], [], [], 1)


def test_a_hop_given_up_on_gives_back_without_leaving_an_entry_the_next_hop_took_first():
    """The driver gives hop A up and sends the hand-off to hop B at once: B's take may come before
    A's cancellation gives the KV back (both orders happen). Either way B gets the references,
    nothing stays under the key for `ttl_s`, and the give-back renews the taken entry's time
    instead; only past `taken_keep_s` is an entry put back (then taken by the next hop)."""
    clock = Clock()

    async def go(order):
        d = KVDirectory(ttl_s=60.0, clock=clock, taken_keep_s=30.0)
        await d.put("k", ["ref"])
        got = [await d.take("k", 1.0)]  # hop A
        if order == "b first":
            got.append(await d.take("k", 0.01))
            await d.give_back("k", ["ref"])
        else:
            await d.give_back("k", ["ref"])
            got.append(await d.take("k", 0.01))
        return got, await d.size(), await d.num_puts(), await d.num_given_back()

    for order in ("b first", "give-back first"):
        clock.t = 0.0
        assert asyncio.run(go(order)) == ([["ref"], ["ref"]], 0, 1, 1), order

    async def renewed():
        d = KVDirectory(ttl_s=60.0, clock=clock, taken_keep_s=30.0)
        clock.t = 0.0
        await d.put("k", ["ref"])
        await d.take("k", 1.0)
        clock.t = 25.0
        await d.give_back("k", [])  # renews the taken entry from t=25
        clock.t = 50.0
        kept = await d.take("k", 0.01)
        clock.t = 100.0  # the taken entry gone: a give-back now leaves an entry, the next take gets it
        await d.give_back("k", ["ref"])
        return kept, await d.size(), await d.take("k", 0.01), await d.size()

    assert asyncio.run(renewed()) == (["ref"], 1, ["ref"], 0)
