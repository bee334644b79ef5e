"""Shared fixtures: the real default model (SmolLM2-135M-Instruct GGUF) in float32,
through llmserve and through Hugging Face transformers (the correctness reference)."""
import os

import pytest
import torch

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

PROMPTS = [
    "The capital of France is",
    "Once upon a time, there was a",
    "def fibonacci(n):",
    "The three primary colors are",
    "In 1969, the first humans",
    "Water boils at a temperature of",
    "My favourite recipe for pancakes",
    "The quick brown fox",
    "To be or not to be,",
    "Machine learning is a field of",
    "Paris, London and Berlin are",
    "The square root of 144 is",
    "Photosynthesis is the process",
    "A haiku about the ocean:",
    "import numpy as np\n",
    "Dear hiring manager, I am writing",
]


@pytest.fixture(scope="session")
def smollm():
    """ResolvedModel of the packaged default model."""
    from llmserve.model_loader import resolve_model

    return resolve_model("SmolLM2-135M-Instruct")


@pytest.fixture(scope="session")
def hf_model(smollm):
    """transformers' own Llama on the same GGUF weights, float32."""
    import torch
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(smollm.path, gguf_file=smollm.gguf_file, dtype=torch.float32)
    m.eval()
    return m


@pytest.fixture(scope="session")
def llm_fp32():
    """llmserve LLM on the default model, float32, engine in-process."""
    from llmserve import LLM

    llm = LLM("SmolLM2-135M-Instruct", dtype="float32", multiprocess_mode=False, kv_cache_memory="512MiB",
              max_num_batched_tokens=512)
    yield llm
    llm.shutdown()


@pytest.fixture(scope="session")
def hf_greedy(hf_model, llm_fp32):
    """HF greedy continuations (32 new tokens max, stopping at EOS like HF does) of PROMPTS.

    One left-padded batch: transformers derives the position ids from the attention mask
    and masks the pads out, so each row gets the tokens it gets alone (all 16 equal the
    one-prompt-at-a-time generate, checked when this changed; llmserve's one-at-a-time
    outputs are compared with them) for 32 forward passes instead of 16 x 32."""
    import torch

    tok = llm_fp32.get_tokenizer()
    pad = tok.eos_token_id
    encoded = [tok.encode(p) for p in PROMPTS]
    width = max(map(len, encoded))
    ids = torch.tensor([[pad] * (width - len(e)) + e for e in encoded])
    mask = torch.tensor([[0] * (width - len(e)) + [1] * len(e) for e in encoded])
    with torch.inference_mode():
        out = hf_model.generate(ids, attention_mask=mask, max_new_tokens=32, do_sample=False,
                                eos_token_id=tok.eos_token_id, pad_token_id=pad)
    res = {}
    for p, row in zip(PROMPTS, out[:, width:].tolist()):
        # A row that ended early is padded with EOS after its own EOS: keep up to the first.
        res[p] = row[:row.index(pad) + 1] if pad in row else row
    return res


# ---- tiny random checkpoints of each supported architecture ----

TINY_COMMON = dict(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                   rms_norm_eps=1e-6)


def tiny_config(arch: str):
    """A 2-layer GQA config of ``arch`` (hidden 64) with the architecture's quirks switched on."""
    import transformers as tf
    if arch == "llama":  # llama3 rope scaling, biases everywhere, untied head
        return tf.LlamaConfig(**TINY_COMMON, attention_bias=True, tie_word_embeddings=False,
                              rope_scaling={"rope_type": "llama3", "factor": 8.0,
                                            "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                            "original_max_position_embeddings": 64},
                              rope_theta=10000.0)
    if arch == "mistral":  # sliding window shorter than the prompts, tied head
        return tf.MistralConfig(**TINY_COMMON, head_dim=16, sliding_window=8,
                                tie_word_embeddings=True)
    if arch == "qwen2":  # q/k/v bias, tied head
        return tf.Qwen2Config(**TINY_COMMON, tie_word_embeddings=True)
    if arch == "qwen3":  # per-head q/k norm, head_dim != hidden / heads
        return tf.Qwen3Config(**TINY_COMMON, head_dim=32, tie_word_embeddings=False)
    raise ValueError(arch)


def save_tiny_model(arch: str, path: str, seed: int = 0):
    """Write a random ``arch`` model (config.json + model.safetensors) to ``path``; return the
    HF model (float32, eval)."""
    from transformers import AutoModelForCausalLM
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(arch), dtype=torch.float32)
    with torch.no_grad():  # norms start at 1.0; perturb so a wrong mapping shows
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith(".bias"):
                p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(path)
    return model.eval()


@pytest.fixture(scope="session")
def save_tiny_model_fn():
    """``save_tiny_model(arch, path, seed=0)``: write a tiny random HF checkpoint."""
    return save_tiny_model


class EngineExitWatch:
    """Context manager around an engine process handle (``_Proc``): its ``terminate`` and
    ``kill`` only record the signal a shutdown asked for, so a test can assert the engine
    exited by itself (code 0) after SHUTDOWN; on exit a still-running engine is killed."""

    def __init__(self, proc) -> None:
        self.proc = proc
        self.signals: list[str] = []
        proc.terminate = lambda: self.signals.append("SIGTERM")
        proc.kill = lambda: self.signals.append("SIGKILL")

    def __enter__(self) -> "EngineExitWatch":
        return self

    def __exit__(self, *exc) -> None:
        if self.proc.is_alive():
            self.proc.popen.kill()
            self.proc.join(5)

    def assert_exited_by_itself(self) -> None:
        assert self.signals == [] and not self.proc.is_alive() and self.proc.exitcode == 0


@pytest.fixture(scope="session")
def engine_exit_watch():
    """``EngineExitWatch(proc)``: see its docstring."""
    return EngineExitWatch


LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def make_lora_adapter(hf_model, path: str, r: int, seed: int, targets=LORA_TARGETS, alpha: int = 16,
                      use_rslora: bool = False):
    """Save a random rank-``r`` PEFT LoRA of ``hf_model`` to ``path`` (peft's own
    ``get_peft_model`` + ``save_pretrained``); return the PeftModel on a copy of the base
    (eval). A and B both random (``init_lora_weights=False``), so it moves the logits."""
    import copy

    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    cfg = LoraConfig(r=r, lora_alpha=alpha, target_modules=list(targets), init_lora_weights=False,
                     use_rslora=use_rslora)
    pm = get_peft_model(copy.deepcopy(hf_model), cfg)
    pm.save_pretrained(path)
    return pm.eval()


@pytest.fixture(scope="session")
def make_lora_adapter_fn():
    """``make_lora_adapter(hf_model, path, r, seed, targets=..., alpha=16, use_rslora=False)``."""
    return make_lora_adapter
