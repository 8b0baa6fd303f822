"""The MRL trainer end to end (issue "trainer"): a two-policy run of heterogeneous tiny models (Llama +
byte-level BPE, GPT-2 + Unigram) completes under every probe and writes its metrics, samples, summary and
checkpoints; the CLI verbs around it (train, eval, config-help); the experiment configs load; the pieces
of the loop (round prompts, logs, checkpointer) on their own.

Same tiny shapes as tests/test_reliability.py (experiments/configs/tiny_two_policy.yaml) and the same
persistent compilation cache, so the two modules share compiled computations.
"""

import json
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import support  # noqa: E402
from mrl_jax.configs import load_yaml  # noqa: E402
from mrl_jax.trainer import Run, train  # noqa: E402
from mrl_jax.trainer.checkpoint import RunCheckpointer  # noqa: E402
from mrl_jax.trainer.config import RunConfig  # noqa: E402
from mrl_jax.trainer.metrics import RunLog  # noqa: E402


pytestmark = pytest.mark.usefixtures("jax_compile_cache")


POLICIES = ["llama_bpe", "gpt2_uni"]
SIGNAL = {"faulty": {"seed": 0, "p": {}}}  # digit_reward: rewards vary, so every probe has something to do
PROBE_METRICS = {"none": [], "xgrpo": ["xgrpo/peer_solved_frac"], "prp": ["prp/ess", "prp/rows"],
                 "sgt": ["sgt/rows_fired", "sgt/prompts_failed"]}


def overrides(probe: str, **more) -> dict:
    return dict({"rounds": 2, "checkpoint_every": 1, "policies.0.probes": probe, "policies.1.probes": probe}, **more)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """``runs(probe) -> (out, summary)``: one 2-round run per probe, made once per module."""
    done = {}

    def get(probe):
        if probe not in done:
            out = tmp_path_factory.mktemp(f"run_{probe}")
            summary = train(support.to_run_config(support.tiny_config(**overrides(probe))), out,
                            reward_specs=support.reward_specs(SIGNAL), progress=False)
            done[probe] = (out, summary)
        return done[probe]

    return get


@pytest.fixture(params=["none", "xgrpo", "prp", "sgt"])
def probe_run(request, runs):
    return (request.param,) + runs(request.param)


def test_two_policy_run_completes_for_every_probe(probe_run):
    probe, out, summary = probe_run
    for name in ("metrics.jsonl", "samples.jsonl", "summary.json", "config.json"):
        assert (out / name).is_file(), name
    assert list((out / "tb").iterdir()), "TensorBoard events"
    assert support.checkpoint_rounds(out) == [0, 1]
    records = support.training_records(out)
    assert support.contiguity_problems(records, POLICIES, 2) == []
    for rec in records:
        for key in ["loss", "reward/mean", "skipped", "completion/mean_length", "see/added", "time/update",
                    "data/prompts_rejected", "sampler/row_steps_per_token"] + PROBE_METRICS[probe]:
            assert key in rec, (probe, key)
        assert np.isfinite(rec["loss"]) and rec["skipped"] == 0.0
    samples = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    assert {s["policy"] for s in samples} == set(POLICIES) and {s["round"] for s in samples} == {0, 1}
    written = json.loads((out / "summary.json").read_text())
    assert written == json.loads(json.dumps(summary))
    assert set(written["policies"]) == set(POLICIES)
    assert written["compiles"]["programs"] > 0 and written["compiles"]["seconds"] > 0
    for pol in written["policies"].values():
        assert pol["params"] > 0 and 0.0 <= pol["eval"]["success"] <= 1.0
    # the peer-reading probes really read peers: their view holds the other policy's texts
    if probe in ("prp", "sgt"):
        assert any(rec.get("thl/texts", 0) > 0 for rec in records)


@pytest.mark.parametrize("probe", ["xgrpo", "prp", "sgt"])
def test_probe_changes_the_update_only_when_it_has_something_to_add(probe, runs):
    """Same seeds: round 0's rollouts are those of the independent run; the round-0 update differs from
    independent GRPO exactly when the probe contributed (pooled baseline, peer rows, rescue rows)."""
    out, _ = runs(probe)
    base, _ = runs("none")
    r0 = {r["policy"]: r for r in support.training_records(out) if r["round"] == 0}
    b0 = {r["policy"]: r for r in support.training_records(base) if r["round"] == 0}
    for name in POLICIES:
        assert r0[name]["reward/mean"] == b0[name]["reward/mean"]  # identical rollouts and rewards
    mine, theirs = dict(support.checkpoint_leaves(out, 0)[0]), dict(support.checkpoint_leaves(base, 0)[0])
    for i, name in enumerate(POLICIES):
        keys = [k for k in mine if k.startswith(f"['policies'][{i}]['params']")]
        # "same" up to float reassociation: 1 % of one Adam step (learning rate 1e-3)
        same = all(np.allclose(mine[k], theirs[k], rtol=0.0, atol=1e-5) for k in keys)
        # XGRPO and PRP pool the baseline over both policies' groups; PRP adds peer rows; SGT rescue rows
        contributed = (abs(r0[name]["adv_abs_mean"] - b0[name]["adv_abs_mean"]) > 1e-4
                       or r0[name].get("prp/rows", 0) > 0
                       or r0[name].get("sgt/rows_fired", 0) > 0)
        assert same != contributed, (probe, name, same, contributed)


def test_cli_train_mixed_probes_then_eval_and_refuse_overwrite(tmp_path, capsys):
    """`mrl train` with the tiny config as shipped (xgrpo+sgt on one policy, prp on the other), then `mrl eval`."""
    from mrl_jax.cli import main

    data = support.tiny_config(rounds=2)
    assert [p["probes"] for p in data["policies"]] == ["xgrpo+sgt", "prp"]
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(yaml.safe_dump(data))
    out = tmp_path / "run"
    assert main(["train", "--config", str(cfg), "--out", str(out)]) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["rounds"] == 2 and set(summary["policies"]) == set(POLICIES)
    records = support.training_records(out)
    assert support.contiguity_problems(records, POLICIES, 2) == []
    llama = [r for r in records if r["policy"] == "llama_bpe"]
    gpt2 = [r for r in records if r["policy"] == "gpt2_uni"]
    assert "sgt/rows_fired" in llama[0] and "xgrpo/peer_solved_frac" in llama[0] and "prp/ess" in gpt2[0]
    ev = tmp_path / "eval"
    assert main(["eval", "--config", str(cfg), "--run", str(out), "--out", str(ev)]) == 0
    evaluated = json.loads((ev / "summary.json").read_text())
    assert evaluated["round"] == 1
    for name in POLICIES:
        assert evaluated["eval"][name] == summary["policies"][name]["eval"]
    # the run dir already holds checkpoints: without --resume, a clear refusal
    capsys.readouterr()
    rc = main(["train", "--config", str(cfg), "--out", str(out)])
    err = capsys.readouterr().err
    assert rc == 2 and "--resume" in err and str(out) in err and "Traceback" not in err


def test_config_help_lists_keys(capsys):
    from mrl_jax.cli import main

    assert main(["config-help"]) == 0
    text = capsys.readouterr().out
    for key in ("policies", "rounds", "prompts_per_round", "num_generations", "checkpoint_every", "keep_checkpoints",
                "see.capacity", "task.name", "reward_timeout_s", "max_skipped_updates", "overlong_prompts"):
        assert f"\n{key} (" in "\n" + text, key


def test_config_help_lists_policy_keys(capsys):
    from mrl_jax.cli import main

    main(["config-help"])
    text = capsys.readouterr().out
    for key in ("model.path", "tokenizer.kind", "sampling.max_new_tokens", "grpo.loss_type", "probes",
                "max_prompt_length"):
        assert key in text, key


@pytest.mark.parametrize("path", sorted((REPO / "experiments" / "configs").glob("*.yaml")), ids=lambda p: p.name)
def test_experiment_configs_load(path):
    cfg = load_yaml(RunConfig, path)
    assert len(cfg.policies) == (3 if path.name == "families.yaml" else 2)
    families = {p.model.path or p.model.family for p in cfg.policies}
    assert len(families) == len(cfg.policies)  # heterogeneous
    if path.name in ("independent.yaml", "xgrpo.yaml", "prp.yaml", "sgt.yaml"):
        assert {p.probes.split(":")[0] for p in cfg.policies} == {path.stem.replace("independent", "none")}
    if path.name == "real_checkpoints.yaml":
        assert all(p.model.dtype == "bfloat16" and p.model.path for p in cfg.policies)


def test_experiment_configs_differ_only_in_probes():
    dicts = {}
    for name in ("independent", "xgrpo", "prp", "sgt"):
        d = yaml.safe_load((REPO / "experiments" / "configs" / f"{name}.yaml").read_text())
        for p in d["policies"]:
            p.pop("probes")
        dicts[name] = d
    assert dicts["xgrpo"] == dicts["independent"] == dicts["prp"] == dicts["sgt"]


# --------------------------------------------------------------------------------- loop pieces
def test_round_prompts_are_a_function_of_seed_and_round():
    cfg = support.to_run_config(support.tiny_config())
    a, b = Run(cfg), Run(cfg)
    for r in (0, 5):
        ia, ib = a.round_inputs(r), b.round_inputs(r)
        assert ia.prompts == ib.prompts and np.array_equal(ia.dense_ids, ib.dense_ids)
        assert len(ia.prompts) == cfg.prompts_per_round and ia.index == r
    assert a.round_inputs(0).prompts != a.round_inputs(1).prompts
    import jax

    assert np.array_equal(jax.random.key_data(a.round_inputs(3).key), jax.random.key_data(b.round_inputs(3).key))


def test_run_log_truncates_resumed_rounds_and_torn_lines(tmp_path):
    log = RunLog(tmp_path, tensorboard=False, progress=False)
    for r in range(4):
        log.log_round(r, {"a": {"x": float(r), "bad": float("nan")}, "b": {"x": np.float32(r)}})
        log.log_samples(r, [{"policy": "a", "completion": f"c{r}"}])
    with (tmp_path / "metrics.jsonl").open("a") as f:
        f.write('{"round": 4, "policy": "a", "x"')  # a line torn by a kill mid-write
    log.truncate_after(1)
    records = log.read_metrics()
    assert [(r["round"], r["policy"]) for r in records] == [(0, "a"), (0, "b"), (1, "a"), (1, "b")]
    assert records[0]["bad"] == "nan"  # non-finite values stay valid JSON
    assert [json.loads(line)["round"] for line in (tmp_path / "samples.jsonl").read_text().splitlines()] == [0, 1]
    log.log_round(2, {"a": {"x": 2.0}})
    assert [r["round"] for r in log.read_metrics()] == [0, 0, 1, 1, 2]
    log.close()


def test_checkpointer_keeps_k_and_restores_exactly(tmp_path):
    state = {"w": np.arange(6, dtype=np.float32).reshape(2, 3), "n": np.int32(7), "see": [np.ones(4, np.uint8)]}
    ckpt = RunCheckpointer(tmp_path, keep=2)
    assert ckpt.latest_round() is None
    for r in range(4):
        ckpt.save(r, {**state, "w": state["w"] + r}, {"round": r})
    assert ckpt.all_rounds() == [2, 3] and ckpt.latest_round() == 3
    restored, meta = ckpt.restore(state)
    assert meta == {"round": 3} and np.array_equal(restored["w"], state["w"] + 3)
    assert restored["w"].dtype == np.float32 and int(restored["n"]) == 7
    older, meta2 = ckpt.restore(state, round_index=2)
    assert meta2["round"] == 2 and np.array_equal(older["w"], state["w"] + 2)
    raw, _ = ckpt.read()
    assert np.array_equal(raw["w"], state["w"] + 3)
    ckpt.close()


def test_round_keys_are_named_streams_and_each_policy_samples_with_its_own():
    """The round key's streams by name: policy i's rollout noise is ``RoundKeys.rollout[i]`` (the round's tokens are
    the sampler's with that key), every key of the round is distinct, and the update stream is another one."""
    from contextlib import nullcontext

    import jax

    from mrl_jax import sampler as sampler_lib
    from mrl_jax.trainer.placement import mesh_generate
    from mrl_jax.trainer.round import RoundKeys, _rollouts

    run = Run(support.to_run_config(support.tiny_config()))
    state = run.initial_state(run.warm_params())
    inputs = run.round_inputs(0)
    keys = RoundKeys.of(inputs.key, len(run.policies))
    data = [np.asarray(jax.random.key_data(k)).tobytes() for k in keys.rollout + keys.update]
    assert len(set(data)) == 2 * len(run.policies)
    texts = [p.text for p in inputs.prompts]
    sampled, _, samplers = _rollouts(run.policies, state.policies, texts, keys, nullcontext, 0.0)
    for pol, ps, (ids, mask, out), fig in zip(run.policies, state.policies, sampled, samplers):
        # the round's sampler figures: S = every row on one device, the row-steps of its ladder's moves exactly
        S, lengths = len(texts) * pol.num_generations, np.asarray(out.lengths)
        sizes = sampler_lib.rungs(pol.graphdef, ps.params, S, pol.sampling.max_new_tokens, 1,
                                  pol.spec.sampling.ladder, ragged=sampler_lib.ragged(pol.sampling.eos_ids, S, S))
        assert fig["sampler/slots"] == S, fig
        assert fig["sampler/row_steps_per_token"] * lengths.sum() == pytest.approx(
            sampler_lib.ladder_row_steps(lengths, sizes)), (fig, sizes)
        same = mesh_generate(pol, ps.params, ids, mask, keys.rollout[pol.index], pol.sampling,
                             num_samples=pol.num_generations)
        other = mesh_generate(pol, ps.params, ids, mask, keys.update[pol.index], pol.sampling,
                              num_samples=pol.num_generations)
        np.testing.assert_array_equal(np.asarray(out.tokens), np.asarray(same.tokens))
        assert not np.array_equal(np.asarray(out.tokens), np.asarray(other.tokens))
