"""Z-Image (diffusers' `ZImagePipeline`, e.g. Z-Image-Turbo): Qwen3 text encoder ->
single-stream DiT (`transformer.ZImageTransformer`) -> AutoencoderKL decoder
(`omnistage.models.autoencoder_kl.AutoencoderKLDecoder`). Text-to-image only."""
