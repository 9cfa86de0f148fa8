"""The engine core in a process of its own (``engine_process = subprocess``): the front end's
client (client.py), the core's process (worker.py) and what crosses between them (messages.py)."""
