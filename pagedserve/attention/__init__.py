"""Paged attention backends: write new K/V into the block pool by slot, attend through
each request's block table."""
