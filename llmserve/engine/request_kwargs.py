"""vLLM keyword arguments the engine-client entry points accept but cannot honour yet.

``AsyncLLM.generate/add_request/encode`` and ``LLMEngine.add_request`` take exactly vLLM's
keyword arguments (plus llmserve's own ``tenant=``): any other name is Python's
TypeError, and a vLLM argument this engine has no behaviour for is refused here when
it is given a value, never dropped in silence (issue 28: a ``lora_request`` used to be
swallowed by a catch-all ``**kwargs`` and the request ran on the base model).
"""
from __future__ import annotations

from typing import Any


def refuse_unhonoured(method: str, **values: Any) -> None:
    """Raise NotImplementedError (the server's 400) naming the first argument given a
    value (not None, not empty) in ``values``: vLLM arguments ``method`` cannot honour."""
    for name, value in values.items():
        if value is not None and value != {} and value != "":
            raise NotImplementedError(f"{method}() does not support {name}= on this engine (got {value!r}); "
                                      "leave it unset.")
