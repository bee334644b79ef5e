"""Errors raised by the engine front-end (vLLM's names)."""


class EngineGenerateError(Exception):
    """A request failed inside the engine; the engine itself is still healthy."""


class EngineInitError(RuntimeError):
    """The EngineCore never became ready: its model failed to load (no weights, an
    unsupported architecture or tensor type, a corrupt file), it ran out of memory, its
    process died or it did not answer within the start-up timeout. The message is the
    engine's own error in one line (vLLM raises RuntimeError("Engine core initialization
    failed ...") here). ``llmserve serve`` prints it as one line and exits 1. A start
    after a level-2 sleep that fails is EngineStartError instead (503, retried)."""


class EngineDeadError(Exception):
    """The EngineCore process died or hit an unrecoverable error; every waiting caller
    gets this, and new requests are refused with it."""

    def __init__(self, *args, suppress_context: bool = False, **kwargs):
        msg = "EngineCore encountered an issue. See stack trace (above) for the root cause."
        super().__init__(*(args or (msg,)), **kwargs)
        self.__suppress_context__ = suppress_context


class EngineRestartedError(EngineDeadError):
    """The engine was restarted (``--restart-engine-on-failure``) and this request could
    not resume on the new one (e.g. a streaming-input session); the engine is running
    again, so the request may be retried. A 503 on the server."""


class EngineStartError(EngineDeadError):
    """A fresh engine process (after a level-2 sleep ended the last one) failed to start:
    e.g. its model file was moved away. Not final: the next request or ``/wake_up`` tries
    the start again, so the server answers 503 with ``Retry-After`` (``retry_after``,
    seconds) and ``/health`` and ``/ready`` answer 503 until a start succeeds."""

    retry_after = 10  # seconds: about one engine start of a small model, plus margin
