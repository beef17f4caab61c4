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
