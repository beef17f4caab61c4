"""The KV directory's bookkeeping, plain asyncio (the pools run it as a Ray actor)."""
import asyncio

from keyacc_ray.serve.kv_directory import KVDirectory


class Clock:
    t = 0.0

    def __call__(self):
        return self.t


def test_put_then_take_once():
    d = KVDirectory()

    async def go():
        await d.put("a", ["ref-a"])
        return await d.take("a", 1.0), await d.take("a", 0.01), await d.size()

    assert asyncio.run(go()) == (["ref-a"], [], 0)


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


def test_a_take_whose_waiter_gives_up_hands_what_it_took_back_for_the_next_hop():
    """A driver cancels a hop its replica had not taken in time while the replica's take was on
    its way to the directory: the take still removes the entry there, so what it returns goes
    back under the key, where the driver's next hop takes it (the 2x soak lost every such KV: 617
    hops prefilled again). Also when the waiter's own time is up; nothing is handed back when the
    waiter gets its answer, or when the take fails."""
    from keyacc_ray.serve.aio import take_or_hand_back

    d = KVDirectory()

    def slow_take(key, delay):
        """A Ray actor call's future: cancelling it does not stop the call in the actor."""
        async def call():
            await asyncio.sleep(delay)
            return await d.take(key, 1.0)

        fut = asyncio.get_running_loop().create_future()
        asyncio.ensure_future(call()).add_done_callback(lambda t: fut.done() or fut.set_result(t.result()))
        return fut

    async def go():
        loop = asyncio.get_running_loop()
        back = lambda got, key: got and loop.create_task(d.put(key, got))  # noqa: E731
        await d.put("kv", ["ref"])
        # cancelled before its take reached the directory
        waiter = asyncio.create_task(take_or_hand_back(slow_take("kv", 0.05), 5.0,
                                                       lambda got: back(got, "kv")))
        await asyncio.sleep(0.01)
        waiter.cancel()
        try:
            await waiter
        except asyncio.CancelledError:
            pass
        await asyncio.sleep(0.1)  # (the take reached the directory first)
        cancelled_case = await d.take("kv", 1.0)  # the next hop
        # the waiter's time runs out first
        await d.put("kv2", ["ref2"])
        try:
            await take_or_hand_back(slow_take("kv2", 0.05), 0.01, lambda got: back(got, "kv2"))
        except asyncio.TimeoutError:
            pass
        await asyncio.sleep(0.1)
        timeout_case = await d.take("kv2", 1.0)
        # answered: kept by the waiter, nothing put back
        await d.put("kv3", ["ref3"])
        handed = []
        got = await take_or_hand_back(slow_take("kv3", 0.0), 1.0, handed.append)
        await asyncio.sleep(0.02)
        return cancelled_case, timeout_case, got, handed, await d.size()

    assert asyncio.run(go()) == (["ref"], ["ref2"], ["ref3"], [], 0)


def test_a_failed_take_hands_nothing_back():
    from keyacc_ray.serve.aio import take_or_hand_back

    async def failing():
        await asyncio.sleep(0.02)
        raise RuntimeError("directory gone")

    async def go():
        handed = []
        waiter = asyncio.create_task(take_or_hand_back(asyncio.ensure_future(failing()), 5.0, handed.append))
        await asyncio.sleep(0.005)
        waiter.cancel()
        try:
            await waiter
        except asyncio.CancelledError:
            pass
        await asyncio.sleep(0.05)
        return handed

    assert asyncio.run(go()) == []
