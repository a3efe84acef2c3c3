"""The Hugging Face format: `convert` maps dsslm's tensors and config to a Llama/Qwen3 model's and
back, `folder` reads and checks a folder (`run.init_from=hf:DIR`), `write` writes one (the export).
The CLIs stay `python -m dsslm.export` and friends, thin over these."""
