"""The one rule by which Ollama's routes (``/api/...``) find a served model from the name a
request gives, and what they answer when none matches. The OpenAI and Anthropic routes
keep a narrower rule (served_names.latest_match: the exact served name, or it with or
without ``:latest``, so the ``name:latest`` that ``/api/tags`` lists calls it there too).

Ollama (``types/model/name.go``, ``server/routes.go`` ``getExistingName``) reads a name as
``[host/][namespace/]model[:tag]``, the tag being ``latest`` when none is written, and
compares each part with the stored models' without regard to case
(``strings.EqualFold``). So here:

- ``SmolLM2``, ``smollm2`` and ``smollm2:latest`` are one model: a request for any of them
  calls a model served as any of them (``--served-model-name llama3:latest`` is called by
  ``llama3`` and the reverse); ``name:1b`` is another model;
- a tag is what follows the last ``:`` after the last ``/`` (``host:5000/m`` has none);
- the exact served name wins first, so two served names that differ only in case each
  stay callable as written; otherwise the first served name equal under the rule.

An unknown name is a 404 with Ollama's body, whose words depend on the route (Ollama's
``routes.go`` at the time of writing): ``/api/chat``, ``/api/generate`` and ``/api/show``
answer ``model 'NAME' not found`` (their ``GetModel`` check), ``/api/embed`` and
``/api/embeddings`` ``model "NAME" not found, try pulling it first``
(``handleScheduleError``, Go's ``%q``). NAME is the name as the request wrote it.
"""
from __future__ import annotations

import json
from typing import Iterable, Optional

from llmserve.entrypoints.openai.models.serving import ModelNotFoundError
from llmserve.served_names import DEFAULT_TAG, MAX_SERVED_NAME_CHARS, has_tag

# Routes whose 404 carries Ollama's "try pulling it first" (see the module docstring).
PULL_HINT_ROUTES = frozenset({"/api/embed", "/api/embeddings"})


def name_key(name: str) -> str:
    """``name`` as Ollama compares it: lower case, with ``:latest`` when it has no tag."""
    return (name if has_tag(name) else f"{name}:{DEFAULT_TAG}").lower()


def match_name(requested: str, names: Iterable[str]) -> Optional[str]:
    """The name of ``names`` (served names, or the names a key may call) that
    ``requested`` calls by Ollama's rule (module docstring), or None."""
    names = list(names)
    if requested in names:
        return requested
    key = name_key(requested)
    return next((n for n in names if name_key(n) == key), None)


class OllamaModelNotFound(ModelNotFoundError):
    """An unknown model on Ollama's routes: 404 (it is a ModelNotFoundError) with Ollama's
    message for the route (module docstring). ``pull_hint``: the embedding routes' words;
    ``quoted``: the name in Go's ``%q`` without the hint (``/api/copy``'s source); ``note``:
    words after the message (``/api/pull`` says that nothing is downloaded here)."""

    def __init__(self, model: str, pull_hint: bool = False, quoted: bool = False, note: str = ""):
        # a served name is at most MAX_SERVED_NAME_CHARS long: a longer one is cut so a
        # 100,000-character name does not make a 100 kB error body (as ModelNotFoundError)
        shown = model if len(model) <= MAX_SERVED_NAME_CHARS else \
            f"{model[:MAX_SERVED_NAME_CHARS]}... ({len(model)} characters)"
        go_quoted = json.dumps(shown, ensure_ascii=False)
        message = (f"model {go_quoted} not found, try pulling it first" if pull_hint
                   else f"model {go_quoted} not found" if quoted else f"model '{shown}' not found")
        LookupError.__init__(self, message + note)  # not ModelNotFoundError's OpenAI wording
        self.model = model


# What /api/pull adds to its 404: Ollama would download the model; llmserve cannot.
NOT_DOWNLOADED = ("; llmserve downloads no models: it serves the models it was started with (`llmserve serve "
                  "MODEL`, `--extra-model`), see GET /api/tags")


def not_found(model: str, route: str) -> OllamaModelNotFound:
    """The 404 of an unknown ``model`` on the Ollama route ``route`` (``/api/chat``...),
    in that route's words: Ollama's routes.go says ``model "NAME" not found, try pulling it
    first`` on the embedding routes, ``model "NAME" not found`` (Go's %q) for /api/copy's
    source, ``model 'NAME' not found`` elsewhere (/api/delete and /api/show included);
    /api/pull adds :data:`NOT_DOWNLOADED`."""
    return OllamaModelNotFound(model, pull_hint=route in PULL_HINT_ROUTES, quoted=route == "/api/copy",
                               note=NOT_DOWNLOADED if route == "/api/pull" else "")


def resolve(requested: str, names: Iterable[str], pull_hint: bool = False, route: str = "") -> str:
    """The served name ``requested`` calls; raises OllamaModelNotFound (404) for none, in
    the words of ``route`` (:func:`not_found`) when given, else of a generating route or,
    with ``pull_hint``, of the embedding routes."""
    found = match_name(requested, names)
    if found is None:
        raise not_found(requested, route) if route else OllamaModelNotFound(requested, pull_hint)
    return found
