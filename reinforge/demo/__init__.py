"""The one-command demo: a small model learns multi-digit arithmetic by GRPO, on a laptop CPU.

``task.py`` fixes the task and the demo model's shape, ``build.py`` makes the model from
scratch with the SFT trainer (``python -m reinforge.demo.build``), and ``runner.py`` runs GRPO
from the committed model and reports held-out accuracy before and after (``reinforge demo``).
"""
