"""reasoning-gym task: a three-dataset composite round-trips through each dataset's score_answer."""
import pytest

pytest.importorskip("reasoning_gym")
import reasoning_gym  # noqa: E402
from reasoning_gym.composite import DatasetSpec  # noqa: E402

from mrl_jax.tasks.reasoning_gym import ReasoningGymTask  # noqa: E402

MIX = {"leg_counting": 1.0, "basic_arithmetic": 1.0, "chain_sum": 2.0}


def test_composite_round_trips_through_score_answer():
    task = ReasoningGymTask(MIX, config={"chain_sum": {"min_terms": 2, "max_terms": 3}}, size=24, eval_size=12, seed=3)
    train, ev = task.train_prompts(), task.eval_prompts()
    assert len(train) == 24 and 0 < len(ev) <= 12
    assert {p.meta["dataset"] for p in train} == set(MIX)
    assert not {p.text for p in train} & {p.text for p in ev} and not {p.id for p in train} & {p.id for p in ev}
    ref = reasoning_gym.create_dataset("composite", datasets=[
        DatasetSpec(n, w, {"min_terms": 2, "max_terms": 3} if n == "chain_sum" else {}) for n, w in MIX.items()],
        size=24, seed=3)
    for p, entry in zip(train, ref):
        assert p.text == entry["question"]
        assert task.verify(p, f"Thinking...\n<answer>{entry['answer']}</answer>") == 1.0
        wrong = "not " + str(entry["answer"])
        assert task.verify(p, f"<answer>{wrong}</answer>") == ref.score_answer(wrong, entry) < 1.0
        assert task.answer_key(p, f"<answer> {entry['answer']} </answer>") == str(entry["answer"])
    again = ReasoningGymTask(MIX, config={"chain_sum": {"min_terms": 2, "max_terms": 3}}, size=24, eval_size=12,
                             seed=3)
    assert [(p.id, p.text) for p in again.train_prompts()] == [(p.id, p.text) for p in train]


def test_unknown_dataset_is_one_line():
    with pytest.raises(ValueError, match=r"'task.datasets.no_such_set': no reasoning-gym dataset 'no_such_set'"):
        ReasoningGymTask({"no_such_set": 1.0})
