"""Text <-> token ids, below both the model loader and the engine: FastTokenizer (a
generic fast tokenizer read without transformers), PromptEncoder (per-thread copies, chat
templates, tools written into the prompt) and IncrementalDetokenizer (streamed text, stop
strings). Imports nothing of hotprefix but errors and sampling_params."""
