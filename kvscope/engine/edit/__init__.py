"""The edit layer: one field change and its repairs (strategies), the reports they produce, calibration, weight edits."""
