"""The engine process's environment: pooling models get OMP_WAIT_POLICY=PASSIVE (spinning
OpenMP workers halved embedding throughput on a busy 2-core machine), unless the user
chose a policy; generating models keep the default."""
from types import SimpleNamespace

from llmserve.engine.core_process import engine_env


def _config(runner: str) -> SimpleNamespace:
    return SimpleNamespace(model_config=SimpleNamespace(runner=runner))


def test_pooling_engine_waits_passively():
    env = engine_env(_config("pooling"), {"PATH": "/bin"})
    assert env == {"PATH": "/bin", "OMP_WAIT_POLICY": "PASSIVE"}


def test_generating_engine_and_user_policy_untouched():
    assert engine_env(_config("generate"), {"PATH": "/bin"}) == {"PATH": "/bin"}
    assert engine_env(_config("pooling"), {"OMP_WAIT_POLICY": "ACTIVE"}) == {"OMP_WAIT_POLICY": "ACTIVE"}
