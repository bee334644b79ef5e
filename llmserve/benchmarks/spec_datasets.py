"""Prompts for the speculative-decoding benchmark (benchmarks/spec_decode.py).

``edit``: rewrite tasks whose answer repeats most of the prompt (fix the typos in a
paragraph, convert JSON to YAML, refactor or repeat code), where n-gram drafts copied from
the prompt should be accepted. ``chat``: ordinary questions whose answers do not copy the
prompt (the overhead case). Chat-message lists, rendered with the model's template.
"""
from __future__ import annotations

_PARAGRAPHS = [
    "The quick brown fox jumpd over the lazy dog. It was a sunny day and the fox was very hapy. "
    "After the jump, the fox ran into the forrest to find its freinds.",
    "Our team will meet on Monday at ten oclock to discus the new project. Please bring your notes "
    "and be ready to share you ideas about the budget and the schedule.",
    "The library is open every day from nine to five, exept on holidays. Books can be borowed for "
    "two weeks and renewed once online or at the front desk.",
    "Water boils at one hundred degrees celsius at sea level. At higher altitudes the air presure is "
    "lower, so water boils at a lower temprature and food takes longer to cook.",
]

_CODE = [
    "def add(a, b):\n    result = a + b\n    return result\n\n\ndef mul(a, b):\n    result = a * b\n"
    "    return result\n\n\ndef sub(a, b):\n    result = a - b\n    return result\n",
    "for i in range(10):\n    if i % 2 == 0:\n        print(i, 'is even')\n    else:\n"
    "        print(i, 'is odd')\n",
    "class Point:\n    def __init__(self, x, y):\n        self.x = x\n        self.y = y\n\n"
    "    def norm(self):\n        return (self.x ** 2 + self.y ** 2) ** 0.5\n",
]

_JSON = [
    '{"name": "Alice", "age": 30, "city": "Paris", "languages": ["French", "English"], "active": true}',
    '{"server": {"host": "localhost", "port": 8080}, "debug": false, "workers": 4, "log": "info"}',
]

_CHAT = [
    "What are three good habits for staying healthy?", "Explain why the sky is blue.",
    "Give me an idea for a weekend trip.", "How do plants make their food?",
    "What is the difference between a cat and a dog as pets?", "Write a short poem about the sea.",
    "Why do we have seasons?", "Suggest a name for a small bakery.",
]


def edit_messages(n: int) -> list[list[dict]]:
    """``n`` edit/rewrite tasks (cycled): typo fixes, code repeats/refactors, JSON -> YAML."""
    tasks = []
    for p in _PARAGRAPHS:
        tasks.append(f"Fix the typos in this paragraph and write the corrected paragraph in full:\n\n{p}")
    for c in _CODE:
        tasks.append(f"Rewrite this Python code with a docstring added to each function or class. "
                     f"Return the whole code:\n\n```python\n{c}```")
    for j in _JSON:
        tasks.append(f"Convert this JSON to YAML:\n\n{j}")
    return [[{"role": "user", "content": tasks[i % len(tasks)]}] for i in range(n)]


def chat_messages(n: int) -> list[list[dict]]:
    """``n`` plain chat questions (cycled)."""
    return [[{"role": "user", "content": _CHAT[i % len(_CHAT)]}] for i in range(n)]


WORKLOADS = {"edit": edit_messages, "chat": chat_messages}
