"""Test data shared across test packages."""

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
