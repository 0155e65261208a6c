"""``kvoffload bench serve``: an online benchmark of OpenAI-compatible servers and routers, with
``vllm bench serve``'s flags, metric definitions and JSON keys."""
