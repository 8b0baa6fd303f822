"""TRL-signature reward functions that tests name by import path (``tests.reward_fixtures:...``)."""
import time

CALLS = []


def length_bonus(prompts, completions, completion_ids, **kwargs):
    """0.1 per completion token; records the keyword columns it got."""
    CALLS.append({"prompts": prompts, "completions": completions, **kwargs})
    return [0.1 * len(ids) for ids in completion_ids]


def difficulty_gate(prompts, completions, completion_ids, level, **kwargs):
    """None (not applicable) for level-1 rows, else 1.0."""
    return [None if lv == 1 else 1.0 for lv in level]


def raises(prompts, completions, **kwargs):
    raise RuntimeError("user bug")


def hangs(prompts, completions, **kwargs):
    time.sleep(30)
    return [1.0]


NOT_A_FUNCTION = 3
