"""``llmserve bench embed`` on a few sentences: offline LLM.embed, sentence-transformers
on the same sentences, and their agreement."""
import argparse

import pytest


def test_bench_embed_small_run(tmp_path):
    pytest.importorskip("sentence_transformers")
    from llmserve.benchmarks import embed

    p = argparse.ArgumentParser()
    embed.add_cli_args(p)
    args = p.parse_args(["--num-sentences", "12", "--max-words", "20", "--output-json", str(tmp_path / "r.json")])
    res = embed.main(args)
    assert res["num_sentences"] == 12
    assert res["offline_sentences_per_s"] > 0 and res["st_sentences_per_s"] > 0
    assert res["min_cosine_vs_st"] >= 0.99999
    assert (tmp_path / "r.json").exists()
    assert len(set(embed.make_sentences(50, 8, 128, 0))) == 50
