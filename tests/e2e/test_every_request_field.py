"""Every field of the chat and completions request models either changes the response
or is rejected with a 4xx (issue 10: "a field the server accepts must take effect or be
a 400"). The fields are enumerated from the pydantic models, so a field added later
fails this test until it gets a case here."""
from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Union

import pytest

from e2e_utils import MODEL
from llmserve.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
from llmserve.entrypoints.openai.completion.protocol import CompletionRequest

EOS = "2"  # SmolLM2's <|im_end|>
SAMPLED = {"temperature": 1.5, "seed": 1}
FORCE_EOS = {"logit_bias": {EOS: 100}}  # the first token is EOS: an empty answer
TO_CONTINUE = {"messages": [{"role": "user", "content": "What is the capital of France?"},
                            {"role": "assistant", "content": "The capital of France is"}],
               "add_generation_prompt": False}
# Fields that cannot change the output, and why (checked where it can be).
NO_EFFECT = {
    "user": "OpenAI: an end-user id for abuse monitoring; it never changes the output",
    "spaces_between_special_tokens": "only slow (Python) tokenizers honour it; SmolLM2's is fast, "
                                     "and vLLM ignores it for fast tokenizers too",
    "add_special_tokens": "SmolLM2's tokenizer adds no special tokens (asserted below)",
    # chat only
    "parallel_tool_calls": "false keeps only the first tool call (the forced schema's maxItems and the parser's "
                           "cap; case C56 in tests/entrypoints/test_tool_calling.py and "
                           "tests/e2e/test_tool_calling_e2e.py); this test's requests call no tools",
    "include_reasoning": "only with --reasoning-parser, which SmolLM2 cannot use (no think tokens); "
                         "tests/entrypoints/test_tool_calling.py",
    "length_penalty": "ranks beams that end at different lengths (use_beam_search): this test's 8-token "
                      "answers end together; tests/engine/test_beam_search.py checks it against transformers",
    "include_metrics": "vLLM's double opt-in: only with --enable-per-request-metrics, which the shared server "
                       "does not set; tests/e2e/test_request_timelines.py checks it on a server with the flag",
    "early_stopping": "decides when a beam search stops once hypotheses ended (use_beam_search); "
                      "tests/engine/test_beam_search.py checks True/False/\"never\" against transformers",
    # OpenAI's service fields (chat): validated as OpenAI does (common/service_fields.py,
    # tests/entrypoints/test_openai_service_fields.py), accepted and ignored as vLLM does
    "metadata": "OpenAI: tags for stored completions in its dashboard; nothing is stored here",
    "store": "OpenAI: keeps the completion for its dashboard and evals; nothing is stored here",
    "service_tier": "OpenAI: which of its processing tiers bills and serves the request; one tier here",
    "prompt_cache_key": "OpenAI: a routing hint for its prompt cache; the prefix cache here needs none",
    "prompt_cache_retention": "OpenAI: how long its prompt cache keeps a prefix; the prefix cache here "
                              "keeps blocks until they are needed",
    "safety_identifier": "OpenAI: an end-user id for abuse monitoring (the successor of user)",
    "verbosity": "OpenAI: a hint to its reasoning models about answer length; the template here takes none",
}
CHAT_ONLY_NO_EFFECT = {"parallel_tool_calls", "include_reasoning", "metadata", "store", "service_tier",
                       "prompt_cache_key", "prompt_cache_retention", "safety_identifier", "verbosity"}
# Chat fields whose effect needs a request chat_template, which the shared server refuses
# (no --trust-request-chat-template): each is shown to change the prompt on a server with
# that flag, in tests/e2e/test_request_chat_templates.py.
ON_TRUSTED_SERVER = {"chat_template", "chat_template_kwargs", "reasoning_effort"}
Value = Union[Any, Callable[[dict], Any]]
# field -> (context added to both requests, value of the field in the second); either may
# be a function of the greedy baseline ({"first": its first token id, "text": its text}).
COMMON: dict[str, tuple[Value, Value]] = {
    "model": ({}, "no-such-model"),
    "n": ({}, 2),
    "use_beam_search": ({"n": 2}, True),
    "max_tokens": ({}, 2),
    "temperature": ({"seed": 1}, 1.5),
    "top_p": (SAMPLED, 0.05),
    "top_k": (SAMPLED, 1),
    "min_p": (SAMPLED, 0.9),
    "seed": (SAMPLED, 2),
    "presence_penalty": ({"max_tokens": 16}, -2.0),
    "frequency_penalty": ({"max_tokens": 16}, -2.0),
    "repetition_penalty": ({"max_tokens": 16}, 2.0),
    "logit_bias": ({}, lambda b: {str(b["first"]): -100}),
    "stop": ({}, lambda b: [b["text"][1:3]]),
    "stop_token_ids": ({}, lambda b: [b["first"]]),
    "min_tokens": (FORCE_EOS, 3),
    "ignore_eos": (FORCE_EOS, True),
    "skip_special_tokens": ({**FORCE_EOS, "ignore_eos": True, "max_tokens": 2}, False),
    "include_stop_str_in_output": (lambda b: {"stop": [b["text"][1:3]]}, True),
    "allowed_token_ids": ({}, [1000]),
    "bad_words": ({}, lambda b: [b["text"].split()[0]]),
    "stream": ({}, True),
    "stream_options": ({"stream": True}, {"include_usage": True}),
    "response_format": ({}, {"type": "json_object"}),
    "structured_outputs": ({}, {"choice": ["yes", "no"]}),
    "priority": ({}, 1),
    "prompt_logprobs": ({}, 0),
    "return_token_ids": ({}, True),
    "timings_per_token": ({}, True),  # llama.cpp's timings object on the response
    "truncate_prompt_tokens": ({}, 2),
    "truncation_side": ({"truncate_prompt_tokens": 2}, "right"),
}
COMPLETIONS = {
    **COMMON,
    "return_tokens_as_token_ids": ({"logprobs": 1}, True),
    "prompt": ({}, "Once upon a time"),
    "echo": ({}, True),
    "logprobs": ({}, 1),
    "suffix": ({}, "!"),
    "best_of": ({}, 2),
}
CHAT = {
    **COMMON,
    "return_tokens_as_token_ids": ({"logprobs": True}, True),
    "messages": ({}, [{"role": "user", "content": "Name an animal."}]),
    "logprobs": ({}, True),
    "top_logprobs": ({"logprobs": True}, 2),
    "max_completion_tokens": ({}, 2),
    "tools": ({}, [{"type": "function", "function": {"name": "f", "parameters": {}}}]),
    "tool_choice": ({}, "required"),
    "add_generation_prompt": ({}, False),
    "continue_final_message": (TO_CONTINUE, True),
    "echo": ({**TO_CONTINUE, "continue_final_message": True}, True),
    "audio": ({}, {"voice": "alloy", "format": "wav"}),
    "modalities": ({}, ["text", "audio"]),
    "web_search_options": ({}, {}),
    "functions": ({}, [{"name": "f", "parameters": {}}]),
    "function_call": ({}, {"name": "f"}),
}
ENDPOINTS = {
    "/v1/completions": (CompletionRequest, {"prompt": "The capital of France is"}, COMPLETIONS),
    "/v1/chat/completions": (ChatCompletionRequest, {"messages": [{"role": "user", "content": "Name a colour."}]},
                             CHAT),
}


def _fingerprint(r) -> Any:
    """What a client sees, less what differs on every call (ids, timestamps)."""
    if r.headers.get("content-type", "").startswith("text/event-stream"):
        chunks = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
    else:
        chunks = [r.json()]
    for c in chunks:
        c.pop("id", None)
        c.pop("created", None)
    return chunks


@pytest.mark.parametrize("path", list(ENDPOINTS))
def test_every_field_changes_the_response_or_is_rejected(server, path):
    model, base_body, cases = ENDPOINTS[path]
    fields = set(model.model_fields)
    no_effect = set(NO_EFFECT) - (CHAT_ONLY_NO_EFFECT if path == "/v1/completions" else set())
    no_effect |= ON_TRUSTED_SERVER if path == "/v1/chat/completions" else set()
    assert fields == set(cases) | no_effect, (
        f"fields without a case: {sorted(fields - set(cases) - no_effect)}; "
        f"cases of no field: {sorted(set(cases) - fields)}")
    base = {"model": MODEL, **base_body, "max_tokens": 8, "temperature": 0}
    first = server.post(path, {**base, "return_token_ids": True}).json()["choices"][0]
    text = first.get("text", None) if path == "/v1/completions" else first["message"]["content"]
    info = {"first": first["token_ids"][0], "text": text}
    assert len(text) >= 3 and text.split()
    unchanged = []
    # Many fields share a context: its response (greedy or seeded, float32) is fetched once.
    # All requests go at once: the server batches them, and float32 greedy and seeded
    # outputs do not depend on the batch (tests/engine/test_greedy_batch_invariance.py).
    bodies: dict[str, dict] = {}
    afters: dict[str, tuple[str, dict]] = {}
    for name, (context, value) in sorted(cases.items()):
        value = value(info) if callable(value) else value
        context = context(info) if callable(context) else context
        key = json.dumps(context, sort_keys=True)
        bodies.setdefault(key, {**base, **context})
        afters[name] = (key, {**base, **context, name: value})
    def post(body: dict):  # each waits for the whole batch: the timeout of all requests
        return server.post(path, body, timeout=900)

    with ThreadPoolExecutor(32) as pool:
        befores = {key: pool.submit(post, body) for key, body in bodies.items()}
        responses = {name: pool.submit(post, body) for name, (_, body) in afters.items()}
    for name, (key, _) in afters.items():
        before, after = befores[key].result(), responses[name].result()
        assert before.status_code == 200, (name, before.text)
        assert after.status_code < 500, (name, after.text)
        if after.status_code == 200 and _fingerprint(after) == _fingerprint(before):
            unchanged.append(name)
    assert unchanged == []


def test_the_no_effect_fields_cannot_have_one(smol_tokenizer_e2e):
    tok = smol_tokenizer_e2e
    for text in ("Hello", "The capital of France is"):
        assert tok.encode(text, add_special_tokens=True) == tok.encode(text, add_special_tokens=False)
    assert tok.is_fast


@pytest.fixture(scope="module")
def smol_tokenizer_e2e():
    from llmserve.tokenizer import get_tokenizer

    return get_tokenizer("SmolLM2-135M-Instruct")
