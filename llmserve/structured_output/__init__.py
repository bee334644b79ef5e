"""Structured outputs (vLLM's ``v1/structured_output``): JSON schemas, regexes, choices,
EBNF grammars and structural tags enforced with xgrammar token bitmasks.

config.py: ``StructuredOutputsConfig`` (``--structured-outputs-config``).
grammar.py: constraint -> grammar key -> xgrammar Grammar; ``validate_structured_outputs``
  (the InputProcessor's check, no tokenizer needed).
backend_xgrammar.py: TokenizerInfo, GrammarCompiler with a compiled-grammar cache, matchers.
compile_queue.py: the compile threads (small grammars never wait behind a large one; an
  aborted request's grammar is skipped or its result dropped).
request.py: a request's grammar state. manager.py: ``StructuredOutputManager`` (engine side).
bitmask.py: ``apply_grammar_bitmask`` (the runner's step on the logits).
"""
from llmserve.structured_output.config import StructuredOutputsConfig, make_structured_outputs_config
from llmserve.structured_output.grammar import validate_structured_outputs

__all__ = ["StructuredOutputsConfig", "make_structured_outputs_config", "validate_structured_outputs"]
