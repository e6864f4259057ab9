"""Speculative decoding: drafters propose tokens, one target pass verifies them (docs/ARCHITECTURE.md)."""
from engine.spec.drafter import Drafter, Proposal
from engine.spec.speculator import Speculator, build_draft_kv, build_speculator

__all__ = ["Drafter", "Proposal", "Speculator", "build_draft_kv", "build_speculator"]
