"""Configs that run but would not do what the user meant: a refusal (exit 2) or one warning line each."""

import json

import pytest

from mrl_jax import models
from mrl_jax.configs import ConfigError, from_dict
from mrl_jax.tokenization import Tokenizer, load_tokenizer, train_tokenizer
from mrl_jax.trainer.config import RunConfig
from support import one_device_policy

TINY = {"family": "llama", "hidden_size": 16, "num_layers": 1, "num_heads": 2, "num_kv_heads": 1}


def _warnings(err: str) -> list[str]:
    return [line for line in err.splitlines() if line.startswith("warning: config key")]


def test_one_generation_per_prompt_is_refused():
    with pytest.raises(ConfigError, match="config key 'num_generations': must be >= 2, got 1") as e:
        from_dict(RunConfig, {"policies": [{"name": "a"}], "num_generations": 1})
    assert "TRL" in str(e.value)


def _policy(spec: dict, tokenizer):
    run = from_dict(RunConfig, {"policies": [spec], "num_generations": 2})
    model = models.tiny_model("llama", tokenizer.vocab_size, seed=0, hidden_size=16, num_layers=1, num_heads=2,
                              num_kv_heads=1)
    return one_device_policy(run, tokenizer, model)[0]


def test_no_eos_and_no_stop_tokens_warns_once(capsys):
    trained = train_tokenizer("char", ["1+2=3", "abc"], 300)
    tok = Tokenizer(trained._hf, bos_id=trained.bos_id, pad_id=trained.pad_id)   # no EOS
    pol = _policy({"name": "a", "model": TINY}, tok)
    assert pol.sampling.eos_ids == ()
    lines = _warnings(capsys.readouterr().err)
    assert len(lines) == 1 and "policies.a.stop_tokens" in lines[0] and "no EOS" in lines[0]
    _policy({"name": "a", "model": TINY, "stop_tokens": [3]}, tok)
    assert _warnings(capsys.readouterr().err) == []


@pytest.mark.parametrize("name, eot", [("phi-3-mini", "<|end|>"), ("smollm2-135m", "<|im_end|>")])
@pytest.mark.parametrize("known", [True, False], ids=["known-turn-end", "unknown-turn-end"])
def test_chat_end_of_turn_outside_the_stop_set_warns(shared_tokenizers_dir, capsys, monkeypatch, name, eot, known):
    """A chat policy stops at its template's turn end when it is one of ``chat.TURN_END_TOKENS`` (Phi-3's
    ``<|end|>`` has no generation_config to name it); a turn end outside that list and the stop set is one
    warning line whose advice, followed, silences it."""
    from mrl_jax.tokenization import chat

    if not known:
        monkeypatch.setattr(chat, "TURN_END_TOKENS", ())
    folder = shared_tokenizers_dir / name
    tok = load_tokenizer(folder)
    spec = {"name": "c", "model": TINY, "tokenizer": {"path": str(folder)}, "prompt_format": "chat"}
    pol = _policy(spec, tok)
    assert pol.prompt_format.chat.end_of_turn() == eot
    warned = not known and tok.token_to_id(eot) != tok.eos_id   # SmolLM2's turn end is its EOS
    assert (tok.token_to_id(eot) in pol.sampling.eos_ids) != warned
    lines = _warnings(capsys.readouterr().err)
    assert len(lines) == int(warned)
    if warned:
        assert f"stop_tokens: ['{eot}']" in lines[0] and "policies.c.stop_tokens" in lines[0]
        _policy(dict(spec, stop_tokens=[eot]), tok)   # following the advice silences it
        assert _warnings(capsys.readouterr().err) == []


def test_more_eval_prompts_than_the_task_has_warns(capsys):
    from mrl_jax.trainer import Run

    cfg = from_dict(RunConfig, {"policies": [{"name": "a", "model": TINY, "sampling": {"max_new_tokens": 4},
                                              "tokenizer": {"kind": "char", "vocab_size": 300}}],
                                "task": {"name": "arith"}, "num_generations": 2, "eval_prompts": 500})
    run = Run(cfg)
    lines = _warnings(capsys.readouterr().err)
    assert lines == [f"warning: config key 'eval_prompts': 500, but the task has {len(run.eval_prompts)} held-out "
                     "prompts (after overlong_prompts); each evaluation uses those"]
    assert len(run.eval_prompts) == 200


def _gpt2_long_prompt_config(tmp_path, **policy):
    rows = [{"prompt": "x" * (280 + 3 * i) + f" {i}+1=", "answer": str(i + 1)} for i in range(30)]
    path = tmp_path / "long.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return from_dict(RunConfig, {
        "policies": [{"name": "g", "model": {"family": "gpt2", "hidden_size": 16, "num_layers": 1, "num_heads": 2},
                      "tokenizer": {"kind": "char", "vocab_size": 300}, "sampling": {"max_new_tokens": 6},
                      **policy}],
        "task": {"name": "jsonl", "path": str(path)}, "rounds": 1, "prompts_per_round": 2, "num_generations": 2,
        "eval_prompts": 2, "checkpoint_every": 1, "see": {"capacity": 16, "per_prompt_cap": 4}})


def test_gpt2_prompts_longer_than_half_its_positions_run(tmp_path):
    """~290-token prompts on GPT-2's 512 learned positions: the 512 bucket is cut to the prompt limit (506), so
    prompt + 6 new tokens fit."""
    from mrl_jax.trainer import train
    from mrl_jax.trainer.encoding import encode_prompts

    cfg = _gpt2_long_prompt_config(tmp_path)
    summary = train(cfg, tmp_path / "run", progress=False)
    assert summary["policies"]["g"]["eval"]["n"] == 2
    from mrl_jax.trainer import Run

    pol = Run(cfg).policies[0]
    ids, mask, _ = encode_prompts(pol.tokenizer, pol.prompt_format, ["x" * 290], max_width=pol.prompt_limit)
    assert pol.prompt_limit == 506 and ids.shape[1] == 506 and mask.sum() > 256


def test_max_prompt_length_beyond_the_positions_is_refused_at_start(tmp_path):
    from mrl_jax.trainer import Run

    with pytest.raises(ConfigError) as e:
        Run(_gpt2_long_prompt_config(tmp_path, max_prompt_length=10000))
    msg = str(e.value)
    assert "'policies.g.max_prompt_length': 10000 + sampling.max_new_tokens 6" in msg and "<= 506" in msg


@pytest.mark.parametrize("longest, limit", [(1, 5), (7, 7), (9, 12), (100, 130), (300, 506), (513, 1000)])
def test_prompt_width_is_a_bucket_cut_at_the_limit(longest, limit):
    from mrl_jax.sampler import bucket_length
    from mrl_jax.trainer.encoding import PROMPT_BUCKETS, encode_prompts

    tok = train_tokenizer("char", ["xy"], 300)
    ids, mask, _ = encode_prompts(tok, "{prompt}", ["x" * (longest - 1), "y"], max_width=limit)
    assert ids.shape[1] == min(bucket_length(longest, PROMPT_BUCKETS), limit)
    assert mask[0].sum() == longest and mask[0, -1]
