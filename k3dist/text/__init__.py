"""Text in, text out: tokenizers, chat templates, request files, streamed detokenizing, the twin's tokenizer."""
