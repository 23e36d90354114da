"""The proposer seam: anything that guesses a request's next tokens cheaply."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import numpy as np

from radixserve.core.request import Request


class Proposer(Protocol):
    """Guesses up to ``limits[i]`` next tokens of ``requests[i]``.

    Invariant: a proposal is a deterministic function of the request's tokens so far (its
    ``all_token_ids``), returned as an int32 array of length 0..limits[i]; the verify rule
    treats it as a point mass (q(d) = 1 for the proposed token), which is what makes
    sampled outputs exact in distribution.
    """

    def propose(self, requests: Sequence[Request], limits: Sequence[int]) -> list[np.ndarray]: ...
