"""Personalised evaluation: the evaluator (also behind the Flower summaries) and the summary table."""

from lightning_fedmeta.evaluation.evaluator import Evaluator, Summary, blank_unevaluated
from lightning_fedmeta.evaluation.report import format_spread, format_summary

__all__ = ["Evaluator", "Summary", "blank_unevaluated", "format_spread", "format_summary"]
