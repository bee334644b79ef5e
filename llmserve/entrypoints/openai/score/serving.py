"""``/score`` and ``/rerank`` (vLLM's ``ServingScores``). For an embedding model both texts
of each pair are embedded and the score is their cosine similarity, as vLLM does for a
model without a cross-encoder head; for a cross-encoder (a classification model with one
label) each pair is tokenized together (``token_type_ids`` and all) and scored by its
head through the score activation (sigmoid by default: sentence-transformers'
CrossEncoder and vLLM)."""
from __future__ import annotations

from llmserve.entrypoints.openai.common.pooling import PoolingBaseServing
from llmserve.entrypoints.openai.common.protocol import UsageInfo
from llmserve.entrypoints.openai.score.protocol import (RerankDocument, RerankRequest, RerankResponse,
                                                        RerankResult, RerankUsage, ScoreRequest, ScoreResponse,
                                                        ScoreResponseData)
from llmserve.outputs import PoolingRequestOutput, ScoringOutput
from llmserve.sampling_params import ContextLengthExceededError, SamplingParamsError
from llmserve.tokenizer import check_texts


def _cosine(a: PoolingRequestOutput, b: PoolingRequestOutput) -> float:
    """Cosine similarity of two embeddings (1-D tensors of any float dtype) as a float."""
    # imported here: the API server does not import torch at start (issue 31); the
    # embeddings are tensors already, so torch is in sys.modules by now
    import torch.nn.functional as F

    return float(F.cosine_similarity(a.outputs.data.float(), b.outputs.data.float(), dim=0))


def _pair_up(texts_1: list[str], texts_2: list[str], names: tuple[str, str]) -> list[str]:
    """``texts_1`` as long as ``texts_2`` (one text against each, or N:N). Raises
    SamplingParamsError naming the empty or mismatched field."""
    for texts, param in zip((texts_1, texts_2), names):
        if not texts:
            raise SamplingParamsError(f"{param} cannot be empty.", param)
    if len(texts_1) == 1:
        return texts_1 * len(texts_2)
    if len(texts_1) != len(texts_2):
        raise SamplingParamsError(f"{names[0]} has {len(texts_1)} items and {names[1]} {len(texts_2)}: give one "
                                  f"{names[0]} or as many as {names[1]}.", names[0])
    return texts_1


def _check_side_fits(prompts: list, max_model_len: int, param: str) -> None:
    """Raise ContextLengthExceededError (400) naming ``param`` (the side, e.g. ``query``)
    for a rendered prompt longer than ``max_model_len`` tokens: the engine's own check
    sees all sides' prompts together and could name only one of them."""
    for p in prompts:
        if len(p.token_ids) > max_model_len:
            raise ContextLengthExceededError(
                f"This model's maximum context length is {max_model_len} tokens. However, you requested "
                f"{len(p.token_ids)} tokens in the input for embedding generation. Please reduce the length of "
                f"the input (or set truncate_prompt_tokens).", param)


class OpenAIServingScores(PoolingBaseServing):
    """Handler of the score and rerank endpoints. Raises ModelNotFoundError (404) or
    SamplingParamsError (400 naming the field: ``model`` for a model that can neither
    embed nor cross-encode, the score request's side names (``text_1``/``text_2``,
    ``queries``/``documents``...) or rerank's ``query``/``documents`` for empty or
    mismatched inputs)."""

    async def _score(self, request, texts_1: list[str], texts_2: list[str], names: tuple[str, str],
                     prefix: str, sent: tuple) -> tuple[str, str, list[float], int]:
        """(served name, request id, one score per pair, prompt tokens). ``sent``: the two
        sides as the client sent them, so a lone surrogate is named at its own side and
        item (``query``, ``text_2.1``, ``documents.1.text``), not at the second side."""
        name = self.check_task(request, "score")
        check_texts(zip(names, sent))
        texts_1 = _pair_up(texts_1, texts_2, names)
        rid = self.new_request_id(prefix)
        if "score" in self.model_config.supported_tasks:
            scores, ntok = await self._cross_encode(request, texts_1, texts_2, names[1], rid)
        else:
            scores, ntok = await self._embed_cosine(request, texts_1, texts_2, names, rid)
        return name, rid, scores, ntok

    async def _cross_encode(self, request, texts_1: list[str], texts_2: list[str], param: str,
                            rid: str) -> tuple[list[float], int]:
        """Each (text_1, text_2) pair through the cross-encoder's head (vLLM's cross-encoding score)."""
        prompts = await self.renderer.render_pairs(list(zip(texts_1, texts_2)),
                                                   add_special_tokens=request.add_special_tokens,
                                                   check_length=request.truncate_prompt_tokens is None, param=param,
                                                   truncate=self.truncation(request.truncate_prompt_tokens))
        outs = await self.encode_all(prompts, self.pooling_params(request, "score"), rid, request.priority, param)
        return [ScoringOutput.from_base(o.outputs).score for o in outs], sum(len(o.prompt_token_ids) for o in outs)

    async def _embed_cosine(self, request, texts_1: list[str], texts_2: list[str], names: tuple[str, str],
                            rid: str) -> tuple[list[float], int]:
        """Cosine similarity of the two texts' embeddings; each distinct text is embedded
        once (a query scored against N documents: N + 1). Each side is rendered under its
        own name (``names``), so an over-long ``query`` / ``text_1`` is a 400 naming it."""
        unique_1 = list(dict.fromkeys(texts_1))
        seen = set(unique_1)
        unique_2 = [t for t in dict.fromkeys(texts_2) if t not in seen]
        unique = unique_1 + unique_2
        prompts = []
        for side, param in ((unique_1, names[0]), (unique_2, names[1])):
            if side:
                rendered = await self.render_input(side, request.add_special_tokens, param,
                                                   truncate_prompt_tokens=request.truncate_prompt_tokens)
                _check_side_fits(rendered, self.max_model_len, param)
                prompts += rendered
        params = self.pooling_params(request, "embed")
        params.normalize = True if params.normalize is None else params.normalize
        outs = dict(zip(unique, await self.encode_all(prompts, params, rid, request.priority, names[1])))
        scores = [_cosine(outs[a], outs[b]) for a, b in zip(texts_1, texts_2)]
        return scores, sum(len(o.prompt_token_ids) for o in outs.values())

    async def create_score(self, request: ScoreRequest) -> ScoreResponse:
        t1 = [request.data_1] if isinstance(request.data_1, str) else list(request.data_1)
        t2 = [request.data_2] if isinstance(request.data_2, str) else list(request.data_2)
        name, rid, scores, ntok = await self._score(request, t1, t2, request.field_names, "score",
                                                    (request.data_1, request.data_2))
        return ScoreResponse(id=rid, created=self.now(), model=name,
                             data=[ScoreResponseData(index=i, score=s) for i, s in enumerate(scores)],
                             usage=UsageInfo(prompt_tokens=ntok, total_tokens=ntok))

    async def create_rerank(self, request: RerankRequest) -> RerankResponse:
        docs = []
        for d in request.documents:
            text = d if isinstance(d, str) else d.get("text")
            if not isinstance(text, str):
                raise SamplingParamsError("documents must be strings or objects with a string `text`.", "documents")
            docs.append(text)
        if request.top_n is not None and request.top_n < 0:
            raise SamplingParamsError(f"top_n must be >= 0, got {request.top_n}", "top_n")
        name, rid, scores, ntok = await self._score(request, [request.query], docs, ("query", "documents"), "rerank",
                                                    (request.query, request.documents))
        order = sorted(range(len(docs)), key=lambda i: -scores[i])
        if request.top_n:
            order = order[:request.top_n]
        results = [RerankResult(index=i, relevance_score=scores[i],
                                document=RerankDocument(text=docs[i]) if request.return_documents else None)
                   for i in order]
        return RerankResponse(id=rid, model=name, usage=RerankUsage(prompt_tokens=ntok, total_tokens=ntok), results=results)
