"""`wait_at_most`: await something for at most a time, without losing a cancellation.

Python 3.11's `asyncio.wait_for` returns the result when a cancellation meets the awaited thing
finishing in the same turn of the loop: the caller's cancellation is lost (a driver whose client
went away would go on with the request). `asyncio.timeout` (3.11+, what 3.12's wait_for is built
on) raises the CancelledError. 3.10 has only wait_for.
"""
from __future__ import annotations

import asyncio
from typing import Awaitable, TypeVar

T = TypeVar("T")


async def wait_at_most(aw: Awaitable[T], timeout_s: float) -> T:
    """`await aw`, raising TimeoutError (asyncio.TimeoutError) after `timeout_s`."""
    if hasattr(asyncio, "timeout"):
        async with asyncio.timeout(timeout_s):
            return await aw
    return await asyncio.wait_for(aw, timeout_s)  # Python 3.10
