"""Sluice engine: models, paged KV cache, scheduler and sampling, with an in-process API."""
