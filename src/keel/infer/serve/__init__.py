"""`keel serve`: an OpenAI-compatible HTTP server with continuous batching and a web chat.

engine.py owns the model in one scheduler thread; app.py turns HTTP requests into engine
jobs; server.py wires both to uvicorn. Importing this package imports no web framework.
"""
