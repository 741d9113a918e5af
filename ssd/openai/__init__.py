"""The OpenAI-compatible HTTP API (FastAPI + uvicorn, the `openai` extra) over the
GenerationService of ssd.serve, which never imports this package.

server.py     OpenAIServer: the gRPC server with this API beside it (options.http_port)
http.py       HttpServer: uvicorn in a thread of its own, on a socket bound here
app.py        OpenAIFrontend: the routers, their stores' file and gauges; create_app
common.py     what every router shares: ApiError, the gate (Api: token, body, model), lists
routes/       one router per API, each owning its store: completions.py (chat and
              completions), responses.py (responses, stored and background),
              conversations.py, batches.py (files and batches), models.py (models,
              tokenize), health.py (health, metrics, version, load)
store_file.py stored responses and conversations over a restart (--store-dir)
schema.py     OpenAI request bodies (pydantic) -> the neutral Request ssd.serve validates
calls.py      one request's answer: the service's events as OpenAI objects, whole or streamed
responses.py  the Responses API as the chat completion it means; stored.py: its stores
tools.py      tool calls in the model's own format; reasoning.py: <think> split from the answer
batches.py, files.py, batch_disk.py   the Batch API's lines and state, files, their disk copies
"""
