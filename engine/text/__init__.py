"""Text in and out of the model: the tokenizer, chat templates, prompt encoding, reasoning blocks, the context overflow policies."""
