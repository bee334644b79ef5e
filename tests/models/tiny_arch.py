"""Helpers shared by the tiny-architecture tests (test_gemma_phi3.py, test_moe.py): a
random checkpoint written by transformers' own model class, a module-scoped fixture that
writes each architecture's once, our model loaded from it, and HF's reference logits."""
from __future__ import annotations

from typing import Any, Callable

import pytest
import torch

from llmserve.model_loader import get_model, load_hf_config, resolve_model


def save_random(config: Any, path: str, seed: int, perturb: Callable[[str, torch.Tensor], None]):
    """Write a random checkpoint of ``config`` to ``path`` after ``perturb(name, param)``
    (in place, under no_grad) on every parameter; return the HF model in eval mode."""
    from transformers import AutoModelForCausalLM
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            perturb(name, p)
    model.save_pretrained(path)
    return model.eval()


def checkpoints_fixture(save_tiny: Callable[[str, str], Any]):
    """A module-scoped fixture ``checkpoints``: ``get(arch) -> (path, hf)``, each
    architecture's checkpoint written once (by ``save_tiny(arch, path)``)."""
    @pytest.fixture(scope="module")
    def checkpoints(tmp_path_factory):
        built: dict = {}

        def get(arch: str):
            if arch not in built:
                path = str(tmp_path_factory.mktemp(f"tiny_{arch}"))
                built[arch] = (path, save_tiny(arch, path))
            return built[arch]
        return get
    return checkpoints


def load_ours(path: str, model_config_fn: Callable) -> Any:
    """Our model of the checkpoint at ``path``, in float32."""
    resolved = resolve_model(path)
    return get_model(model_config_fn(resolved, load_hf_config(resolved), "float32"))


def hf_logits(hf: Any, tokens: list[int]) -> torch.Tensor:
    """HF's float32 logits ``[len(tokens), vocab]`` of one sequence."""
    with torch.no_grad():
        return hf(torch.tensor([tokens])).logits[0].float()


def assert_chunked_steps_match_hf(arch: str, ours: Any, hf: Any, tokens_fn: Callable, step_runner_cls: type,
                                  length: int, a_first: int, b_chunks: tuple[int, int], atol: float = 1e-4) -> None:
    """Two sequences of ``length`` tokens through ``ours`` step by step: A's first
    ``a_first`` tokens whole then one, B's prompt in the chunks ``[:b_chunks[0]]`` and
    ``[b_chunks[0]:b_chunks[1]]``, then batched one-token decodes to the end; every
    position's logits within ``atol`` of HF's full forward."""
    seqs = {"a": tokens_fn(length, 2), "b": tokens_fn(length, 3)}
    refs = {r: hf_logits(hf, s) for r, s in seqs.items()}
    runner = step_runner_cls(ours)
    done = {"a": 0, "b": 0}

    def check(out):
        for rid, logits in out.items():
            n = logits.shape[0]
            torch.testing.assert_close(logits, refs[rid][done[rid]:done[rid] + n], atol=atol, rtol=1e-4,
                                       msg=lambda m: f"{arch}/{rid} at {done[rid]}: {m}")
            done[rid] += n

    b0, b1 = b_chunks
    check(runner.step([("a", seqs["a"][:a_first]), ("b", seqs["b"][:b0])]))
    check(runner.step([("a", seqs["a"][a_first:a_first + 1]), ("b", seqs["b"][b0:b1])]))
    while any(done[r] < length for r in seqs):
        check(runner.step([(r, seqs[r][done[r]:done[r] + 1]) for r in seqs if done[r] < length]))


def tiny_engine(checkpoints: Callable, arch: str) -> tuple[Any, Any]:
    """``(LLM, HF model)`` for ``arch``'s checkpoint: in-process, float32, SmolLM2's tokenizer,
    a small KV cache and 32-token steps (prompts longer than that are chunked)."""
    from llmserve import LLM

    path, hf = checkpoints(arch)
    llm = LLM(path, tokenizer="SmolLM2-135M-Instruct", dtype="float32", multiprocess_mode=False,
              kv_cache_memory="64MiB", max_num_batched_tokens=32, block_size=16)
    return llm, hf


def gguf_writer(path: str, arch: str, cfg: Any) -> Any:
    """A ``gguf.GGUFWriter`` for ``arch`` with the hyper-parameters every architecture
    stores (context, widths, blocks, heads, norm epsilon) taken from the HF ``cfg``."""
    import gguf
    w = gguf.GGUFWriter(path, arch)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    return w


def finish_gguf(w: Any) -> None:
    """Write the header, metadata and tensors added to ``w``, and close it."""
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
