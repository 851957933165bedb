"""Aggregation of run folders into tidy tables, figures as pure functions, and the HTML report."""
