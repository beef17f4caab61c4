"""Load generation and figures for any OpenAI-compatible endpoint."""
