"""The serving loop, written once: per-request state, the scheduler and its KV cache, the model
runner and its sampler, and the engine core that runs schedule -> run -> update."""
