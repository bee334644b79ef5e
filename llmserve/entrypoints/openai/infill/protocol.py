"""Protocol of llama-server's native generation routes: ``POST /infill`` (fill-in-the-middle)
and ``POST /completion`` (a plain completion of ``prompt``; ``/completions`` too).

The request: ``input_prefix`` and ``input_suffix`` (a string, or a list of strings and
token ids), ``input_extra`` (repo-level context: ``[{"filename", "text"}]``), ``prompt``
(text added after the prefix, before the middle), and llama-server's sampling fields
(``n_predict``, ``temperature`` (greedy at 0 or below), ``top_k``, ``top_p``, ``min_p``, ``repeat_penalty``,
``presence_penalty``, ``frequency_penalty``, ``seed``, ``stop`` (a word or a list), ``ignore_eos``,
``stream``, ``return_tokens``; ``json_schema`` or ``grammar``, a GBNF grammar, constrain
the answer through structured outputs; ``n_probs`` asks for each generated token's
probability and its ``n_probs`` likeliest alternatives, ``post_sampling_probs`` writes
them as probabilities instead of logprobs; ``logit_bias`` in llama-server's forms, ``false``
banning a token). ``/completion`` takes the same sampling fields and
``prompt``: a string, token ids, strings and token ids mixed (one prompt), or a list of
such prompts (an answer per prompt, in a list; streamed events carry ``index``).
llama-server's per-slot and cache fields (``id_slot``, ``cache_prompt``,
``t_max_predict_ms``, ``samplers``...) are ignored with a warning, as every unknown field (the server's one policy, README "Request fields"). The response is
llama-server's non-OpenAI completion object (``content``, ``stop``, ``tokens_predicted``,
``tokens_evaluated``, ``stop_type``...); a stream is ``data: {...}`` events of the same
shape with ``stop: false`` until the last. With ``n_probs``, an answer (and each event, for
its own tokens) carries ``completion_probabilities``: per generated token its ``id``,
``token``, ``bytes``, ``logprob`` and ``top_logprobs`` (``prob`` and ``top_probs`` with
``post_sampling_probs``). The numbers are the engine's logprobs, the model's distribution
before the sampling chain (temperature, top-k...): llama-server's ``n_probs`` numbers, not
its ``post_sampling_probs`` ones, which no engine output holds.
"""
from __future__ import annotations

from typing import Annotated, Any, Callable, Optional, Union

from pydantic import Field, model_serializer

from llmserve.entrypoints.openai.common.limits import MAX_PROMPT_TOKEN_IDS, MAX_PROMPTS_PER_REQUEST, \
    MAX_STOP_STRING_CHARS, MAX_STOP_STRINGS
from llmserve.entrypoints.openai.common.protocol import MAX_LOGPROBS, MAX_TEMPERATURE, Int64, JSONFloat, OpenAIBaseModel, \
    OpenAIRequestModel, OpenAIRequestPart
from llmserve.entrypoints.openai.infill.fim import FIM_EXTRA_FILE_NAME
from llmserve.sampling_params import RequestOutputKind, SamplingParams, SamplingParamsError, StructuredOutputsParams
from llmserve.entrypoints.chat_utils import json_type_name
from llmserve.tokenizer import check_encodable

MAX_EXTRA_CHUNKS = 1024
MixedList = Annotated[list[Union[Int64, str]], Field(max_length=MAX_PROMPT_TOKEN_IDS)]
MixedInput = Union[str, MixedList]
# llama-server's sampling defaults (``common_params_sampling``), for fields a request and
# the model's generation config both leave out
LLAMA_CPP_DEFAULTS = {"temperature": 0.8, "top_k": 40, "top_p": 0.95, "min_p": 0.05, "repetition_penalty": 1.0}


class ExtraChunk(OpenAIRequestPart):
    """One ``input_extra`` chunk: a file of the repository (``filename`` defaults to
    llama-server's ``tmp``)."""

    text: str
    filename: str = FIM_EXTRA_FILE_NAME


class LlamaSamplingRequest(OpenAIRequestModel):
    """llama-server's sampling fields, shared by ``/infill`` and ``/completion``."""

    model: Optional[str] = None
    n_predict: Optional[Int64] = None  # -1: no limit but the context (llama-server)
    max_completion_tokens: Optional[Int64] = None  # llama-server's aliases of n_predict (it wins)
    max_tokens: Optional[Int64] = None
    temperature: Optional[JSONFloat] = None
    top_k: Optional[Int64] = None
    top_p: Optional[JSONFloat] = None
    min_p: Optional[JSONFloat] = None
    repeat_penalty: Optional[JSONFloat] = None
    presence_penalty: Optional[JSONFloat] = None
    frequency_penalty: Optional[JSONFloat] = None
    seed: Optional[Int64] = None
    # a string is one stop word (llama-server)
    stop: Optional[Union[Annotated[str, Field(max_length=MAX_STOP_STRING_CHARS)],
                         Annotated[list[Annotated[str, Field(max_length=MAX_STOP_STRING_CHARS)]],
                                   Field(max_length=MAX_STOP_STRINGS)]]] = None
    ignore_eos: bool = False
    stream: bool = False
    return_tokens: bool = False
    json_schema: Optional[dict[str, Any]] = None  # the answer follows it (structured outputs)
    grammar: Optional[str] = None  # a GBNF grammar the answer follows
    n_probs: Optional[Int64] = None  # > 0: each generated token's top n_probs alternatives
    post_sampling_probs: bool = False  # completion_probabilities as probabilities (prob, top_probs)
    # [[token id or text, bias or false], ...] or {"token id or text": bias or false}
    logit_bias: Optional[Any] = None  # its shape is checked by parse_logit_bias

    def budget(self) -> tuple[Optional[int], str]:
        """The output budget and the field it came from: ``n_predict``, else its aliases
        ``max_completion_tokens``, then ``max_tokens``, in llama-server's order (None when
        none is set)."""
        for name in ("n_predict", "max_completion_tokens", "max_tokens"):
            value = getattr(self, name)
            if value is not None:
                return value, name
        return None, "n_predict"

    def structured_outputs(self) -> Optional[StructuredOutputsParams]:
        """``json_schema`` or ``grammar`` as a constraint (None without either). Raises
        SamplingParamsError naming ``grammar`` when both are given, as llama-server refuses."""
        if self.json_schema is not None and self.grammar:
            raise SamplingParamsError("Either `json_schema` or `grammar` can be given, not both.", "grammar")
        if self.json_schema is not None:
            return StructuredOutputsParams(json=self.json_schema)
        if self.grammar:
            return StructuredOutputsParams(grammar=self.grammar)
        return None

    def to_sampling_params(self, defaults: dict[str, Any], stop_token_ids: list[int],
                           encode: Optional[Callable[[str], list[int]]] = None) -> SamplingParams:
        """SamplingParams of the request: a field left out takes the model's generation
        config default, else llama-server's. ``n_predict`` -1 or absent leaves the budget to
        the room in the context. ``encode`` tokenizes ``logit_bias``'s text keys (without
        special tokens). Raises SamplingParamsError naming the field."""
        if self.temperature is not None and self.temperature > MAX_TEMPERATURE:
            raise SamplingParamsError(f"temperature must be at most {MAX_TEMPERATURE}, got {self.temperature}.",
                                      "temperature")
        budget, budget_name = self.budget()
        if budget is not None and budget < -1:
            raise SamplingParamsError(f"{budget_name} must be -1 (no limit) or at least 0, got {budget}.",
                                      budget_name)
        if self.n_probs is not None and not 0 <= self.n_probs <= MAX_LOGPROBS:
            raise SamplingParamsError(f"n_probs must be between 0 and {MAX_LOGPROBS}, got {self.n_probs}.", "n_probs")

        def pick(name: str, value: Any) -> Any:
            return value if value is not None else defaults.get(name, LLAMA_CPP_DEFAULTS[name])

        bias, banned = parse_logit_bias(self.logit_bias, encode)
        params = SamplingParams(
            max_tokens=None if budget in (None, -1) else budget,
            # llama-server samples greedily at a temperature of 0 or below
            temperature=max(pick("temperature", self.temperature), 0.0), top_k=pick("top_k", self.top_k),
            top_p=pick("top_p", self.top_p), min_p=pick("min_p", self.min_p),
            repetition_penalty=pick("repetition_penalty", self.repeat_penalty),
            presence_penalty=self.presence_penalty or 0.0, frequency_penalty=self.frequency_penalty or 0.0,
            seed=self.seed, stop=[self.stop] if isinstance(self.stop, str) else self.stop, stop_token_ids=stop_token_ids, ignore_eos=self.ignore_eos,
            structured_outputs=self.structured_outputs(), logprobs=self.n_probs or None,
            output_kind=RequestOutputKind.DELTA if self.stream else RequestOutputKind.FINAL_ONLY,
            logit_bias=bias or None)
        if banned:  # one-token bad words: never sampled (-inf), unlike a clamped -100 bias
            params.bad_words_token_ids = [[t] for t in banned]
        return params


def parse_logit_bias(value: Any, encode: Optional[Callable[[str], list[int]]],
                     ) -> tuple[dict[int, float], list[int]]:
    """llama-server's ``logit_bias``: ``[[key, bias], ...]`` or ``{key: bias}``, where a
    key is a token id (an integer, or an integer string in the object form) or a text whose
    every token gets the bias, and a bias is a number or ``false`` (never sampled). Returns
    the numeric biases by token id (the engine clamps them to [-100, 100]) and the banned
    ids. Raises SamplingParamsError naming ``logit_bias`` for another shape or type."""
    if value is None:
        return {}, []
    if isinstance(value, dict):
        pairs = list(value.items())
    elif isinstance(value, list):
        if any(not isinstance(p, list) or len(p) != 2 for p in value):
            raise SamplingParamsError("logit_bias: a list holds [token, bias] pairs.", "logit_bias")
        pairs = [(p[0], p[1]) for p in value]
    else:
        raise SamplingParamsError("logit_bias must be a list of [token, bias] pairs or an object mapping a token "
                                  "to its bias.", "logit_bias")
    bias: dict[int, float] = {}
    banned: list[int] = []
    for i, (key, b) in enumerate(pairs):
        if b is not False and (isinstance(b, bool) or not isinstance(b, (int, float))):
            raise SamplingParamsError(f"logit_bias: bias {i} must be a number or false, not {json_type_name(b)}.",
                                      "logit_bias")
        if isinstance(key, str) and key.lstrip("-").isdigit():
            key = int(key)
        if isinstance(key, bool) or not isinstance(key, (int, str)):
            raise SamplingParamsError(f"logit_bias: token {i} must be a token id or a text, not "
                                      f"{json_type_name(key)}.", "logit_bias")
        if isinstance(key, str):
            if encode is None:
                raise SamplingParamsError("logit_bias: text keys are not supported here.", "logit_bias")
            check_encodable(key, "logit_bias")
            ids = encode(key)
        else:
            ids = [key]
        for t in ids:  # a ban also biases -100, so the engine checks the id against the vocabulary
            bias[t] = -100.0 if b is False else float(b)
            if b is False:
                banned.append(t)
    return bias, banned


def llama_settings(params: SamplingParams) -> dict[str, Any]:
    """``params`` under llama-server's sampling names (its ``generation_settings`` and
    ``/slots`` ``params``): ``n_predict``/``max_tokens`` and ``seed`` -1 when unset."""
    budget = -1 if params.max_tokens is None else params.max_tokens
    return {"n_predict": budget, "seed": -1 if params.seed is None else params.seed,
            "temperature": params.temperature, "top_k": params.top_k, "top_p": params.top_p, "min_p": params.min_p,
            "repeat_penalty": params.repetition_penalty, "presence_penalty": params.presence_penalty,
            "frequency_penalty": params.frequency_penalty, "stop": list(params.stop or []), "max_tokens": budget,
            "ignore_eos": params.ignore_eos, "n_probs": params.logprobs or 0}


class InfillRequest(LlamaSamplingRequest):
    """``POST /infill`` (see the module docstring)."""

    input_prefix: MixedInput = ""
    input_suffix: MixedInput = ""
    input_extra: Annotated[list[ExtraChunk], Field(max_length=MAX_EXTRA_CHUNKS)] = []
    prompt: str = ""

    def extra_chunks(self) -> list[tuple[str, str]]:
        """``input_extra`` as (filename, text) pairs."""
        return [(c.filename, c.text) for c in self.input_extra]


class LlamaCompletionRequest(LlamaSamplingRequest):
    """``POST /completion`` (see the module docstring): ``prompt`` is required."""

    prompt: Union[str, Annotated[list[Union[Int64, str, MixedList]], Field(max_length=MAX_PROMPT_TOKEN_IDS)]]

    def prompts(self) -> list[Union[str, list[Union[int, str]]]]:
        """The prompts, as llama-server reads ``prompt``: a string, a list of token ids, or
        a list mixing strings and token ids is one prompt; any other list is one prompt per
        item. Raises SamplingParamsError naming ``prompt`` for an empty list, too many
        prompts, or bare token ids beside lists."""
        value = self.prompt
        if isinstance(value, str):
            return [value]
        if not value:
            raise SamplingParamsError("prompt: must not be empty.", "prompt")
        if not any(isinstance(p, int) for p in value):  # strings and lists: one prompt each
            if len(value) > MAX_PROMPTS_PER_REQUEST:
                raise SamplingParamsError(f"prompt: at most {MAX_PROMPTS_PER_REQUEST} prompts per request, "
                                          f"got {len(value)}.", "prompt")
            return list(value)
        if any(isinstance(p, list) for p in value):
            raise SamplingParamsError("prompt: a list of prompts holds strings and lists of token ids, "
                                      "not bare token ids beside lists.", "prompt")
        return [list(value)]  # token ids, or token ids and strings: one prompt


class InfillResponse(OpenAIBaseModel):
    """llama-server's completion object (the fields a client of ``/infill`` or
    ``/completion`` reads)."""

    index: int = 0
    content: str
    tokens: list[int] = Field(default_factory=list)
    id_slot: int = 0
    stop: bool
    model: str
    tokens_predicted: int
    tokens_evaluated: int
    tokens_cached: int = 0
    prompt: Optional[str] = None
    truncated: bool = False
    stop_type: Optional[str] = None  # "eos", "limit" or "word" (set on the last)
    stopping_word: str = ""
    timings: Optional[dict[str, Any]] = None  # llama.cpp's timings (on the last; request_metrics.py)
    completion_probabilities: Optional[list[dict[str, Any]]] = None  # with n_probs: one entry per token
    generation_settings: Optional[dict[str, Any]] = None  # the settings it ran with (on the last)

    @model_serializer(mode="wrap")
    def _leave_out_unset(self, handler: Any) -> dict[str, Any]:
        """Leave ``completion_probabilities`` and ``generation_settings`` out when unset, as
        llama-server writes them only when they apply."""
        data = handler(self)
        for key in ("completion_probabilities", "generation_settings"):
            if data.get(key, 0) is None:
                del data[key]
        return data
