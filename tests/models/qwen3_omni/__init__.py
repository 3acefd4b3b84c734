"""Tests of the Qwen3-Omni model code."""
