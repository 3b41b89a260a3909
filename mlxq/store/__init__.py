"""Prompt-cache residency tiers: RAM LRU and the .mlxkv SSD tier (grows with the residency issue)."""
