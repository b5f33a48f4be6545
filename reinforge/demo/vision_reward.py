"""The vision demo's reward, in a file of its own: ``reward.custom_function`` loads it by path."""


def compute_score(solution_str: str, ground_truth: str, **kwargs) -> dict:
    """1 when the response is the count of red squares, nothing else."""
    correct = solution_str.strip() == str(ground_truth)
    return {"score": 1.0 if correct else 0.0, "acc": correct}
