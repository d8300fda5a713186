"""HTTP server, OpenAI protocol, tokenizer workers and detokenizer."""
