"""core-rl's GGUF plugin: the model source named ``gguf``, which turns a ``.gguf`` file named as a
``model_path`` or ``tokenizer_path`` into a cached Hugging Face directory."""
