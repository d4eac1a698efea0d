"""A scenario as token ids: every piece tokenized on its own and the pieces concatenated, so field spans are exact by
construction; through the tokenizer's chat template where it has one."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from dataclasses import field as dataclass_field

from transformers import PreTrainedTokenizerBase

from kvscope.engine.scenario.files import Scenario
from kvscope.engine.scenario.text import ScenarioError, context_chunks, split_template

_SEPARATOR = "\n\n"
_PLAIN_ANSWER_CUE = "\nAnswer:"
_CONTEXT_SENTINEL = "KVSCOPEcontextSENTINEL"
_QUESTION_SENTINEL = "KVSCOPEquestionSENTINEL"


@dataclass(frozen=True)
class Span:
    """Token indices [start, end) into `RenderedPrompt.context_ids`."""

    start: int
    end: int

    def __len__(self) -> int:
        return self.end - self.start


@dataclass(frozen=True)
class RenderedPrompt:
    """A scenario as token ids: the cached context, the decode-time tokens and the answers to score."""

    context_ids: tuple[int, ...]
    context_segments: tuple[str, ...]
    field_spans: dict[str, Span]
    decode_ids: tuple[int, ...]
    answer_ids: dict[str, tuple[tuple[int, ...], ...]]
    values: dict[str, str]
    skill_spans: dict[str, Span] = dataclass_field(default_factory=dict)  # skill id -> its tokens (fields inside)


def context_text(scenario: Scenario, values: Mapping[str, str] | None = None) -> str:
    """The scenario's context as plain text: field ``values`` (old values by default) and skill texts filled in."""
    filled = scenario.values_with(**(values or {}))

    def fill(template: str) -> str:
        texts, names = split_template(template)
        return "".join(text + filled[name] for text, name in zip(texts, names)) + texts[-1]

    return "".join(fill(scenario.skills[text].text if kind == "skill" else text) for kind, text in context_chunks(scenario.context))


def render(
    scenario: Scenario,
    tokenizer: PreTrainedTokenizerBase,
    values: Mapping[str, str] | None = None,
    *,
    max_tokens: int | None = None,
    appended: Sequence[tuple[int, str]] = (),
) -> RenderedPrompt:
    """Tokenize `scenario` with field `values` (old values by default), through the chat template if any;
    ``appended`` (token id, segment) pairs follow the context, before the question (e.g. an image's tokens)."""
    filled = scenario.values_with(**(values or {}))
    chat = bool(getattr(tokenizer, "chat_template", None))
    if chat:
        head, separator, tail = _chat_frame(scenario, tokenizer)
        answer_prefix = ""
    else:
        head = scenario.system + _SEPARATOR if scenario.system else ""
        separator, tail, answer_prefix = _SEPARATOR, _PLAIN_ANSWER_CUE, " "

    ids: list[int] = []
    segments: list[str] = []

    def add(text: str, segment: str) -> None:
        piece = encode(tokenizer, text)
        ids.extend(piece)
        segments.extend([segment] * len(piece))

    add(head, "template")
    bos = tokenizer.bos_token_id
    if _adds_bos(tokenizer) and ids[:1] != [bos]:
        ids.insert(0, bos)
        segments.insert(0, "template")

    spans: dict[str, Span] = {}
    skill_spans: dict[str, Span] = {}

    def add_template(template: str, segment: str) -> None:
        texts, names = split_template(template)
        for text, name in zip(texts[:-1], names, strict=True):
            lead = " " if text.endswith(" ") else ""
            add(text.removesuffix(" ") if lead else text, segment)
            start = len(ids)
            add(lead + filled[name], f"field:{name}")
            if len(ids) == start:
                raise ScenarioError(f"field {name!r}: value {filled[name]!r} tokenizes to nothing with this tokenizer")
            spans[name] = Span(start, len(ids))
        add(texts[-1], segment)

    for kind, text in context_chunks(scenario.context):
        if kind == "skill":
            start = len(ids)
            add_template(scenario.skills[text].text, f"skill:{text}")
            skill_spans[text] = Span(start, len(ids))
        else:
            add_template(text, "context")
    ids.extend(token for token, _ in appended)
    segments.extend(segment for _, segment in appended)
    add(separator, "template")

    decode_ids = tuple(encode(tokenizer, scenario.question + tail))
    answer_ids: dict[str, tuple[tuple[int, ...], ...]] = {}
    for label, surfaces in scenario.answers.items():
        encoded = []
        for surface in surfaces:
            answer = tuple(encode(tokenizer, answer_prefix + surface))
            if not answer:
                raise ScenarioError(f"answer {surface!r} (label {label!r}) tokenizes to nothing with this tokenizer")
            encoded.append(answer)
        answer_ids[label] = tuple(encoded)

    if max_tokens is not None:
        _check_length(len(ids), sum(len(s) for s in spans.values()), len(decode_ids), answer_ids, max_tokens)
    return RenderedPrompt(
        context_ids=tuple(ids),
        context_segments=tuple(segments),
        field_spans=spans,
        decode_ids=decode_ids,
        answer_ids=answer_ids,
        values=filled,
        skill_spans=skill_spans,
    )


def encode(tokenizer: PreTrainedTokenizerBase, text: str) -> list[int]:
    """Token ids of `text` without special tokens added."""
    return list(tokenizer(text, add_special_tokens=False).input_ids) if text else []


def _adds_bos(tokenizer: PreTrainedTokenizerBase) -> bool:
    """Whether the tokenizer prepends its BOS token when special tokens are added."""
    bos = tokenizer.bos_token_id
    return bos is not None and tokenizer("a").input_ids[:1] == [bos]


def _chat_frame(scenario: Scenario, tokenizer: PreTrainedTokenizerBase) -> tuple[str, str, str]:
    """The chat template's text before the context, between context and question, and after the question."""
    messages = [{"role": "system", "content": scenario.system}] if scenario.system else []
    messages.append({"role": "user", "content": _CONTEXT_SENTINEL + _SEPARATOR + _QUESTION_SENTINEL})
    try:
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    except Exception as e:  # jinja errors of arbitrary templates, e.g. "system role not supported"
        raise ScenarioError(f"the tokenizer's chat template failed on this scenario: {e}") from e
    if text.count(_CONTEXT_SENTINEL) != 1 or text.count(_QUESTION_SENTINEL) != 1:
        raise ScenarioError("the tokenizer's chat template does not render the user message exactly once")
    head, rest = text.split(_CONTEXT_SENTINEL)
    separator, tail = rest.split(_QUESTION_SENTINEL)
    return head, separator, tail


def _check_length(context: int, fields: int, decode: int, answer_ids: dict[str, tuple[tuple[int, ...], ...]], limit: int) -> None:
    """Raise when context + decode tokens + the longest answer exceed `limit`, naming the longest part."""
    answer = max(len(ids) for surfaces in answer_ids.values() for ids in surfaces)
    total = context + decode + answer
    if total <= limit:
        return
    parts = {"context": context, "question and assistant header": decode, "longest answer": answer}
    longest = max(parts, key=parts.__getitem__)
    raise ScenarioError(
        f"rendered prompt is {total} tokens, over the limit of {limit}: context {context} "
        f"(field values {fields}), question and assistant header {decode}, longest answer {answer}; "
        f"the {longest} is the longest part"
    )
