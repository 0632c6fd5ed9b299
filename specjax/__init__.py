"""specjax: speculative decoding for LLMs in JAX, with vLLM's offline API."""
