"""``POST /v1/embeddings`` on this server, which serves generative models only for now:
an unknown model is a 404, anything else a 400 (never a 5xx, which clients retry)."""
from __future__ import annotations

from llmserve.entrypoints.openai.common.serving import BaseServing
from llmserve.entrypoints.openai.embeddings.protocol import EmbeddingRequest
from llmserve.sampling_params import SamplingParamsError


class OpenAIServingEmbedding(BaseServing):
    """Handler of ``/v1/embeddings`` (a generative model answers 400)."""

    async def create_embedding(self, request: EmbeddingRequest) -> None:
        """Always raises: ModelNotFoundError (404) or SamplingParamsError (400)."""
        self._check_model(request)
        raise SamplingParamsError(
            "This model does not support the Embeddings API: it is served for text generation "
            "(start the server with an embedding model).", "model")
