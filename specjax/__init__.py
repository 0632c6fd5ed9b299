"""specjax: speculative decoding for LLMs in JAX, with vLLM's offline API.

    from specjax import LLM, SamplingParams
    llm = LLM(speculative_config={"method": "ngram", "num_speculative_tokens": 4})
    print(llm.generate("Hello", SamplingParams(temperature=0.0, max_tokens=32))[0].outputs[0].text)

The public names load on first use: importing a submodule (as checkpoints_conv's loaders import the model
families) does not load the facade, which itself builds on those loaders.
"""
import importlib

_PUBLIC = {"LLM": "specjax.llm", "SamplingParams": "specjax.sampling_params", "RequestOutput": "specjax.outputs",
           "CompletionOutput": "specjax.outputs", "Logprob": "specjax.outputs",
           "make_generate_fn": "specjax.functional"}
__all__ = list(_PUBLIC)


def __getattr__(name: str):
    if name not in _PUBLIC:
        raise AttributeError(f"module 'specjax' has no attribute {name!r}")
    return getattr(importlib.import_module(_PUBLIC[name]), name)


def __dir__() -> list[str]:
    return sorted(list(globals()) + __all__)
