"""Structured outputs: what a request constrains its text to (params.py, plain data), the
grammar compiler and per-request matchers (compiler.py, llguidance), and the tool-call
schemas and parsers of the chat API (tools.py, tool_parsers.py)."""
from pagedserve.structured.params import StructuredOutputsParams

__all__ = ["StructuredOutputsParams"]
