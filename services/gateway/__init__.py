"""The OpenAI-compatible HTTP front door: request models, errors, response shapes."""
