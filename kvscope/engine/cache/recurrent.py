"""A hybrid's append-only context on the model's own cache (Mamba, gated DeltaNet beside attention).

A recurrent layer keeps one running state that sums up every earlier token, not one entry per token, so no entry
of a hybrid's cache can be replaced, hidden, patched or moved (the notebook refuses hybrids, naming the layers).
What stays exact is what a left-to-right run computes: a prefill (in chunks or at once), appending, and reading a
decision. :class:`RecurrentContext` is that context; ``kvscope.engine.edit.hybrid`` builds the exact edit on it.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
from transformers import DynamicCache

from kvscope.engine.cache.adapter import recurrent_cache, recurrent_forward
from kvscope.engine.cache.budget import compute_slot, forward_token_limit
from kvscope.engine.cache.decision import Decision, answer_logprob, decide
from kvscope.engine.cache.loaded import LoadedModel
from kvscope.engine.errors import NotebookError
from kvscope.engine.scenario import RenderedPrompt


@dataclass(frozen=True)
class RecurrentContext:
    """A hybrid's context as its own cache holds it: tokens in order and the state after them (never mutated)."""

    lm: LoadedModel
    token_ids: tuple[int, ...]
    segments: tuple[str, ...]
    cache: DynamicCache

    def __len__(self) -> int:
        return len(self.token_ids)

    @classmethod
    def prefill(
        cls, lm: LoadedModel, token_ids: Sequence[int], segments: Sequence[str] | str = "context", chunk_size: int | None = None
    ) -> "RecurrentContext":
        """Run the tokens left to right, ``chunk_size`` (default: the forward limit) at a time."""
        if not lm.recurrent_layers:
            raise NotebookError(f"{lm.name} has no recurrent layers: use the notebook (kvscope.engine.cache.notebook), which can also edit")
        empty = cls(lm, (), (), recurrent_cache(lm.model))
        return empty.append(token_ids, segments, chunk_size) if len(token_ids) else empty

    def append(
        self, token_ids: Sequence[int], segments: Sequence[str] | str = "context", chunk_size: int | None = None
    ) -> "RecurrentContext":
        """This context with tokens run after it (e.g. an erratum line); one label or one per token."""
        labels = [segments] * len(token_ids) if isinstance(segments, str) else list(segments)
        if not token_ids or len(labels) != len(token_ids):
            raise NotebookError(f"append needs tokens and one label each (got {len(token_ids)} tokens, {len(labels)} labels)")
        cache, step = copy.deepcopy(self.cache), chunk_size or forward_token_limit()
        for begin in range(0, len(token_ids), step):
            chunk = list(token_ids)[begin : begin + step]
            self._advance(cache, chunk, len(self) + begin)
        return RecurrentContext(self.lm, self.token_ids + tuple(token_ids), self.segments + tuple(labels), cache)

    def _advance(self, cache: DynamicCache, token_ids: Sequence[int], start: int) -> torch.Tensor:
        with compute_slot(start + len(token_ids)):
            return recurrent_forward(self.lm.model, cache, torch.tensor(list(token_ids), dtype=torch.long, device=self.lm.device), start)

    def read(
        self,
        decode_ids: Sequence[int],
        answers: Mapping[str, Sequence[Sequence[int]]],
        answer_texts: Mapping[str, Sequence[str]] | None = None,
    ) -> Decision:
        """Score each answer's tokens after ``decode_ids``: the question runs once, each multi-token answer on a copy
        of the state after it; the context itself is not changed."""
        if not decode_ids:
            raise NotebookError("a decision needs decode tokens (the question); got none")
        after_question = copy.deepcopy(self.cache)
        question_logits = self._advance(after_question, decode_ids, len(self))
        start = len(self) + len(decode_ids)
        texts = answer_texts or {label: [str(i) for i in range(len(seqs))] for label, seqs in answers.items()}
        string_logprobs: dict[str, dict[str, float]] = {}
        for label, sequences in answers.items():
            string_logprobs[label] = {}
            for text, answer in zip(texts[label], sequences):
                logits = question_logits[-1:]
                if len(answer) > 1:
                    logits = torch.cat([logits, self._advance(copy.deepcopy(after_question), answer[:-1], start)])
                string_logprobs[label][text] = float(answer_logprob(logits, range(len(answer)), answer))
        return decide(string_logprobs, question_logits[-1].detach().cpu().clone())

    def read_prompt(self, prompt: RenderedPrompt, answer_texts: Mapping[str, Sequence[str]] | None = None) -> Decision:
        """Read the decision for a rendered scenario's question and answers."""
        return self.read(prompt.decode_ids, prompt.answer_ids, answer_texts=answer_texts)
