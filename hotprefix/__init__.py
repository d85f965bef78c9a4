"""hotprefix: an LLM inference server built around a shared, paged KV cache."""

from hotprefix.sampling_params import SamplingParams

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams", "__version__"]


def __getattr__(name: str):  # LLM pulls in torch; import it only when asked for
    if name == "LLM":
        from hotprefix.engine.llm import LLM

        return LLM
    raise AttributeError(name)
