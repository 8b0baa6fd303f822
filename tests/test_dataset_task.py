"""The dataset task (local files through `datasets`) and reward functions named in a run config."""
import json

import numpy as np
import pytest

pytest.importorskip("datasets")
pytest.importorskip("math_verify")
import datasets  # noqa: E402

from mrl_jax.tasks import (DatasetError, DatasetTask, Prompt, RewardScorer, build_reward_specs,  # noqa: E402
                           gate_success)
from tests import reward_fixtures  # noqa: E402

ROWS = [{"question": f"What is {i} + {i}?", "solution": f"\\boxed{{{2 * i}}}", "level": 1 + i % 3}
        for i in range(12)]


def write(tmp_path, kind, rows=ROWS):
    ds = datasets.Dataset.from_list(rows)
    if kind == "parquet":
        path = tmp_path / "d.parquet"
        ds.to_parquet(str(path))
    elif kind == "jsonl":
        path = tmp_path / "d.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    elif kind == "csv":
        path = tmp_path / "d.csv"
        ds.to_csv(str(path), index=False)
    else:
        path = tmp_path / "saved"
        datasets.DatasetDict({"train": ds, "test": ds.select(range(3))}).save_to_disk(str(path))
    return path


@pytest.mark.parametrize("kind", ["parquet", "jsonl", "csv", "disk"])
def test_formats_load_the_same_prompts(tmp_path, kind):
    task = DatasetTask(write(tmp_path, kind), prompt_field="question", answer_field="solution",
                       eval_split="test" if kind == "disk" else None, eval_fraction=0.0 if kind == "disk" else 0.5)
    train, ev = task.train_prompts(), task.eval_prompts()
    assert {p.text for p in train} | {p.text for p in ev} >= {r["question"] for r in ROWS}
    assert ev and train and not {p.id for p in train} & {p.id for p in ev}
    p = train[0]
    assert p.meta["columns"]["level"] == ROWS[p.meta["row"]]["level"]
    assert task.verify(p, f"so \\boxed{{{2 * p.meta['row']}}}") == 1.0
    assert task.verify(p, "\\boxed{-1}") == 0.0
    again = DatasetTask(write(tmp_path, kind), prompt_field="question", answer_field="solution",
                        eval_split="test" if kind == "disk" else None, eval_fraction=0.0 if kind == "disk" else 0.5)
    assert [(q.id, q.text) for q in again.train_prompts()] == [(q.id, q.text) for q in train]   # stable ids


def test_ids_follow_rows_and_eval_file(tmp_path):
    path = write(tmp_path, "jsonl")
    ev = tmp_path / "ev.jsonl"
    ev.write_text(json.dumps({"question": "q", "solution": "1", "level": 2}) + "\n")
    task = DatasetTask(path, prompt_field="question", answer_field="solution", eval_path=ev, id_base=1000)
    assert [p.id for p in task.train_prompts()] == list(range(1000, 1012))
    assert [p.id for p in task.eval_prompts()] == [1000 + 500_000]


def test_conversational_and_system_prompt(tmp_path):
    rows = [{"prompt": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "1+1?"}],
             "answer": "2"},
            {"prompt": [{"role": "user", "content": "2+2?"}], "answer": "4"}]
    path = tmp_path / "c.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    task = DatasetTask(path, system_prompt="Think step by step.")
    assert [p.text for p in task.train_prompts()] == ["Be brief.\n\n1+1?", "Think step by step.\n\n2+2?"]


@pytest.mark.parametrize("rows,kwargs,match", [
    (ROWS, {"prompt_field": "prompt"}, r"no column 'prompt' \(columns: \['question', 'solution', 'level'\]\)"),
    (ROWS, {"prompt_field": "question", "answer_field": "solution", "eval_fraction": 0.999999},
     "every row was held out"),
    ([{"prompt": {"a": 1}, "answer": "1"}], {}, "row 0: column 'prompt' must be a string"),
    ([{"prompt": [{"role": "assistant", "content": "x"}], "answer": "1"}], {}, "conversational"),
    ([{"prompt": "a", "answer": "1", "k": 3}, {"prompt": "b", "answer": "2", "k": 3}], {"id_field": "k"},
     "row 1: duplicate prompt id 3"),
])
def test_bad_input_one_line(tmp_path, rows, kwargs, match):
    path = tmp_path / "bad.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(DatasetError, match=match) as e:
        DatasetTask(path, **kwargs).train_prompts()
    assert "\n" not in str(e.value) and str(path) in str(e.value)


def test_empty_split_and_unknown_format(tmp_path):
    empty = tmp_path / "empty.parquet"
    datasets.Dataset.from_dict({"question": [], "solution": []}).to_parquet(str(empty))
    with pytest.raises(DatasetError, match="empty.parquet: the split has no rows"):
        DatasetTask(write(tmp_path, "jsonl"), prompt_field="question", answer_field="solution",
                    eval_path=empty).train_prompts()
    path = write(tmp_path, "disk")
    with pytest.raises(DatasetError, match="no split 'dev'"):
        DatasetTask(path, prompt_field="question", answer_field="solution", split="dev").train_prompts()
    (tmp_path / "x.txt").write_text("hi")
    with pytest.raises(DatasetError, match="set task.format"):
        DatasetTask(tmp_path / "x.txt").train_prompts()


def _prompts(tmp_path):
    task = DatasetTask(write(tmp_path, "jsonl"), prompt_field="question", answer_field="solution")
    return task, task.train_prompts()[:4]


def test_rewards_weighting_columns_none_and_metrics(tmp_path):
    task, prompts = _prompts(tmp_path)
    entries = [{"builtin": "accuracy", "weight": 1.0},
               {"function": "tests.reward_fixtures:length_bonus", "weight": 0.5},
               {"function": "tests.reward_fixtures:difficulty_gate", "weight": 2.0, "name": "gate"}]
    specs = build_reward_specs(entries, task, timeout_s=10.0)
    completions = [f"\\boxed{{{2 * p.meta['row']}}}" if k % 2 == 0 else "\\boxed{-5}" for k, p in enumerate(prompts)]
    ids = [[1, 2], [1], [1, 2, 3], []]
    reward_fixtures.CALLS.clear()
    with RewardScorer(specs) as scorer:
        res = scorer.score(prompts, completions, completion_ids=ids)
    acc = np.array([1.0, 0.0, 1.0, 0.0])
    length = 0.1 * np.array([2, 1, 3, 0])
    gate = np.array([np.nan if p.meta["columns"]["level"] == 1 else 1.0 for p in prompts])
    np.testing.assert_allclose(res.rewards, acc + 0.5 * length + np.nan_to_num(2.0 * gate), rtol=1e-6)
    np.testing.assert_array_equal(res.accuracy, acc)
    assert res.stats["rewards/gate/mean"] == 1.0 and res.stats["reward/gate/failures"] == 0
    np.testing.assert_allclose(res.stats["rewards/length_bonus/std"], np.std(length), rtol=1e-5)
    [got] = reward_fixtures.CALLS   # one call with the batch, as TRL makes it
    assert got["completions"] == completions and got["prompts"] == [p.text for p in prompts]
    assert got["level"] == [p.meta["columns"]["level"] for p in prompts]
    assert got["solution"] == [p.answer for p in prompts]


def test_success_is_the_verifier_not_the_weighted_sum():
    """A format bonus lifts a wrong answer over tau: SEE's reward is gated back below it, and a right
    answer with a length penalty is raised to tau."""
    rewards = np.array([1.5, 0.9, 0.3, 1.0], np.float32)
    accuracy = np.array([0.0, 1.0, 0.0, 1.0], np.float32)
    out = gate_success(rewards, accuracy, 1.0)
    assert (out >= 1.0).tolist() == [False, True, False, True]
    assert out[2] == rewards[2] and out[3] == rewards[3] and out[0] < 1.0
    np.testing.assert_array_equal(gate_success(rewards, None, 1.0), rewards)


def test_hidden_accuracy_and_failures_isolated(tmp_path):
    task, prompts = _prompts(tmp_path)
    specs = build_reward_specs([{"function": "tests.reward_fixtures:raises"},
                                {"function": "tests.reward_fixtures:hangs", "name": "slow"},
                                {"builtin": "format", "pattern": r"\\boxed\{\d+\}", "weight": 0.25}],
                               task, timeout_s=3.0)
    assert [(s.name, s.weight, s.success) for s in specs][-1] == ("accuracy", 0.0, True)
    assert [s.isolation for s in specs] == ["thread", "thread", "thread", "process"]   # math-verify: processes
    with RewardScorer(specs) as scorer:
        res = scorer.score(prompts[:2], [f"\\boxed{{{2 * prompts[0].meta['row']}}}", "nope"])
    assert res.stats["reward/raises/errors"] == 2 and res.stats["reward/slow/timeouts"] == 2
    np.testing.assert_allclose(res.rewards, [0.25, 0.0])
    np.testing.assert_array_equal(res.accuracy, [1.0, 0.0])


@pytest.mark.parametrize("entry,match", [
    ({"function": "tests.no_such_module:f"}, r"rewards\[0\].function': cannot import 'tests.no_such_module'"),
    ({"function": "tests.reward_fixtures:nope"}, "has no 'nope'"),
    ({"function": "tests.reward_fixtures:NOT_A_FUNCTION"}, "not a function"),
    ({"function": "no_colon"}, "is not 'package.module:function'"),
    ({"builtin": "style"}, "is not one of"),
    ({"builtin": "overlong"}, "needs max_length"),
    ({"builtin": "format", "regex": "x"}, "takes no"),
    ({"function": "tests.reward_fixtures:raises", "isolation": "fork"}, r"isolation': 'fork' is not"),
])
def test_reward_config_errors(tmp_path, entry, match):
    task, _ = _prompts(tmp_path)
    with pytest.raises(ValueError, match=match) as e:
        build_reward_specs([entry], task, timeout_s=1.0)
    assert "\n" not in str(e.value)


def test_overlong_penalty():
    from mrl_jax.tasks.reward_funcs import Completion, OverlongReward

    fn = OverlongReward(max_length=10, cache=4)
    p = Prompt(0, "q", "a", "t")
    got = [fn(p, Completion("x", [0] * n)) for n in (0, 6, 7, 8, 10, 11)]
    np.testing.assert_allclose(got, [0.0, 0.0, -0.25, -0.5, -1.0, -1.0])
