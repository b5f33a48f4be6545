"""The agent demo's reward, in a file of its own: ``reward.custom_function`` loads it by path."""


def compute_score(solution_str: str, ground_truth: str, **kwargs) -> dict:
    """1 when the response's last line (the final answer, after any tool turns) is the product."""
    answer = solution_str.strip().split("\n")[-1].strip()
    correct = answer == str(ground_truth)
    return {"score": 1.0 if correct else 0.0, "acc": correct}
