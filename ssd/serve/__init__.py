"""The serving core: the GenerationService both front ends adapt, and the gRPC front end
(protos/ssd/v1/generation.proto). The OpenAI-compatible HTTP API sits above it in ssd.openai,
which this package never imports.

protos.py     compiles the .proto into _proto/ on first use (generated, not committed)
options.py    ServeOptions: bind address, token, TLS, request limits
backend.py    the Backend protocol and LocalBackend (load_pair + one engine per spec)
request.py    Request: the front-end-neutral request (plain dataclasses) both front ends build
validation.py Request -> GenerationRequest, or InvalidArgument naming the field (one check for both)
service.py    GenerationService: backend + worker, health, validate and submit, rounds and result,
              abort, model info, stats, all as plain data; both front ends adapt it
worker.py     continuous batching (or one at a time): FIFO admission, cancel/abort
streaming.py  text deltas that stay consistent with the final text
metrics.py    server-wide counters; a prometheus_client registry per server (/metrics, Stats)
auth.py       bearer-token interceptor (health and reflection stay open)
convert.py    ssd.v1 GenerateRequest -> Request; the service's answers -> ssd.v1 messages
server.py     GenerationServicer (the gRPC adapter) and GenerationServer (health, reflection, TLS, lifecycle)
client.py     GenerationClient, used by launch/client.py and the tests
"""
