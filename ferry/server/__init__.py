"""The OpenAI-compatible HTTP server (`ferry serve`): see app.py for the way a request takes."""
