"""Qwen-Image text-to-image (diffusers' `QwenImagePipeline` checkpoints): the MMDiT
(`transformer.py`) and the VAE decoder (`vae.py`); the text encoder is Qwen2.5-VL's LM."""
