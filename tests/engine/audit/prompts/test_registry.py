"""Each extension of the audit's text side is one registry entry: a repair (its level, line, request and K/V
operation), a request format, a usage shape; every list the CLI, app and docs read is derived from the entries."""

from kvscope.engine.audit.logs import formats, usage
from kvscope.engine.audit.prompts.repair_requests import PROMPT_REPAIRS, REGISTRY, REPAIR_LEVELS, REPAIRS, Level
from kvscope.engine.edit.strategies import REGISTRY as STRATEGIES


def test_every_repair_is_one_entry_with_its_level_line_request_and_operation():
    assert REPAIRS == tuple(REGISTRY) == ("recompute", "field_only", "erratum", "field_erratum", "hoist", "coarsen")
    for name, repair in REGISTRY.items():
        assert REPAIR_LEVELS[name] is repair.level and callable(repair.build)
        assert (repair.rewrite is not None) == (repair.level is Level.PROMPT) == (name in PROMPT_REPAIRS)
        assert bool(repair.summary) != (repair.strategy is not None)  # its own line, or its strategy's
        assert repair.strategy is None or repair.strategy in STRATEGIES


def test_every_request_format_and_usage_shape_is_one_entry():
    samples = {
        "sharegpt": {"conversations": [{"from": "human", "value": "hi"}]},
        "anthropic": {"system": "s", "messages": [{"role": "user", "content": "hi"}]},
        "openai_chat": {"messages": [{"role": "user", "content": "hi"}]},
        "openai_responses": {"input": "hi"},
        "openai_completions": {"prompt": "hi"},
    }
    assert {name: formats.detect(request) for name, request in samples.items()} == {name: name for name in samples}
    assert formats.FORMATS == {name: entry.description for name, entry in formats.REQUEST_FORMATS.items()}
    answers = {
        "llama_server": {"timings": {"cache_n": 3, "prompt_n": 5}},
        "openrouter": {"data": {"native_tokens_cached": 2, "native_tokens_prompt": 9}},
        "anthropic": {"usage": {"input_tokens": 4, "cache_read_input_tokens": 6}},
        "openai": {"usage": {"prompt_tokens": 9, "prompt_tokens_details": {"cached_tokens": 7}}},
    }
    found = {name: usage.response_usage(answer)[1] for name, answer in answers.items()}
    assert found == {name: name for name in answers}
    assert [usage.observed_usage(*usage.response_usage(answer)).cached for answer in answers.values()] == [3, 2, 6, 7]
    assert set(usage.SHAPES) == {"openai", "anthropic", "openrouter", "langfuse", "helicone", "otel", "llama_server"}
