"""Issue 18, small version of ``llmserve.benchmarks.seed_repro``: seeded requests (3 prompts, n=2, 20 tokens,
top-p 0.9) give identical text for every choice alone, all at once, with a warm prefix
cache, under forced preemption (8 KV blocks) and with 32 tokens per step, in float32 and
bfloat16."""
import argparse

import pytest

from llmserve.benchmarks import seed_repro


# A `make test-all` run in both dtypes (the bench starts five engines, ~28 s each on 2 cores):
# in make test, tests/engine/test_llm_correctness.py checks seeded sampling alone and in a batch
# and greedy under chunked prefill and preemption, tests/models/test_batch_invariant_linear.py
# float32 rows.
@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_seeded_text_is_the_same_whatever_the_scheduler_did(dtype):
    parser = argparse.ArgumentParser()
    seed_repro.add_cli_args(parser)
    args = parser.parse_args(["--dtype", dtype, "--num-prompts", "3", "--n", "2", "--output-len", "20",
                              "--kv-cache-memory", "64MiB", "--preempt-blocks", "8"])
    result = seed_repro.run_scenarios(args)
    scenarios = {k: v["mismatches"] for k, v in result.items() if isinstance(v, dict)}
    assert scenarios == {"alone": 0, "all_at_once": 0, "warm_prefix_cache": 0, "forced_preemption": 0,
                         "max_num_batched_tokens_32": 0}
