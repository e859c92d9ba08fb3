"""Text in and out (plain Python, no jax): `tokenizer` (HF tokenizers, chat templates, incremental detokenization) and
`helper` (the helper process that tokenizes long texts away from the serving process)."""
