"""Prompt-cache residency tiers: the RAM prompt cache and the .mlxkv SSD tier behind it."""
