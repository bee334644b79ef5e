"""Fixtures shared by the engine tests."""
import asyncio

import pytest


@pytest.fixture(scope="module")
def loop():
    """One event loop per module: the module's AsyncLLM is built outside any loop and then
    driven with ``loop.run_until_complete``."""
    lp = asyncio.new_event_loop()
    yield lp
    lp.close()
