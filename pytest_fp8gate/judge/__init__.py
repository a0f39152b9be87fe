"""Verdicts from the record: comparisons computed once, the rules applied."""
