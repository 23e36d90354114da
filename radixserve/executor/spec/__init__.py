"""Speculative decoding: proposers (who guesses the next tokens) and the verify rule (which
of the guesses the target model keeps). See docs/speculative.md."""

from radixserve.executor.spec.draft import DraftProposer
from radixserve.executor.spec.length import AdaptiveLength
from radixserve.executor.spec.ngram import NgramProposer
from radixserve.executor.spec.proposer import Proposer
from radixserve.executor.spec.verify import SpecPlan, verify

__all__ = ["AdaptiveLength", "DraftProposer", "NgramProposer", "Proposer", "SpecPlan", "verify"]
