"""`specmlx serve`: an OpenAI-compatible HTTP server whose replies are decoded speculatively.

app.py      the routes: /v1/chat/completions, /v1/completions, /v1/models, /health
fields.py   a request body checked into settings
prompts.py  messages and prompts to token ids that match the caches
worker.py   the queue: one decode at a time, on one thread
pool.py     the Sessions kept between requests, within a memory budget
stops.py    stop strings, held back while streaming until they are ruled out
errors.py   OpenAI-shaped error bodies
"""

from .app import make_app
from .fields import Defaults

__all__ = ["Defaults", "make_app"]
