"""Text: tokenizer and streaming detokenizer, chat templates, stop strings, tool-call parsing."""
