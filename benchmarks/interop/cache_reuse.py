"""llama.cpp's shift-only chunk reuse (``llama-server --cache-reuse``) vs KVScope's seam repair, on the same prompts.

    bash scripts/build_llama_server.sh      # once: llama-server built from the pinned llama.cpp source
    python -m benchmarks.interop.cache_reuse [--scenarios keystone_safety,refund_gate] [--removed tone_guide]
                                     [--seams 0,1,4,16] [--chunk 16] [--threads 2]

Two cases per scenario and field value, every prompt sent to both engines as the same token ids:

* **moved**: the previous request had an extra document (the ``--removed`` skill's text) right before the
  scenario's skill; the new request drops it, so the skill and everything after it move left. llama-server with
  ``n_cache_reuse`` finds those chunks in its slot and shifts their keys (RoPE, no recompute; its PR #9866);
  KVScope moves the same K/V (computed in the previous request's context) with ``Notebook.splice`` and
  recomputes the first ``seam`` tokens, and also splices the skill compiled in isolation (the Composer's way,
  ``seam:N`` and the default remedy) with the scenario text prefilled.
* **edit**: the previous request had the old field value, the new one has the new value in place. llama.cpp's
  reuse can only shift chunks that follow a *removed* span, so it re-evaluates everything after the changed
  token; KVScope's field-only edit (the field's K/V alone) and both engines' erratum (append-only) are beside it.

Both engines are read where the answers first differ (their shared leading tokens, e.g. "Decision:", appended to
the question). Each state is compared with its own engine's clean prefill of the new prompt (llama-server with
prompt caching off for that request): KL(clean ‖ state) and top-1/top-5 over the whole vocabulary (llama-server
returns probabilities for every token, not logits), the margin between the two labels' tokens there with its
error and, where the clean margin is decisive (≥ 0.25), decision agreement;
prompt tokens the engine evaluated, and its prompt time beside its clean prefill's. KVScope's logit cosine is
added for its arms. Writes benchmarks/interop/results/cache_reuse-<model>-<device>.json. Single runs: the engines run
one after the other on the same CPU, and each engine's times are compared only with its own.
"""

from __future__ import annotations

import dataclasses
import tempfile
from dataclasses import dataclass
from pathlib import Path

import httpx
import torch

from benchmarks import common
from benchmarks.common import results_dir, write_result
from benchmarks.serving.serving_servers import SERVER_BINARY, LlamaServer, embedded_gguf
from kvscope.engine.cache.decision import DECISIVE_MARGIN, logit_agreement
from kvscope.engine.cache.loaded import LoadedModel
from kvscope.engine.cache.notebook import Notebook
from kvscope.engine.compose.placing import with_skills
from kvscope.engine.compose.remedy import DEFAULT_REMEDY, Remedy
from kvscope.engine.compose.skills import SkillStore
from kvscope.engine.compose.splice import splice_prompt
from kvscope.engine.edit.experiment import EditExperiment
from kvscope.engine.edit.runs import render_for
from kvscope.engine.scenario import (
    RenderedPrompt,
    Scenario,
    Skill,
    bundled_scenarios,
    bundled_skills,
    unescape_braces,
)
from kvscope.engine.timing import timed

_LOGPROB_FLOOR = -50.0  # for a token whose probability the server rounds to 0


@dataclass(frozen=True)
class NextToken:
    """One engine's next-token log-probs after a prompt, and what producing them cost."""

    logprobs: torch.Tensor  # (vocab,) float32
    evaluated: int  # prompt tokens the engine computed
    ms: float  # the engine's prompt time

    @classmethod
    def from_logits(cls, logits: torch.Tensor, evaluated: int, ms: float) -> "NextToken":
        return cls(torch.log_softmax(logits.float(), -1), evaluated, ms)


def at_decision_point(prompt: RenderedPrompt) -> RenderedPrompt:
    """The prompt read where its answers first differ: their shared leading tokens (e.g. "Decision:") appended to
    the question, the answers cut after them."""
    strings = [ids for variants in prompt.answer_ids.values() for ids in variants]
    shared = 0
    while all(len(ids) > shared + 1 and ids[shared] == strings[0][shared] for ids in strings):
        shared += 1
    answers = {label: tuple(ids[shared:] for ids in variants) for label, variants in prompt.answer_ids.items()}
    return dataclasses.replace(prompt, decode_ids=tuple(prompt.decode_ids) + tuple(strings[0][:shared]), answer_ids=answers)


def first_token_margin(logprobs: torch.Tensor, answer_ids: dict[str, tuple[tuple[int, ...], ...]]) -> float:
    """The first label's score minus the other's, each label scored by log Σ P over its strings' distinct first
    tokens (read at the decision point, where they differ)."""
    scores = [torch.logsumexp(logprobs[sorted({ids[0] for ids in strings})], 0) for strings in answer_ids.values()]
    return float(scores[0] - max(scores[1:]))


def fidelity(state: NextToken, clean: NextToken, answer_ids: dict, logits: tuple[torch.Tensor, torch.Tensor] | None = None) -> dict:
    """A state against its engine's clean prefill (KL, top-k, first-token decision, tokens and time)."""
    agreement = logit_agreement(clean.logprobs, state.logprobs)
    margin, reference = first_token_margin(state.logprobs, answer_ids), first_token_margin(clean.logprobs, answer_ids)
    decisive = abs(reference) >= DECISIVE_MARGIN
    row = {
        "kl": round(agreement["kl"], 6),
        "top1_agree": agreement["top1_agree"],
        "top5_agree": agreement["top5_agree"],
        "margin": round(margin, 4),
        "clean_margin": round(reference, 4),
        "margin_error": round(margin - reference, 4),
        "decisive": decisive,
        "decision_agree": (margin > 0) == (reference > 0) if decisive else None,
        "evaluated_tokens": state.evaluated,
        "clean_evaluated_tokens": clean.evaluated,
        "ms": round(state.ms, 1),
        "clean_ms": round(clean.ms, 1),
        "speedup": round(clean.ms / max(state.ms, 1e-6), 2),
    }
    if logits is not None:
        row["logit_cosine"] = round(logit_agreement(*logits)["cosine"], 6)
    return row


def next_token(server: LlamaServer, ids: list[int], *, cache: bool, reuse_chunk: int = 0, vocab: int = 0) -> NextToken:
    """Evaluate ``ids`` on ``server`` (after its slot's previous prompt when ``cache``; shifting chunks of at least
    ``reuse_chunk`` tokens when > 0) and return the first token's log-probs over ``vocab`` tokens."""
    body = {
        "prompt": ids,
        "n_predict": 1,
        "temperature": 0.0,
        "cache_prompt": cache,
        "n_cache_reuse": reuse_chunk,
        "n_probs": vocab,
        "post_sampling_probs": False,
    }
    with httpx.Client(trust_env=False, timeout=600.0) as client:
        response = client.post(f"{server.base_url}/completion", json=body)
        response.raise_for_status()
    return parse_completion(response.json(), vocab)


def parse_completion(data: dict, vocab: int) -> NextToken:
    """A llama-server ``/completion`` answer (one token, ``n_probs`` = vocab) as log-probs, tokens evaluated and
    prompt time; a token the server rounds to probability 0 gets a floor of −50 (ids past ``vocab`` are left out)."""
    logprobs = torch.full((max(vocab, 1),), _LOGPROB_FLOOR)
    if vocab:
        for entry in data["completion_probabilities"][0]["top_logprobs"]:
            if entry["logprob"] is not None and entry["logprob"] > _LOGPROB_FLOOR and entry["id"] < vocab:
                logprobs[entry["id"]] = entry["logprob"]
    return NextToken(logprobs, int(data["timings"]["prompt_n"]), float(data["timings"]["prompt_ms"]))


def _same_label(llama: NextToken, kvscope: NextToken, answers: dict) -> bool:
    """Whether the two engines' clean prefills pick the same label."""
    return (first_token_margin(llama.logprobs, answers) > 0) == (first_token_margin(kvscope.logprobs, answers) > 0)


def moved_case(
    lm: LoadedModel, server: LlamaServer, scenario: Scenario, values: dict, removed: Skill, seams: list[int], chunk: int, store: SkillStore
) -> dict:
    """The skill (and all after it) moved left by dropping a document placed before it in the previous request."""
    prompt = at_decision_point(render_for(lm, scenario, values))
    skill_id = next(iter(prompt.skill_spans))
    start = prompt.skill_spans[skill_id].start
    document = lm.tokenizer(unescape_braces(removed.text.strip()) + "\n\n", add_special_tokens=False).input_ids
    context, decode = list(prompt.context_ids), list(prompt.decode_ids)
    before = context[:start] + document + context[start:]
    vocab = lm.model.config.get_text_config().vocab_size
    next_token(server, before + decode, cache=False)
    reused = next_token(server, context + decode, cache=True, reuse_chunk=chunk, vocab=vocab)
    next_token(server, before + decode, cache=False)
    prefix_only = next_token(server, context + decode, cache=True, reuse_chunk=0, vocab=vocab)
    clean = next_token(server, context + decode, cache=False, vocab=vocab)
    answers = prompt.answer_ids
    llama = {
        f"reuse (chunk ≥ {chunk}, shift only)": fidelity(reused, clean, answers),
        "prefix match only": fidelity(prefix_only, clean, answers),
    }

    segments = list(prompt.context_segments)
    clean_logits, clean_ms = timed(lambda: Notebook.from_prompt(lm, prompt).read_prompt(prompt).next_token_logits)
    mine = NextToken.from_logits(clean_logits, len(context) + len(decode), clean_ms)
    previous = Notebook.prefill(lm, before, segments[:start] + ["document"] * len(document) + segments[start:]).materialized()
    tail = previous.block(positions=range(start + len(document), len(before)))
    shared = Notebook.prefill(lm, context[:start], segments[:start]).materialized()  # the prefix a server has cached
    kvscope = {}
    for seam in seams:
        applied = min(seam, len(tail))
        logits, ms = timed(lambda: shared.splice(tail, seam=applied).read_prompt(prompt).next_token_logits)
        state = NextToken.from_logits(logits, applied + len(decode), ms)
        kvscope[f"move, seam {seam}"] = fidelity(state, mine, answers, (logits, clean_logits))
    for remedy in dict.fromkeys([Remedy(seam=seam) for seam in seams] + [DEFAULT_REMEDY]):
        for skill in scenario.skills.values():
            store.get(lm, skill, {name: prompt.values[name] for name in skill.fields}, scenario.system if remedy.prefix else None)

        def spliced() -> tuple[torch.Tensor, int]:
            built = splice_prompt(lm, scenario, prompt, store, remedy)
            computed = len(context) - built.skill_tokens + built.recomputed_tokens + len(decode)
            return built.notebook.read_prompt(prompt).next_token_logits, computed

        (logits, evaluated), ms = timed(spliced)
        kvscope[f"compiled skill, {remedy.name}"] = fidelity(
            NextToken.from_logits(logits, evaluated, ms), mine, answers, (logits, clean_logits)
        )
    return {
        "case": "moved",
        "scenario": scenario.name,
        "values": values,
        "skill": skill_id,
        "removed": removed.id,
        "moved_by": len(document),
        "context_tokens": len(context),
        "llama_cpp": llama,
        "kvscope": kvscope,
        "engines_agree_on_clean": _same_label(clean, mine, answers),
    }


def edit_case(lm: LoadedModel, server: LlamaServer, scenario: Scenario, chunk: int) -> dict:
    """The field changed in place after a request with the old value."""
    experiment = EditExperiment(lm, scenario)
    old, new = at_decision_point(experiment.prompt), at_decision_point(experiment.new_prompt)
    erratum = experiment.line_ids(experiment.settings.erratum)
    answers, vocab = old.answer_ids, lm.model.config.get_text_config().vocab_size
    before, after, decode = list(old.context_ids), list(new.context_ids), list(old.decode_ids)
    next_token(server, before + decode, cache=False)
    reused = next_token(server, after + decode, cache=True, reuse_chunk=chunk, vocab=vocab)
    next_token(server, before + decode, cache=False)
    appended = next_token(server, before + erratum + decode, cache=True, reuse_chunk=chunk, vocab=vocab)
    clean = next_token(server, after + decode, cache=False, vocab=vocab)
    llama = {f"reuse (chunk ≥ {chunk}, shift only)": fidelity(reused, clean, answers), "erratum": fidelity(appended, clean, answers)}

    report = experiment.report(["field_only", "erratum", "full_downstream"])
    oracle = report.oracle.notebook.read_prompt(new).next_token_logits
    mine = NextToken.from_logits(oracle, len(after) + len(decode), report.oracle.ms)
    kvscope = {}
    for name, result in report.strategies.items():
        if name in ("field_only", "erratum", "full_downstream") and result.applicable:
            logits = result.notebook.read_prompt(old).next_token_logits
            computed = NextToken.from_logits(logits, result.tokens_recomputed + len(decode), result.ms)
            kvscope[name] = fidelity(computed, mine, answers, (logits, oracle))
    return {
        "case": "edit",
        "scenario": scenario.name,
        "field": experiment.field,
        "old": experiment.old,
        "new": experiment.new,
        "context_tokens": len(after),
        "llama_cpp": llama,
        "kvscope": kvscope,
        "engines_agree_on_clean": _same_label(clean, mine, answers),
    }


def run(lm: LoadedModel, server: LlamaServer, names: list[str], skill: Skill, removed: Skill, seams: list[int], chunk: int) -> list[dict]:
    """Both cases for each bundled scenario (``skill`` placed at the start of one that places none), both values."""
    store, cases = SkillStore(), []
    for name in names:
        scenario = Scenario.load(bundled_scenarios()[name])
        placed = scenario if scenario.skills else with_skills(scenario, [skill.id], "start")
        field = next(iter(scenario.fields.values()))
        for value in (field.old, field.new):
            cases.append(moved_case(lm, server, placed, {field.name: value}, removed, seams, chunk, store))
        cases.append(edit_case(lm, server, scenario, chunk))
        for case in cases[-3:]:
            errors = {arm: row["margin_error"] for arm, row in {**case["llama_cpp"], **case["kvscope"]}.items()}
            print(case["case"], name, case.get("values", case.get("new")), errors)
    return cases


def main(argv: list[str] | None = None) -> dict:
    parser = common.parser(__doc__)
    parser.add_argument("--scenarios", default="keystone_safety,refund_gate,machine_safety")
    parser.add_argument("--skill", default="refund_policy", help="skill placed at the start of a scenario that places none (moved case)")
    parser.add_argument("--removed", default="tone_guide", help="skill whose text the previous request had before the scenario's skill")
    parser.add_argument("--seams", default="0,1,4,16")
    parser.add_argument("--chunk", type=int, default=16, help="llama-server n_cache_reuse: the shortest chunk it shifts")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--server", default=str(SERVER_BINARY))
    parser.add_argument("--out", default=str(results_dir(__file__)), help="folder for the JSON")
    args = parser.parse_args(argv)
    lm = common.load(args)
    log = Path(tempfile.gettempdir()) / "kvscope-cache_reuse-llama-server.log"
    seams = [int(seam) for seam in args.seams.split(",")]
    with LlamaServer(Path(args.server), embedded_gguf(), 4096, args.threads, log, reuse_chunk=args.chunk) as server:
        cases = run(
            lm,
            server,
            args.scenarios.split(","),
            Skill.load(bundled_skills()[args.skill]),
            Skill.load(bundled_skills()[args.removed]),
            seams,
            args.chunk,
        )
        settings = server.settings()
    data = {"llama_server": settings, "chunk": args.chunk, "seams": seams, "cases": cases}
    print("→", write_result("cache_reuse", lm, data, Path(args.out)))
    return data


if __name__ == "__main__":
    main()
