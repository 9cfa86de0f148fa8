"""Model families: each one's layout (prompts, token and frame rules) and its record in the registry; the manifest that names a model's family."""
