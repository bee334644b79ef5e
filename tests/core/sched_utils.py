"""Helpers shared by the scheduler tests: a small scheduler and one step with a fake runner."""
from llmserve.config import CacheConfig, SchedulerConfig
from llmserve.core.outputs import ModelRunnerOutput
from llmserve.core.scheduler import Scheduler


def make_scheduler(num_blocks=64, budget=64, max_seqs=8, max_len=256, policy="fcfs", caching=True,
                   chunked=True) -> Scheduler:
    """A Scheduler with 4-token blocks (small numbers keep block arithmetic readable)."""
    return Scheduler(SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=max_seqs, max_model_len=max_len,
                                     enable_chunked_prefill=chunked, policy=policy),
                     CacheConfig(block_size=4, enable_prefix_caching=caching), num_blocks)


def run_step(s: Scheduler, token: int = 7):
    """Schedule once; every request whose prompt is complete "samples" ``token``.
    Returns (SchedulerOutput, engine-core outputs)."""
    so = s.schedule()
    ro = ModelRunnerOutput()
    for x in so.scheduled:
        if x.num_computed_tokens + x.num_scheduled_tokens >= x.request.num_tokens:
            ro.sampled_token_ids[x.request.request_id] = token
    return so, s.update_from_output(so, ro)


def compute_tokens(m, r, upto: int, first: int = 0, held=lambda m, r: m.num_used_blocks) -> list:
    """Compute r's tokens up to ``upto`` on KV manager ``m``: ``first`` of them (0: all)
    in one step if none is computed yet, then one a step. Returns ``held(m, r)`` (default:
    the blocks in use) after each step."""
    out = []
    while r.num_computed_tokens < upto:
        n = (first or upto) if r.num_computed_tokens == 0 else 1
        n = min(n, upto - r.num_computed_tokens)
        assert m.allocate_slots(r, n) is not None
        r.num_computed_tokens += n
        m.cache_blocks(r, r.num_computed_tokens)
        out.append(held(m, r))
    return out
