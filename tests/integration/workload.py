"""Prompts sharing long prefixes, and what a correct ucm must load for them."""

from __future__ import annotations

from dataclasses import dataclass

from ucm.testing.model import TINY, make_prompt_token_ids

DOCUMENT_TOKENS = 300
QUESTION_TOKENS = 40


def _question(seed: int) -> list[int]:
    return make_prompt_token_ids(QUESTION_TOKENS, seed=seed, vocab_size=TINY.vocab_size)


@dataclass(frozen=True)
class Workload:
    """Documents asked once (cold), then asked again and asked new questions (warm)."""

    cold: list[list[int]]
    warm: list[list[int]]

    def expected_loaded(self, block_size: int) -> list[int]:
        """Tokens ucm must load for each warm prompt once the cold prompts are stored.

        Whole blocks of the longest prefix shared with a stored prompt, never the
        prompt's last token.
        """
        expected = []
        for prompt in self.warm:
            shared = max(_common_prefix(prompt, stored) for stored in self.cold)
            blocks = min(shared // block_size, (len(prompt) - 1) // block_size)
            expected.append(blocks * block_size)
        return expected


def _common_prefix(a: list[int], b: list[int]) -> int:
    length = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        length += 1
    return length


def documents_workload(num_documents: int = 2) -> Workload:
    """Build the standard workload: exact repeats plus new questions per document."""
    documents = [
        make_prompt_token_ids(DOCUMENT_TOKENS, seed=doc, vocab_size=TINY.vocab_size)
        for doc in range(num_documents)
    ]
    cold = [doc + _question(100 + i) for i, doc in enumerate(documents)]
    fresh = [doc + _question(200 + i) for i, doc in enumerate(documents)]
    return Workload(cold=cold, warm=cold + fresh)
