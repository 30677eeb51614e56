"""The model: parallel layers, GPT, deterministic sharded init."""
