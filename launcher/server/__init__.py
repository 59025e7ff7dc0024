"""`lockstep serve`: an OpenAI-compatible HTTP server in front of a DP group.

config.py          the server's settings (the `server:` section)
protocol.py        OpenAI request bodies -> validated generation requests
responses.py       replies and stream chunks in OpenAI's format
tokenization.py    the checkpoint's tokenizer, chat template, incremental detokenizing
frontend.py        the asyncio side of a client: routing, per-request streams, failures
metrics.py         Prometheus series: latencies and the ranks' counters
app.py             the aiohttp application and its lifetime (start, drain, stop)
serve.py           the command: configs, starting the group, signals
"""
