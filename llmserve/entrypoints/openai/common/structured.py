"""OpenAI ``response_format`` and vLLM's ``structured_outputs`` request field -> one
:class:`~llmserve.sampling_params.StructuredOutputsParams` (vLLM's
``ChatCompletionRequest.to_sampling_params`` structured-output part), shared by chat and
completions.

``response_format``:
  ``{"type": "text"}``: no constraint.
  ``{"type": "json_object"}``: the output is a JSON object.
  ``{"type": "json_object", "value": {schema}}`` and ``{"type": "json", "value": {schema}}``:
    Text Generation Inference's shapes (the Hugging Face client sends them): the schema in
    ``value`` (or ``schema``) is enforced, never dropped.
  ``{"type": "json_schema", "json_schema": {"name", "schema", "strict", "description"}}``:
    the output validates against ``schema``. The engine always compiles schemas in
    xgrammar's strict mode, so ``strict: true`` schemas (the official client's
    ``parse(response_format=Model)`` sends ``additionalProperties: false`` and every
    property required) are enforced exactly; ``strict`` false or absent gets the same
    enforcement (a subset of what the schema allows, as vLLM).
  ``{"type": "structural_tag", "structures": [{"begin", "schema", "end"}], "triggers": [...]}``
    (vLLM's) or ``{"type": "structural_tag", "format": {...}}`` (xgrammar's): free text,
    and each tagged part that begins with a trigger follows its schema (tool calls in tags).
``structured_outputs``: a dict of ``StructuredOutputsParams`` fields (``json``, ``regex``,
``choice``, ``grammar``, ``json_object``, ``structural_tag``, options).

Every problem is a SamplingParamsError naming the field (``response_format`` or
``structured_outputs``), so the server answers 400 before the request runs; a schema
that cannot compile is caught here too.
"""
from __future__ import annotations

import json
from typing import Any, Literal, Optional

from pydantic import BaseModel, ConfigDict, Field

from llmserve.sampling_params import SamplingParamsError, StructuredOutputsParams
from llmserve.structured_output.grammar import validate_structured_outputs


class JsonSchemaResponseFormat(BaseModel):
    """OpenAI's ``response_format.json_schema``; ``schema`` is the JSON schema (pydantic
    keeps it under ``json_schema_`` since ``schema`` is taken by BaseModel)."""

    model_config = ConfigDict(extra="allow", populate_by_name=True, strict=True)

    name: Optional[str] = None
    description: Optional[str] = None
    json_schema_: Optional[dict[str, Any]] = Field(default=None, alias="schema")
    strict: Optional[bool] = None


class ResponseFormat(BaseModel):
    """OpenAI's ``response_format``: ``type`` text, json_object or json_schema, vLLM's
    structural_tag; any other type is a 400 (pydantic names ``response_format.type``).
    Both models are strict about JSON types, as the request models are
    (``"strict": "true"`` is a 400, not true)."""

    model_config = ConfigDict(extra="allow", strict=True)

    type: Literal["text", "json_object", "json_schema", "json", "structural_tag"]
    json_schema: Optional[JsonSchemaResponseFormat] = None

    def tgi_schema(self) -> Optional[Any]:
        """The schema of TGI's ``{"type": "json_object" | "json", "value": schema}`` (or
        ``"schema"``), or None."""
        extra = self.model_extra or {}
        return extra.get("value", extra.get("schema"))


def _structural_tag(rf: ResponseFormat) -> StructuredOutputsParams:
    """vLLM's ``{"type": "structural_tag", ...}``: the legacy form (``structures`` of
    ``{"begin", "schema", "end"}`` and ``triggers``: free text until a trigger, then the
    tagged JSON) or xgrammar's own (``format``). The whole object is the structural tag, as
    vLLM passes it on."""
    extra = rf.model_extra or {}
    if not (("structures" in extra and "triggers" in extra) or "format" in extra):
        raise SamplingParamsError("response_format of type 'structural_tag' needs 'structures' and 'triggers' "
                                  "(vLLM's form) or 'format' (xgrammar's).", "response_format")
    return StructuredOutputsParams(structural_tag=json.dumps({"type": "structural_tag", **extra}))


def _from_response_format(rf: ResponseFormat) -> Optional[StructuredOutputsParams]:
    if rf.type == "text":
        return None
    if rf.type == "structural_tag":
        return _structural_tag(rf)
    if rf.type in ("json_object", "json"):
        schema = rf.tgi_schema()
        if schema is None:
            return StructuredOutputsParams(json_object=True)
        if not isinstance(schema, dict):
            raise SamplingParamsError("response_format.value must be a JSON schema object.", "response_format.value")
        return StructuredOutputsParams(json=schema)
    if rf.json_schema is None:
        raise SamplingParamsError("response_format of type 'json_schema' needs a 'json_schema' object "
                                  "with a 'schema'.", "response_format.json_schema")
    schema = rf.json_schema.json_schema_
    if schema is None:  # OpenAI allows it; any JSON object then
        return StructuredOutputsParams(json_object=True)
    return StructuredOutputsParams(json=schema)


def _constraint_param(rf: ResponseFormat) -> str:
    """Where ``response_format``'s constraint is, for the ``param`` of a constraint that
    does not compile: ``response_format.json_schema.schema`` (OpenAI's path),
    TGI's ``response_format.value`` / ``.schema``, else ``response_format``."""
    if rf.type == "json_schema":
        return "response_format.json_schema.schema"
    if rf.type in ("json_object", "json") and rf.tgi_schema() is not None:
        return "response_format.value" if "value" in (rf.model_extra or {}) else "response_format.schema"
    return "response_format"


def structured_outputs_params(response_format: Optional[ResponseFormat],
                              structured_outputs: Optional[dict[str, Any]]) -> Optional[StructuredOutputsParams]:
    """The request's constraint, checked (it compiles), or None.

    Raises SamplingParamsError naming ``response_format`` or ``structured_outputs`` for a
    missing schema, an unknown field or one of the wrong type (the message names
    ``structured_outputs.<field>``), both fields constraining at once, or a schema, regex,
    choice or grammar that cannot compile."""
    from_rf = _from_response_format(response_format) if response_format is not None else None
    from_so = StructuredOutputsParams.from_dict(structured_outputs) if structured_outputs is not None else None
    if from_rf is not None and from_so is not None:
        raise SamplingParamsError("Set either response_format (json_object / json_schema) or "
                                  "structured_outputs, not both.", "structured_outputs")
    params, param = (from_rf, _constraint_param(response_format)) if from_rf is not None else \
        (from_so, "structured_outputs")
    if params is not None:
        validate_structured_outputs(params, param)
    return params
