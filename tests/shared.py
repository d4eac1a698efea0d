"""Test data shared across test packages."""
from dataclasses import replace

from engine.scenario import Scenario, bundled_scenarios

# A line the tiny tokenizer knows well (from its training corpus): about 20 tokens.
FILLER = "Ticket 7 says the package is late. Ticket 8 says the item arrived damaged and asks for a refund.\n"


def long_scenario(tokenizer, tokens: int, name: str = "request_id_control") -> Scenario:
    """A bundled scenario padded to about ``tokens`` context tokens: filler lines before and after its context
    (so its field sits in the middle, with prefix and notes on both sides)."""
    scenario = Scenario.load(bundled_scenarios()[name])
    lines = tokens // len(tokenizer(FILLER, add_special_tokens=False).input_ids)
    half = FILLER * (lines // 2)
    return replace(scenario, context=half + scenario.context + half)


# A scenario whose field values are one token each in the tiny tokenizer, so in-place edits apply.
SAME_LENGTH_SCENARIO = '''
name = "Refund test"
description = "Order status decides the refund."
context = """
SESSION
order_status: {order_status}
POLICY
Refunds are approved only when order_status is pending.
"""
question = "Should the refund be approved? Answer yes or no."

[fields.order_status]
old = "shipped"
new = "pending"

[answers]
yes = ["yes", "Yes"]
no = ["no", "No"]
'''
