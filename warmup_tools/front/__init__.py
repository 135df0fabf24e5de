"""The OpenAI-compatible HTTP front beside tritonserver (``python -m warmup_tools front``).

Laid out like Triton's own OpenAI frontend and vLLM's ``entrypoints/openai``: :mod:`.settings` (every knob),
:mod:`.schemas` (the request and response models), :mod:`.engine` (the engine interface and its Triton
implementation over ``grpc.aio`` with tritonclient's protobuf messages), :mod:`.routers` (one module per endpoint
group), :mod:`.app` (the FastAPI application and its middleware) and :mod:`.server` (uvicorn, started and stopped).
The front holds no model state: every request goes to tritonserver.
"""
