"""radixserve: an LLM inference and serving engine."""

from radixserve.core.sampling_params import SamplingParams
from radixserve.engine.llm import LLM
from radixserve.engine.outputs import CompletionOutput, RequestOutput

__all__ = ["LLM", "CompletionOutput", "RequestOutput", "SamplingParams"]
__version__ = "0.1.0"
