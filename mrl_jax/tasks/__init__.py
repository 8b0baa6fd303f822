"""Verifiable tasks (generators + exact verifiers), local datasets, verifiers, and the isolated reward API.

Built-in tasks are deterministic from a seed, split into disjoint train / held-out prompts, and carry a
task token in every prompt text (``"add:12+47="``, ``"rev:abc="``, ``"fact:q7="``) so one model can
condition on it in a :class:`MixtureTask`. Only numpy and the standard library are imported here.
"""
from .arith import ARITH_OPS, ArithmeticTask
from .base import (
    ID_BLOCK,
    MixtureTask,
    Prompt,
    SFTExample,
    Task,
    exact_match,
    filter_prompts,
    hash_unit,
)
from .dataset import DatasetError, DatasetTask, load_local_dataset
from .facts import FactTableTask, default_mixture
from .jsonl import (
    JsonlFormatError,
    JsonlTask,
    answers_match,
    extract_answer,
    extract_boxed,
    extract_hash,
    extract_last_number,
    load_jsonl,
    parse_number,
)
from .rewards import (
    FAILURE_KINDS,
    RewardFailure,
    RewardScorer,
    RewardSpec,
    ScoreResult,
    gate_success,
    score_batch,
    task_reward,
)
from .reward_funcs import Completion, build_reward_specs, resolve_function
from .verifiers import VERIFIERS, Verifier, VerifierReward, get_verifier
from .strings import STRING_OPS, StringTask

__all__ = [
    "ARITH_OPS",
    "ArithmeticTask",
    "Completion",
    "DatasetError",
    "DatasetTask",
    "VERIFIERS",
    "Verifier",
    "VerifierReward",
    "build_reward_specs",
    "gate_success",
    "get_verifier",
    "load_local_dataset",
    "resolve_function",
    "FAILURE_KINDS",
    "FactTableTask",
    "ID_BLOCK",
    "JsonlFormatError",
    "JsonlTask",
    "MixtureTask",
    "Prompt",
    "RewardFailure",
    "RewardScorer",
    "RewardSpec",
    "SFTExample",
    "STRING_OPS",
    "ScoreResult",
    "StringTask",
    "Task",
    "answers_match",
    "default_mixture",
    "exact_match",
    "extract_answer",
    "extract_boxed",
    "extract_hash",
    "extract_last_number",
    "filter_prompts",
    "hash_unit",
    "load_jsonl",
    "parse_number",
    "score_batch",
    "task_reward",
]
