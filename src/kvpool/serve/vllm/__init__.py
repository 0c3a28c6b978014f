"""The `vllm` engine backend: the proxy and its conductor in front of unmodified vLLM OpenAI
servers (docs/serve.md, "kvpool in front of vLLM")."""
