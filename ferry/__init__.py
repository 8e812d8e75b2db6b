"""ferry: a small, fast LLM inference engine with an OpenAI-compatible server."""

from ferry.logger import configure_logging
from ferry.sampling_params import RequestOutputKind, SamplingParams

configure_logging()

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "Logprob", "RequestOutputKind"]
__version__ = "0.1.0"


def __getattr__(name: str):
    # Importing ferry stays cheap (the server's and the tests' subprocesses import it often);
    # the engine comes in with the first use of LLM.
    if name == "LLM":
        from ferry.llm import LLM

        return LLM
    if name in ("RequestOutput", "CompletionOutput", "Logprob"):
        from ferry import outputs

        return getattr(outputs, name)
    raise AttributeError(f"module 'ferry' has no attribute {name!r}")
