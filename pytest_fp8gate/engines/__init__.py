"""The engines: vLLM in-process, a served endpoint, and what runs beside them."""
