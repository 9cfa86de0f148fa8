"""A checkpoint's own files read without its weights or transformers (config.json, tokenizer.json):
what the layouts, the models and the engine read of a model directory. Below every other package
but text and errors: the families' layouts read here, never from models/."""
