"""Built-in scorers; importing this package registers each under its data sources."""

from reinforge.reward.scorers import arithmetic, boxed, countdown, gsm8k, math_answer, math_dapo

__all__ = ["arithmetic", "boxed", "countdown", "gsm8k", "math_answer", "math_dapo"]
