"""The HTTP APIs (aiohttp), served beside the Unix socket by `ellmd start --http`: OpenAI's chat
completions and completions, OpenAI's Responses API and Anthropic's Messages API, on one runtime.

The parts, each importing only those above it:

    errors       ApiError, the HTTP status of each runtime error
    fields       a JSON body and its typed fields; sampling, text content, output format
    tools        tool calls in the model's format: forcing a call, parsing it, holding its markup back
    sse          server-sent event streams
    bridge       the runtime as the APIs reach it: rendering, generating, calling ops
    openai, responses, anthropic   one API each: its fields, its replies (none imports another)
    guard        who may reach the API: listen address, Host and Origin, API keys
    connections  the bound on connections
    site         HttpServer: the route table, the error middleware, /health and /metrics
"""
