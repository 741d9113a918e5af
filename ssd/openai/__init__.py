"""The OpenAI-compatible HTTP API (FastAPI + uvicorn, the `openai` extra) over the
GenerationService of ssd.serve, which never imports this package.

server.py     OpenAIServer: the gRPC server with this API beside it (options.http_port)
http.py       the routes and the uvicorn thread that serves them
schema.py     OpenAI request bodies (pydantic) -> the neutral Request ssd.serve validates
calls.py      one request's answer: the service's events as OpenAI objects, whole or streamed
responses.py  the Responses API as the chat completion it means; stored.py: its stores
tools.py      tool calls in the model's own format; reasoning.py: <think> split from the answer
batches.py, files.py, batch_disk.py   the Batch API's lines and state, files, their disk copies
routes/       the Conversations API; the Files and Batch APIs
"""
