"""Measuring: one engine per model, its passes, the record and the baseline cache."""
