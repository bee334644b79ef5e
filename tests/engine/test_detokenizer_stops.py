"""Stop strings and min_tokens in the incremental detokenizer (vLLM: stop strings are not
checked until more than min_tokens tokens were generated)."""
from llmserve.engine.detokenizer import IncrementalDetokenizer
from llmserve.sampling_params import SamplingParams
from llmserve.tokenizer import get_tokenizer


def _run(params: SamplingParams, words: list[str]) -> tuple[str, int]:
    tok = get_tokenizer("SmolLM2-135M-Instruct")
    det = IncrementalDetokenizer(tok, tok.encode("Hi"), params)
    for n, w in enumerate(words, 1):
        ids = tok.encode(w, add_special_tokens=False)
        assert len(ids) == 1
        if det.update(ids, False) is not None:
            return det.output_text, n
    return det.output_text, -1


def test_min_tokens_holds_back_stop_strings():
    words = [" one", " two", " one", " three"]
    assert _run(SamplingParams(stop=[" one"]), words) == ("", 1)
    # the first " one" is token 1 <= min_tokens: not a stop; the second (token 3) is
    assert _run(SamplingParams(stop=[" one"], min_tokens=2), words) == (" one two", 3)
    assert _run(SamplingParams(stop=[" one"], min_tokens=3), words) == (" one two one three", -1)
