"""Fixtures for tests and benchmarks, not for decoding: random proposals with a drafter's
structure (``random_proposal``) and a proposer that draws one every round (``random_proposer``),
which exercise every builder and verify rule through the real loop without a trained drafter.
"""
