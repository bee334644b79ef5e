"""Issue 26 point 7: a request aborted while it waits (its client gone) is dropped before
the scheduler prefills it: in the scheduler's waiting queue (behind a full batch, or
preempted), in the engine process's input queue (ADD and ABORT both there before the
next step), and in AsyncLLM while add_request is still sending (the caller cancelled)."""
import asyncio
import queue

from llmserve.core.request import Request, RequestStatus
from llmserve.engine.core import EngineCoreProc
from llmserve.engine.messages import EngineCoreRequestType
from llmserve.sampling_params import SamplingParams
from tests.core.sched_utils import make_scheduler, run_step


def _req(rid, n=8, max_tokens=6):
    return Request(rid, list(range(1, n + 1)), SamplingParams(max_tokens=max_tokens), eos_token_id=0)


def test_scheduler_never_prefills_a_request_aborted_while_waiting():
    s = make_scheduler(max_seqs=1)
    for rid in ("a", "b", "c"):
        s.add_request(_req(rid))
    scheduled = []
    so, _ = run_step(s)
    scheduled += [x.request.request_id for x in so.scheduled]
    s.finish_requests(["b"], RequestStatus.FINISHED_ABORTED)  # queued behind the full batch
    while s.has_unfinished_requests():
        so, _ = run_step(s)
        scheduled += [x.request.request_id for x in so.scheduled]
    assert "b" not in scheduled and {"a", "c"} <= set(scheduled)
    assert s.kv_cache_manager.num_used_blocks == 0


class _Core:
    """EngineCore's surface that run_busy_loop uses, over a real Scheduler and a fake runner."""

    def __init__(self, proc):
        self.scheduler, self.proc, self.prefilled = make_scheduler(), proc, []
        self.model_runner = type("Runner", (), {"prefault_kv": staticmethod(lambda: False)})()
        self.lora_registry = None  # no --enable-lora: requests go straight to the scheduler

    def add_request(self, req):
        self.scheduler.add_request(req)

    def abort_requests(self, ids):
        self.scheduler.finish_requests(ids, RequestStatus.FINISHED_ABORTED)

    def has_work(self):
        return self.scheduler.has_unfinished_requests()

    def step(self):
        so, outs = run_step(self.scheduler)
        self.prefilled += [x.request.request_id for x in so.scheduled if x.num_computed_tokens == 0]
        if not self.has_work():
            self.proc.input_queue.put((EngineCoreRequestType.SHUTDOWN, None))
        return type("Outs", (), {"outputs": outs})()


def test_engine_loop_drops_an_abort_queued_behind_its_add():
    proc = EngineCoreProc.__new__(EngineCoreProc)  # the loop alone: no model, no sockets
    proc.input_queue, proc.output_queue = queue.Queue(), queue.Queue()
    proc._router, proc._stats_stale, proc._pooling, proc._prefault_logged = None, False, False, True
    proc.core = _Core(proc)
    # both clients' ADDs arrive, then one client's disconnect, before the engine steps
    for item in ((EngineCoreRequestType.ADD, _req("kept")), (EngineCoreRequestType.ADD, _req("gone")),
                 (EngineCoreRequestType.ABORT, ["gone"])):
        proc.input_queue.put(item)
    proc.run_busy_loop()
    assert proc.core.prefilled == ["kept"]


def test_async_llm_aborts_a_request_cancelled_while_it_is_being_sent():
    from llmserve.engine.async_llm import AsyncLLM

    aborted, sending = [], asyncio.Event()

    class _Slow:
        async def add_request_async(self, req):
            sending.set()
            await asyncio.sleep(60)  # the send is under way when the client goes

    llm = AsyncLLM.__new__(AsyncLLM)

    async def add_request(request_id, prompt, params, **kw):
        await _Slow().add_request_async(None)

    async def abort(request_id, internal=False):
        aborted.append((request_id, internal))

    llm.add_request, llm.abort = add_request, abort

    async def main():
        task = asyncio.ensure_future(llm.generate({"prompt_token_ids": [1, 2]}, SamplingParams(), "r1").__anext__())
        await sending.wait()
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    asyncio.run(main())
    assert aborted == [("r1", True)]
