"""Time to first token by skill length: the bundled long policy cut to each length, spliced before a scenario and
timed side by side with a full prefill (``compare``). ``benchmarks/studies/ttft.py`` records these rows; the Benchmarks tab's
live check runs two of them.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass

from kvscope.engine.cache.loaded import LoadedModel
from kvscope.engine.compose.fidelity import compare
from kvscope.engine.compose.placing import skill_of_length, with_skills
from kvscope.engine.compose.remedy import DEFAULT_REMEDY, Remedy
from kvscope.engine.compose.skills import SkillStore
from kvscope.engine.jsonable import JsonFields
from kvscope.engine.scenario import Scenario, Skill, bundled_skills

TTFT_SKILL = "long_policy"  # field-free, long enough to repeat or cut to any length


@dataclass(frozen=True)
class TtftRow(JsonFields):
    """One skill length: both sides' median TTFT (ms), their ratio, the one-time compile and the fidelity beside them."""

    skill_tokens: int
    context_tokens: int
    full_ms: float
    splice_ms: float
    speedup: float
    compile_ms: float
    cosine: float
    decision_agree: bool | None  # None where the recomputed decision is a tie


def ttft_by_length(
    lm: LoadedModel, scenario: Scenario, lengths: Iterable[int], store: SkillStore, *, remedy: Remedy = DEFAULT_REMEDY, reps: int = 1
) -> Iterator[TtftRow]:
    """A row per length: the long policy cut to about that many tokens, placed at the start of ``scenario`` and
    spliced (repaired by ``remedy``) vs a full prefill, ``reps`` timed rounds each."""
    policy = Skill.load(bundled_skills()[TTFT_SKILL])
    for length in lengths:
        skill = skill_of_length(lm, policy, length)
        placed = with_skills(scenario, [skill.id], "start", library={skill.id: skill})
        data = compare(lm, placed, store, remedy=remedy, reps=reps).as_dict()
        yield TtftRow(
            skill_tokens=data["skill_tokens"],
            context_tokens=data["context_tokens"],
            full_ms=data["ttft_ms"]["full"],
            splice_ms=data["ttft_ms"]["splice"],
            speedup=data["speedup"],
            compile_ms=data["compile_ms"],
            cosine=data["cosine"],
            decision_agree=data["decision_agree"],
        )
