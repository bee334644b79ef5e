"""Sequence-classification checkpoints with ``runner="pooling"`` (detected from the
architecture, vLLM's ``--convert classify``): ``LLM.classify``, ``LLM.reward`` and the
cross-encoder ``LLM.score`` on tiny random BERT, Llama, Mistral, Qwen2 and Qwen3 classifiers
equal transformers' fp32 outputs (within 1e-4), one prompt or a batch of different lengths."""
from __future__ import annotations

import pytest
import torch

from classify_utils import (DECODER_CLASSIFIERS, LLAMA_PAD, hf_logits, save_bert_classifier,
                            save_decoder_classifier, save_llama_classifier)
from llmserve import LLM, PoolingParams
from llmserve.engine_args import EngineArgs

TEXTS = ["Hi", "The cat sat on the mat and looked out of the window at the rain.",
         "Classification heads read one pooled token."]
ATOL = 1e-4


def _llm(path: str) -> LLM:
    return LLM(path, dtype="float32", multiprocess_mode=False, kv_cache_memory="16MiB", max_model_len=128)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """``get(kind, num_labels) -> (llm, hf)``: each checkpoint written and served once."""
    made, saves = {}, {"bert": save_bert_classifier, "llama": save_llama_classifier}
    for arch in DECODER_CLASSIFIERS:
        saves[arch] = lambda path, n, arch=arch: save_decoder_classifier(path, arch, n)

    def get(kind: str, num_labels: int):
        if (kind, num_labels) not in made:
            path = str(tmp_path_factory.mktemp(f"{kind}_cls{num_labels}"))
            hf = saves[kind](path, num_labels)
            made[kind, num_labels] = (_llm(path), hf, path)
        return made[kind, num_labels][:2]
    yield get
    for llm, _, _ in made.values():
        llm.shutdown()


def _bert_ref(hf, tok, text, pair=None) -> torch.Tensor:
    enc = tok(text, pair)
    return hf_logits(hf, input_ids=[enc.input_ids], token_type_ids=[enc.token_type_ids])[0]


def test_bert_classify_and_reward_equal_transformers(tiny):
    llm, hf = tiny("bert", 3)
    assert llm.get_supported_tasks() == ("classify", "token_classify")
    tok = llm.get_tokenizer()
    refs = [_bert_ref(hf, tok, t) for t in TEXTS]
    one = llm.classify(TEXTS[1], use_tqdm=False)[0]
    assert one.outputs.num_classes == 3
    assert torch.allclose(torch.tensor(one.outputs.probs), torch.softmax(refs[1], -1), atol=ATOL)
    batch = llm.classify(TEXTS, use_tqdm=False)  # one step, three lengths
    for out, ref in zip(batch, refs):
        assert torch.allclose(torch.tensor(out.outputs.probs), torch.softmax(ref, -1), atol=ATOL)
        assert abs(sum(out.outputs.probs) - 1) < 1e-5
    raw = llm.classify(TEXTS, use_tqdm=False, pooling_params=PoolingParams(use_activation=False))
    assert all(torch.allclose(torch.tensor(o.outputs.probs), r, atol=ATOL) for o, r in zip(raw, refs))
    # reward: the classifier on every token's hidden state, softmax over the labels (vLLM's token_classify)
    for text, out in zip(TEXTS, llm.reward(TEXTS, use_tqdm=False)):
        enc = tok(text)
        with torch.inference_mode():
            h = hf.bert(torch.tensor([enc.input_ids])).last_hidden_state[0]
            want = torch.softmax(hf.classifier(h), -1)
        assert out.outputs.data.shape == (len(enc.input_ids), 3)
        assert torch.allclose(out.outputs.data, want, atol=ATOL)


def test_bert_cross_encoder_scores_pairs_by_its_head(tiny):
    llm, hf = tiny("bert", 1)
    assert llm.get_supported_tasks() == ("classify", "token_classify", "score")
    tok = llm.get_tokenizer()
    query, docs = "what is a cat", ["A cat is a small animal that purrs.", "Bananas.", "Paris is in France."]
    want = [torch.sigmoid(_bert_ref(hf, tok, query, d))[0].item() for d in docs]
    got = [o.outputs.score for o in llm.score(query, docs, use_tqdm=False)]
    assert torch.allclose(torch.tensor(got), torch.tensor(want), atol=ATOL)
    # the pair's token types matter: without them (all 0) the head sees another input
    plain = [torch.sigmoid(hf_logits(hf, input_ids=[tok(query, d).input_ids]))[0, 0].item() for d in docs]
    assert max(abs(a - b) for a, b in zip(plain, want)) > 1e-4
    n_to_n = llm.score([query, docs[0]], [docs[1], docs[2]], use_tqdm=False)
    assert abs(n_to_n[1].outputs.score - torch.sigmoid(_bert_ref(hf, tok, docs[0], docs[2]))[0].item()) < ATOL
    one = llm.classify(TEXTS, use_tqdm=False)  # one label: sigmoid, as vLLM
    for out, text in zip(one, TEXTS):
        assert abs(out.outputs.probs[0] - torch.sigmoid(_bert_ref(hf, tok, text))[0].item()) < ATOL
    with pytest.raises(ValueError, match="'embed'"):
        llm.embed("hi", use_tqdm=False)


def test_llama_classify_pools_last_non_pad_token_and_rewards_every_token(tiny):
    llm, hf = tiny("llama", 3)
    tok = llm.get_tokenizer()
    ids = [tok(t).input_ids for t in TEXTS]
    padded = ids[1] + [LLAMA_PAD] * 3  # transformers pools the last token that is not the pad
    prompts = [{"prompt_token_ids": p} for p in ids + [padded]]
    outs = llm.classify(prompts, use_tqdm=False)
    for out, p in zip(outs, ids + [padded]):
        want = torch.softmax(hf_logits(hf, input_ids=[p])[0], -1)
        assert torch.allclose(torch.tensor(out.outputs.probs), want, atol=ATOL)
    assert outs[3].outputs.probs == pytest.approx(outs[1].outputs.probs, abs=1e-6)
    assert outs[3].prompt_token_ids == ids[1]  # the pads after it are not run
    ids.append(tok(" ".join(TEXTS * 4)).input_ids)  # over two KV blocks
    for _ in range(2):  # the second time the prompts are prefix-cached: rewards still cover every token
        for p, out in zip(ids, llm.reward([{"prompt_token_ids": p} for p in ids], use_tqdm=False)):
            with torch.inference_mode():
                want = torch.softmax(hf.score(hf.model(torch.tensor([p])).last_hidden_state[0]), -1)
            assert out.outputs.data.shape == (len(p), 3)
            assert torch.allclose(out.outputs.data, want, atol=ATOL)
    with pytest.raises(ValueError, match="classif"):
        llm.generate("Hello")
    with pytest.raises(ValueError, match="num_labels=1"):
        llm.score("a", "b", use_tqdm=False)


@pytest.mark.parametrize("arch", sorted(DECODER_CLASSIFIERS))
def test_mistral_qwen2_qwen3_classify_equal_transformers(tiny, arch):
    """The registry's other decoder classifiers (Mistral; Qwen2's q/k/v-only attention bias;
    Qwen3's q/k norms and explicit head_dim) as transformers computes them: softmax of the
    ``score`` head on the last token that is not ``pad_token_id``, one prompt or a batch of
    mixed lengths with padded prompts among them."""
    llm, hf = tiny(arch, 3)
    assert llm.get_supported_tasks() == ("classify", "token_classify")
    tok = llm.get_tokenizer()
    ids = [tok(t).input_ids for t in TEXTS]
    ids += [ids[0] + [LLAMA_PAD] * 4, ids[2] + [LLAMA_PAD], [LLAMA_PAD] + ids[1] + [LLAMA_PAD] * 2]
    want = [torch.softmax(hf_logits(hf, input_ids=[p])[0], -1) for p in ids]
    one = llm.classify(TEXTS[1], use_tqdm=False)[0]
    assert one.outputs.num_classes == 3
    assert torch.allclose(torch.tensor(one.outputs.probs), want[1], atol=ATOL)
    outs = llm.classify([{"prompt_token_ids": p} for p in ids], use_tqdm=False)  # one step, six lengths
    for out, w in zip(outs, want):
        assert torch.allclose(torch.tensor(out.outputs.probs), w, atol=ATOL)
    assert outs[3].prompt_token_ids == ids[0] and outs[4].prompt_token_ids == ids[2]  # trailing pads not run
    # transformers' own right-padded batch (attention mask): the same rows
    width = max(len(p) for p in ids[:3])
    batch = [p + [LLAMA_PAD] * (width - len(p)) for p in ids[:3]]
    mask = [[1] * len(p) + [0] * (width - len(p)) for p in ids[:3]]
    padded_ref = torch.softmax(hf_logits(hf, input_ids=batch, attention_mask=mask), -1)
    assert torch.allclose(torch.tensor([o.outputs.probs for o in outs[:3]]), padded_ref, atol=ATOL)


def test_llama_one_label_is_sigmoid_and_scores_pairs(tiny):
    llm, hf = tiny("llama", 1)
    tok = llm.get_tokenizer()
    outs = llm.classify(TEXTS, use_tqdm=False)
    for out, text in zip(outs, TEXTS):
        assert abs(out.outputs.probs[0] - torch.sigmoid(hf_logits(hf, input_ids=[tok(text).input_ids]))[0, 0]) < ATOL
    pair = tok("a question", "an answer").input_ids
    score = llm.score("a question", "an answer", use_tqdm=False)[0].outputs.score
    assert abs(score - torch.sigmoid(hf_logits(hf, input_ids=[pair]))[0, 0].item()) < ATOL


def test_runner_convert_and_refusals(tiny, tmp_path, save_tiny_model_fn):
    from llmserve.tokenizer import get_tokenizer

    path = str(tmp_path / "bert")
    save_bert_classifier(path, 3)
    cfg = EngineArgs(model=path).create_engine_config().model_config
    assert (cfg.runner, cfg.pooler_config.task, cfg.pooler_config.pooling_type) == ("pooling", "classify", "CLS")
    assert EngineArgs(model=path, convert="embed").create_engine_config().model_config.supported_tasks == (
        "encode", "embed")
    with pytest.raises(ValueError, match="runner='generate'"):
        EngineArgs(model=path, runner="generate").create_engine_config()
    gen = str(tmp_path / "gen")
    save_tiny_model_fn("llama", gen)
    get_tokenizer("SmolLM2-135M-Instruct").save_pretrained(gen)
    with pytest.raises(ValueError, match="convert='classify'"):
        EngineArgs(model=gen, convert="classify").create_engine_config()
    llm = LLM(gen, dtype="float32", multiprocess_mode=False, kv_cache_memory="16MiB", max_model_len=64)
    try:
        with pytest.raises(ValueError, match="--runner pooling"):
            llm.classify("hi", use_tqdm=False)
        with pytest.raises(ValueError, match="--runner pooling"):
            llm.reward("hi", use_tqdm=False)
    finally:
        llm.shutdown()
    bert, _ = tiny("bert", 3)
    with pytest.raises(ValueError, match="dimensions"):
        bert.classify("hi", use_tqdm=False, pooling_params=PoolingParams(dimensions=2))
    with pytest.raises(ValueError, match="token_type_ids"):
        bert.classify({"prompt_token_ids": [101, 102], "token_type_ids": [1, 0]}, use_tqdm=False)


def test_head_activations_follow_the_config():
    """vLLM's activation choice: problem_type for classify, the CrossEncoder's
    activation_fn for score; the activation itself as PoolerClassify (sigmoid for one label)."""
    from types import SimpleNamespace

    from llmserve.pooler_config import classifier_pooler_config
    from llmserve.worker.classifier_pooler import activate

    def cfg(**kw):
        return classifier_pooler_config(SimpleNamespace(architectures=["LlamaForSequenceClassification"],
                                                        num_labels=2, **kw))
    assert (cfg().classify_activation, cfg().score_activation, cfg().pooling_type) == ("classify", "classify", "LAST")
    assert cfg(problem_type="regression").classify_activation == "identity"
    assert cfg(problem_type="multi_label_classification").classify_activation == "sigmoid"
    ident = {"activation_fn": "torch.nn.modules.linear.Identity"}
    assert cfg(sentence_transformers=ident).score_activation == "identity"
    with pytest.raises(ValueError, match="sentence_transformers.activation_fn"):
        cfg(sentence_transformers={"activation_fn": "os.system"})
    x = torch.tensor([[0.5, -1.0]])
    assert torch.allclose(activate("classify", x), torch.softmax(x, -1))
    assert torch.allclose(activate("classify", x[:, :1]), torch.sigmoid(x[:, :1]))
    assert torch.equal(activate("identity", x), x)


def _bert_ref_ids(hf, enc) -> torch.Tensor:
    return hf_logits(hf, input_ids=[enc["input_ids"]], token_type_ids=[enc["token_type_ids"]])[0]


def test_truncation_keeps_the_query_and_the_special_tokens(tiny):
    """truncate_prompt_tokens cuts as the tokenizer's truncation=True does (vLLM's right
    truncation for pooling): a pair loses the longer text's end first, so [CLS] query
    [SEP] stays; a text keeps its first tokens and its [CLS]/[SEP]. Keeping the last k
    of the joined ids (the rule before) dropped the query and the [CLS]."""
    llm, hf = tiny("bert", 1)
    tok = llm.get_tokenizer()
    doc, k = "Paris is a city in France. " * 12, 24
    scores = {}
    for query in ("what is the capital of France", "bananas"):
        want = torch.sigmoid(_bert_ref_ids(hf, tok(query, doc, truncation=True, max_length=k)))[0].item()
        out = llm.score(query, [doc], truncate_prompt_tokens=k, use_tqdm=False)[0]
        assert len(out.prompt_token_ids) == k and abs(out.outputs.score - want) < ATOL
        scores[query] = out.outputs.score
    assert abs(scores["bananas"] - scores["what is the capital of France"]) > 1e-4  # the query still counts
    text = TEXTS[1]
    enc = tok(text, truncation=True, max_length=6)  # [CLS] + its first 4 word pieces + [SEP]
    out = llm.classify(text, pooling_params=PoolingParams(truncate_prompt_tokens=6), use_tqdm=False)[0]
    assert out.prompt_token_ids == list(enc["input_ids"]) and out.prompt_token_ids[0] == tok.cls_token_id
    assert abs(out.outputs.probs[0] - torch.sigmoid(_bert_ref_ids(hf, enc))[0].item()) < ATOL


def test_classify_refusal_names_convert_embed_only_when_it_was_set():
    """/classify on an embedding model: the 400's hint asks for a classification model;
    it names `--convert embed` only when the server runs with it (a fresh-user trial got
    "start the server without --convert embed" from a plain BERT embedding server)."""
    from llmserve.entrypoints.openai.common.pooling import _refusal_hint

    plain = _refusal_hint("classify", ("embed", "score"))
    assert "--convert embed" not in plain and "ForSequenceClassification" in plain
    converted = _refusal_hint("classify", ("embed", "score"), convert="embed")
    assert "--convert embed" in converted
