"""End-to-end fixtures (helpers in e2e_utils.py).

``server``: one per session: the default model in float32 (greedy outputs are then
batch-invariant), default settings plus an API key, so every test also goes through the
auth middleware. ``server_512``: ``--max-model-len 512`` in the default dtype with a KV
cache too small for 8 full-length sequences (cases C12/C13), one per module that uses it.
"""
import pytest

from e2e_utils import RemoteServer


@pytest.fixture(scope="session")
def server():
    srv = RemoteServer(["--dtype", "float32", "--kv-cache-memory", "256MiB"])
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def server_512():
    # 512-token context; 240 usable blocks of 16 tokens = 3840 tokens of KV: 8 full-length
    # sequences (8 x 32 blocks) cannot fit at once, 7 can.
    # Default dtype (bfloat16 on this CPU): these cases check lengths and statuses, not
    # batch-invariant text, and bfloat16 decodes about twice as fast.
    srv = RemoteServer(["--max-model-len", "512", "--num-gpu-blocks-override", "241",
                        "--max-num-batched-tokens", "512", "--timeout-graceful-shutdown", "3"])
    yield srv
    srv.stop()
