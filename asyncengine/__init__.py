"""asyncengine: an asyncio-first LLM inference and serving engine.

    from asyncengine import LLM, SamplingParams
    llm = LLM()                       # the small default model shipped with the package
    llm.generate(["ROMEO:"], SamplingParams(max_tokens=32))
"""

from pathlib import Path as _Path

# kernels/, api/ and plugins/ are top-level folders that setuptools installs as asyncengine.kernels, .api and
# .plugins. Run from a source checkout (e.g. `python -m asyncengine` in the repository after a plain `pip install .`,
# where this folder shadows the installed package), find them beside this package too.
_checkout = _Path(__file__).resolve().parent.parent
if (_checkout / "pyproject.toml").is_file() and (_checkout / "kernels" / "__init__.py").is_file():
    __path__.append(str(_checkout))

from asyncengine.config import EngineConfig, default_model_path  # noqa: E402
from asyncengine.engine import LLMEngine  # noqa: E402
from asyncengine.llm import LLM  # noqa: E402
from asyncengine.outputs import CompletionOutput, Logprob, RequestOutput  # noqa: E402
from asyncengine.pooling_params import EmbeddingOutput, EmbeddingRequestOutput, PoolingParams  # noqa: E402
from asyncengine.sampling_params import (  # noqa: E402
    RequestOutputKind,
    SamplingParams,
    StructuredOutputsParams,
    ThinkingTokens,
)

__version__ = "0.1.0"

__all__ = [
    "LLM",
    "LLMEngine",
    "EngineConfig",
    "SamplingParams",
    "StructuredOutputsParams",
    "ThinkingTokens",
    "RequestOutputKind",
    "RequestOutput",
    "CompletionOutput",
    "Logprob",
    "PoolingParams",
    "EmbeddingOutput",
    "EmbeddingRequestOutput",
    "default_model_path",
    "__version__",
]
