"""`specmlx serve`: an OpenAI-compatible HTTP server whose replies are decoded speculatively.

app.py      the routes: /v1/chat/completions, /v1/completions, /v1/models[/{id}], /health;
            the body limit, the per-request log line
fields.py   a request body checked into settings, every OpenAI field named
prompts.py  messages and prompts to token ids that match the caches, client text as text
tools.py    tool calls found in a reply and parsed by mlx-lm's parser for the template
worker.py   the queue: one decode at a time, on one thread
pool.py     the Sessions kept between requests, within a memory budget
errors.py   OpenAI-shaped error bodies
"""

from .app import make_app
from .fields import Defaults

__all__ = ["Defaults", "make_app"]
