"""The markdown report and its plots, read from verdicts."""
