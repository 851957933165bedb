from evictlab.models.gpt import GPT, GPTConfig, PosEmb, apply_rope

__all__ = ["GPT", "GPTConfig", "PosEmb", "apply_rope"]
