"""asyncengine: an asyncio-first LLM inference and serving engine.

    from asyncengine import LLM, SamplingParams
    llm = LLM()                       # the small default model shipped with the package
    llm.generate(["ROMEO:"], SamplingParams(max_tokens=32))
"""

from asyncengine.config import EngineConfig, default_model_path
from asyncengine.engine import LLMEngine
from asyncengine.llm import LLM
from asyncengine.outputs import CompletionOutput, Logprob, RequestOutput
from asyncengine.sampling_params import RequestOutputKind, SamplingParams

__version__ = "0.1.0"

__all__ = [
    "LLM",
    "LLMEngine",
    "EngineConfig",
    "SamplingParams",
    "RequestOutputKind",
    "RequestOutput",
    "CompletionOutput",
    "Logprob",
    "default_model_path",
    "__version__",
]
