"""Deliberate bugs the suite must catch (the mutation check): `python -m tests.mutants` (docs/testing.md)."""
