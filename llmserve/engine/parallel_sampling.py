"""n > 1: one user request fanned out into n child requests (vLLM's ParentRequest)."""
from __future__ import annotations

from llmserve.outputs import CompletionOutput
from llmserve.sampling_params import RequestOutputKind, SamplingParams


class ParentRequest:
    """Holds the n children of a request and merges their outputs.

    Child i has request id ``f"{i}_{request_id}"`` and n=1; with a seed, child i uses
    seed + i so the n completions differ but each is reproducible.
    """

    def __init__(self, request_id: str, params: SamplingParams) -> None:
        self.request_id = request_id
        self.params = params
        self.n = params.n
        self.child_ids = [f"{i}_{request_id}" for i in range(self.n)]
        self.child_index = {cid: i for i, cid in enumerate(self.child_ids)}
        self.finished: set[str] = set()
        self.latest: dict[int, CompletionOutput] = {}

    def child_params(self, i: int) -> SamplingParams:
        p = self.params.clone()
        p.n = 1
        if p.seed is not None:
            p.seed = p.seed + i
        return p

    def get_outputs(self, child_id: str, output: CompletionOutput) -> tuple[list[CompletionOutput], bool]:
        """Record a child's output; returns (outputs to send now, all children finished)."""
        idx = self.child_index[child_id]
        output.index = idx
        if output.finished():
            self.finished.add(child_id)
        done = len(self.finished) == self.n
        if self.params.output_kind == RequestOutputKind.FINAL_ONLY:
            self.latest[idx] = output
            if not done:
                return [], False
            return [self.latest[i] for i in sorted(self.latest)], True
        return [output], done
