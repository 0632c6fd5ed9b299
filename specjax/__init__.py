"""specjax: speculative decoding for LLMs in JAX, with vLLM's offline API.

    from specjax import LLM, SamplingParams
    llm = LLM(speculative_config={"method": "ngram", "num_speculative_tokens": 4})
    print(llm.generate("Hello", SamplingParams(temperature=0.0, max_tokens=32))[0].outputs[0].text)
"""
from specjax.functional import make_generate_fn
from specjax.llm import LLM
from specjax.outputs import CompletionOutput, Logprob, RequestOutput
from specjax.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "Logprob", "make_generate_fn"]
