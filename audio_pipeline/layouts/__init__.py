"""Model families' speech-token layouts: prompts, token rules, and the manifest that names them."""
