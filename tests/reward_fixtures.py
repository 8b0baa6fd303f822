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


BATCHES = []


def centred_length(prompts, completions, completion_ids, **kwargs):
    """Each completion's token count minus the batch's mean: a reward that needs the whole batch."""
    BATCHES.append(len(completions))
    mean = sum(len(ids) for ids in completion_ids) / len(completion_ids)
    return [len(ids) - mean for ids in completion_ids]


def raises_on_x(prompts, completions, **kwargs):
    """1.0 per completion; raises when any completion of the call contains 'x'."""
    CALLS.append({"prompts": prompts, "completions": completions})
    if any("x" in c for c in completions):
        raise ValueError("an x")
    return [1.0] * len(completions)
