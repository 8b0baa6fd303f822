"""Issue 60: reward functions with TRL's signature get the batch in one call; a failing call is retried one
completion at a time, so one bad completion scores 0 alone and counts as one failure."""

import json
import sys
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import support  # noqa: E402
from mrl_jax.tasks import Prompt, RewardScorer, RewardSpec  # noqa: E402
from mrl_jax.tasks.reward_funcs import TRLReward, build_reward_specs  # noqa: E402
from tests import reward_fixtures  # noqa: E402

PROMPTS = [Prompt(i, f"{i}+1=", str(i + 1), "add") for i in range(7)]
COMPLETIONS = ["1", "22", "333", "x", "4444", "55555", "6"]
IDS = [list(range(len(c))) for c in COMPLETIONS]


def _spec(path, **kw):
    return RewardSpec(TRLReward(path), name=path.rpartition(":")[2], low=-np.inf, high=np.inf, allow_none=True,
                      batched=True, **kw)


@pytest.fixture(autouse=True)
def _clear():
    reward_fixtures.CALLS.clear()
    reward_fixtures.BATCHES.clear()


@pytest.mark.parametrize("isolation", ["thread", "process"])
def test_a_batch_normalising_function_sees_the_whole_batch(isolation):
    with RewardScorer([_spec("tests.reward_fixtures:centred_length", isolation=isolation)]) as scorer:
        res = scorer.score(PROMPTS, COMPLETIONS, completion_ids=IDS)
    lengths = np.array([len(c) for c in COMPLETIONS], np.float32)
    np.testing.assert_allclose(res.per_function[:, 0], lengths - lengths.mean(), rtol=1e-6)
    if isolation == "thread":   # the worker process keeps its own module state
        assert reward_fixtures.BATCHES == [7]


def test_batch_size_cuts_the_batch_into_calls():
    with RewardScorer([_spec("tests.reward_fixtures:centred_length", batch_size=3)]) as scorer:
        scorer.score(PROMPTS, COMPLETIONS, completion_ids=IDS)
    assert reward_fixtures.BATCHES == [3, 3, 1]


@pytest.mark.parametrize("isolation", ["thread", "process"])
def test_one_raising_item_scores_0_alone_and_counts_once(isolation):
    with RewardScorer([_spec("tests.reward_fixtures:raises_on_x", isolation=isolation)]) as scorer:
        res = scorer.score(PROMPTS, COMPLETIONS)
    assert res.per_function[:, 0].tolist() == [1.0, 1.0, 1.0, 0.0, 1.0, 1.0, 1.0]
    assert res.stats["reward/raises_on_x/errors"] == 1 and res.stats["reward/raises_on_x/failures"] == 1
    [sample] = res.stats["reward/raises_on_x/failure_samples"]
    assert sample.startswith("[errors] item 3 (prompt id 3): ValueError: an x")
    if isolation == "thread":   # the batch, then each item alone
        assert [len(c["completions"]) for c in reward_fixtures.CALLS] == [7] + [1] * 7


def _hangs_on_h(prompts, completions):
    import time

    if any("h" in c for c in completions):
        time.sleep(5)
    return [0.5] * len(completions)


def _one_value_short(prompts, completions):
    return [0.5] * (len(completions) - 1) if len(completions) > 1 else [0.5]


def test_a_batch_past_its_limit_is_retried_item_by_item():
    spec = RewardSpec(_hangs_on_h, name="hangs", batched=True, timeout_s=0.2)
    with RewardScorer([spec]) as scorer:
        res = scorer.score(PROMPTS[:4], ["a", "b", "h", "c"])
    assert res.per_function[:, 0].tolist() == [0.5, 0.5, 0.0, 0.5]
    assert res.stats["reward/hangs/timeouts"] == 1 and res.stats["reward/hangs/failures"] == 1


def test_a_batch_answer_of_the_wrong_length_is_retried_item_by_item():
    with RewardScorer([RewardSpec(_one_value_short, name="short", batched=True)]) as scorer:
        res = scorer.score(PROMPTS, COMPLETIONS)
    assert res.per_function[:, 0].tolist() == [0.5] * 7 and res.stats["reward/short/failures"] == 0


@pytest.mark.parametrize("size", [0, -1, 2.5, "all", True])
def test_batch_size_not_a_whole_number_is_one_line_naming_the_key(size):
    entry = {"function": "tests.reward_fixtures:length_bonus", "batch_size": size}
    with pytest.raises(ValueError) as e:
        build_reward_specs([entry], None, timeout_s=1.0)
    assert str(e.value) == (f"config key 'rewards[0].batch_size': {size!r} is not a whole number >= 1; give "
                            "batch_size: 1 to call the function per completion, or leave it out for the batch")


def _records(out: Path) -> list[dict]:
    """metrics.jsonl without the wall-clock figures."""
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if not (k.startswith("time/") or k.endswith("time_s"))} for r in rows]


@pytest.mark.usefixtures("jax_compile_cache")
def test_a_per_item_function_trains_the_same_batched_and_per_item(tmp_path):
    from mrl_jax.trainer import train

    runs = {}
    for name, extra in (("batched", {}), ("per_item", {"batch_size": 1})):
        cfg = support.tiny_config(rounds=1, rewards=[{"builtin": "accuracy"}, {
            "function": "tests.reward_fixtures:length_bonus", "weight": 0.5, **extra}])
        reward_fixtures.CALLS.clear()
        train(support.to_run_config(cfg), tmp_path / name, progress=False)
        runs[name] = (_records(tmp_path / name), [len(c["completions"]) for c in reward_fixtures.CALLS])
    (batched, batch_calls), (per_item, item_calls) = runs["batched"], runs["per_item"]
    assert batched == per_item and batched[0]["reward/length_bonus/mean"] > 0
    assert set(item_calls) == {1} and len(batch_calls) < len(item_calls) == sum(batch_calls)
