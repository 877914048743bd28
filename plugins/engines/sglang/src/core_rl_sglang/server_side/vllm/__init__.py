"""Not vLLM: the one function of ``vllm._custom_ops`` SGLang's generic CPU path imports, for SGLang
servers started by core-rl (this directory is put on the server's ``PYTHONPATH``)."""
