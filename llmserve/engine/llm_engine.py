"""LLMEngine: the synchronous engine front-end used by ``LLM`` (vLLM's v1 LLMEngine):
InputProcessor -> EngineCoreClient (in-process or a child process) -> OutputProcessor.
"""
from __future__ import annotations

import logging
import os
import time
from typing import Optional

from llmserve.config import EngineConfig
from llmserve.engine.core_client import InprocClient, SyncMPClient
from llmserve.engine.input_processor import InputProcessor, PromptType
from llmserve.engine.output_processor import OutputProcessor
from llmserve.engine.parallel_sampling import ParentRequest
from llmserve.engine_args import EngineArgs, UsageContext
from llmserve.outputs import RequestOutput
from llmserve.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


def multiprocessing_enabled() -> bool:
    """``LLMSERVE_ENABLE_MULTIPROCESSING`` (default 1): run the EngineCore in a child process."""
    return os.environ.get("LLMSERVE_ENABLE_MULTIPROCESSING", "1") not in ("0", "false", "False")


def load_frontend(config: EngineConfig):
    """Tokenizer and generation-config defaults of the model."""
    from llmserve.model_loader import load_generation_config, resolve_model
    from llmserve.tokenizer import get_tokenizer

    mc = config.model_config
    if mc.tokenizer in (None, mc.model_path):
        tok = get_tokenizer(mc.model_path, mc.gguf_file, mc.chat_template)
    else:  # --tokenizer names another model or directory
        tok = get_tokenizer(mc.tokenizer, None, mc.chat_template)
    gen = {}
    if mc.generation_config == "auto":
        try:
            gen = load_generation_config(resolve_model(mc.model)) or {}
        except Exception as e:  # a broken generation_config.json must not stop the engine
            logger.warning("Could not read the generation config: %s", e)
    return tok, gen


class LLMEngine:
    """Synchronous engine. Raises ValueError from add_request on bad input."""

    def __init__(self, config: EngineConfig, multiprocess_mode: Optional[bool] = None) -> None:
        self.config = config
        self.model_config = config.model_config
        if multiprocess_mode is None:
            multiprocess_mode = multiprocessing_enabled()
        if multiprocess_mode:
            # The engine process loads the model while we load the tokenizer.
            self.engine_core = SyncMPClient(config, wait_ready=False)
            try:
                self.tokenizer, self.generation_config = load_frontend(config)
            except BaseException:
                self.engine_core.shutdown()
                raise
            self.engine_core.wait_until_ready()
        else:
            self.tokenizer, self.generation_config = load_frontend(config)
            self.engine_core = InprocClient(config)
        self.input_processor = InputProcessor(self.model_config, self.tokenizer, self.generation_config)
        self.output_processor = OutputProcessor(self.tokenizer, log_stats=False)

    @classmethod
    def from_engine_args(cls, engine_args: EngineArgs, multiprocess_mode: Optional[bool] = None,
                         usage_context: UsageContext = UsageContext.ENGINE_CONTEXT) -> "LLMEngine":
        return cls(engine_args.create_engine_config(usage_context), multiprocess_mode)

    def get_tokenizer(self):
        return self.tokenizer

    def add_request(self, request_id: str, prompt: PromptType, params: SamplingParams,
                    arrival_time: Optional[float] = None, priority: int = 0) -> None:
        arrival_time = arrival_time or time.time()
        if params.n == 1:
            req, text = self.input_processor.process_inputs(request_id, prompt, params, arrival_time, priority)
            self.output_processor.add_request(request_id, text, req.prompt_token_ids, req.sampling_params,
                                              arrival_time)
            self.engine_core.add_request(req)
            return
        parent = ParentRequest(request_id, params)
        reqs = [self.input_processor.process_inputs(cid, prompt, parent.child_params(i), arrival_time, priority)
                for i, cid in enumerate(parent.child_ids)]
        for req, text in reqs:
            self.output_processor.add_request(req.request_id, text, req.prompt_token_ids, req.sampling_params,
                                              arrival_time, parent=parent)
            self.engine_core.add_request(req)

    def abort_request(self, request_ids: list[str]) -> None:
        ids = self.output_processor.abort_requests(list(request_ids))
        self.engine_core.abort_requests(ids)

    def step(self) -> list[RequestOutput]:
        outs = self.engine_core.get_output()
        processed = self.output_processor.process_outputs(outs.outputs)
        if processed.reqs_to_abort:
            self.engine_core.abort_requests(processed.reqs_to_abort)
        return processed.request_outputs

    def has_unfinished_requests(self) -> bool:
        return self.output_processor.has_unfinished_requests()

    def get_num_unfinished_requests(self) -> int:
        return self.output_processor.get_num_unfinished_requests()

    def reset_prefix_cache(self) -> bool:
        return self.engine_core.reset_prefix_cache()

    def get_stats(self) -> dict:
        return self.engine_core.get_stats()

    def shutdown(self) -> None:
        self.engine_core.shutdown()
