"""Qwen3-Omni (thinker, talker, code2wav) model code."""
