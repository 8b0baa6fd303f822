"""One GRPO optimizer step, TRL's ``GRPOTrainer`` vs ours, same work, same run, on CPU.

Both sides get the SAME tiny Qwen2 weights (a ``transformers.Qwen2ForCausalLM`` built with a fixed seed and
saved to a temp dir; ours loads it with ``mrl_jax.models.from_pretrained``), the SAME tokenizer (a byte-level
BPE trained with ``mrl_jax.tokenization.train_tokenizer("byte_bpe", corpus, 512)`` and wrapped in a
``transformers.PreTrainedTokenizerFast`` for TRL; both sides tokenize prompts through that wrapper, so the
prompt ids are identical), the SAME prompts and reward function, and the same GRPO options:

    P = 8 prompts x G = 8 generations = 64 completions per optimizer step, max 32 new tokens (EOS stops a row)
    ("small"; and "realistic": prompts of ~128 tokens, max 128 new tokens, same P and G),
    temperature 1, no top-k / top-p, beta 0 (no reference model), epsilon 0.2, loss_type "grpo",
    scale_rewards "group", num_iterations 1, AdamW lr 1e-6, grad-norm clip 1.0, float32 everywhere.

One step = rollout (sampling) + decode + reward + update (log-prob forward, backward, AdamW).

- TRL: ``GRPOTrainer`` (no vLLM, ``use_cpu=True``, ``bf16=False``, ``report_to="none"``, no eval, no
  saving, no logging, no gradient checkpointing (TRL's default is on), ``per_device_train_batch_size=64``,
  ``generation_batch_size=64`` -> one generation per optimizer step, ``gradient_accumulation_steps=1``).
  Step time = interval between consecutive ``on_step_end`` callbacks (so data loading, generation, reward,
  loss and optimizer are all inside).
- ours: ``mrl_jax.sampler.generate`` (jitted, KV cache) -> host decode + reward -> ``rows.own_rows`` ->
  ``learner.make_update_step`` (one jitted update, probe "none", one policy), timed per step with
  ``block_until_ready`` on the new params (wall clock of the whole Python step).

Warm-up steps (TRL: first steps; ours: XLA compilation) are excluded; reported: median and mean seconds per
step over the timed steps, and ``speedup = trl_s_per_step / ours_s_per_step`` (medians; ``speedup_min`` = best
step vs best step, the figure least affected by other jobs on a shared machine). Goals: >= 2x (small), >= 3x
(realistic, under ``realistic``). Ours is also
split into ``ours_phases_s`` (tokenize + rollout, decode + reward + batch, update; medians).

    python benchmarks/bench_trl.py [--quick] [--out FILE]

``run(quick) -> dict`` is what ``mrl bench`` calls.
"""
from __future__ import annotations

import contextlib
import os
import sys
import tempfile
import time

import numpy as np

# P prompts x G generations, max new tokens, prompt length (words for "small"; tokens, cut on a word, for
# "realistic"); the two shapes
SHAPES = {"small": dict(P=8, G=8, new_tokens=32, prompt_tokens=None),
          "realistic": dict(P=8, G=8, new_tokens=128, prompt_tokens=128)}
LR = 1e-6
TARGET = "a"

# tiny Qwen2 (~0.6M params at vocab 512): the regime of the embedded demo's policies
MODEL = dict(vocab_size=512, hidden_size=128, intermediate_size=384, num_hidden_layers=4,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
             tie_word_embeddings=True, rope_theta=10000.0)
PLAN = {True: dict(warmup=2, steps=3), False: dict(warmup=3, steps=10)}

WORDS = ("apple banana cat dog alpha beta gamma delta river stone paper mountain cloud garden rabbit "
         "ocean lantern violet amber silver copper market planet rocket sandal cactus papaya").split()


def _corpus() -> list[str]:
    rng = np.random.default_rng(0)
    return [" ".join(rng.choice(WORDS, size=12)) + f" {i} {i * 7 % 101}." for i in range(400)]


def _prompts(n: int = 64, tokens: int | None = None, hf_tok=None) -> list[str]:
    """n prompts; ``tokens``: each grown word by word to the longest that stays within that many tokens."""
    rng = np.random.default_rng(1)
    out = []
    for _ in range(n):
        text = f"Say words with many a: {' '.join(rng.choice(WORDS, size=3))}"
        while tokens is not None:
            longer = text + " " + str(rng.choice(WORDS))
            if len(hf_tok(text=longer)["input_ids"]) > tokens:
                break
            text = longer
        out.append(text)
    return out


def reward_fraction(completions: list[str]) -> list[float]:
    """Fraction of characters of the completion that are TARGET (0 for an empty completion)."""
    return [c.count(TARGET) / len(c) if c else 0.0 for c in completions]


def _trl_reward(prompts, completions, **kwargs):
    return reward_fraction([c if isinstance(c, str) else c[-1]["content"] for c in completions])


def _build_assets(root: str):
    """Tokenizer (HF dir) + tiny Qwen2 checkpoint, both under ``root``; returns (hf_tokenizer, model_dir)."""
    import torch
    import transformers
    from mrl_jax.tokenization import train_tokenizer

    tok = train_tokenizer("byte_bpe", _corpus(), MODEL["vocab_size"], cache_dir=os.path.join(root, "tokcache"))
    hf_tok = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok.hf, pad_token="<pad>", bos_token="<bos>", eos_token="<eos>")
    hf_tok.padding_side = "left"
    model_dir = os.path.join(root, "qwen2-tiny")
    torch.manual_seed(0)
    cfg = transformers.Qwen2Config(**MODEL, bos_token_id=tok.bos_id, eos_token_id=tok.eos_id,
                                   pad_token_id=tok.pad_id)
    model = transformers.Qwen2ForCausalLM(cfg).float()
    model.save_pretrained(model_dir)
    hf_tok.save_pretrained(model_dir)
    n_params = sum(p.numel() for p in model.parameters())
    return hf_tok, model_dir, n_params


# ----------------------------------------------------------------------------------------------- TRL

def _run_trl(hf_tok, model_dir: str, root: str, warmup: int, steps: int, shape: dict, prompts) -> dict:
    import torch
    import transformers
    import trl
    from datasets import Dataset
    from transformers import TrainerCallback

    stamps: list[float] = []
    lengths: list[float] = []

    class _Timer(TrainerCallback):
        def on_train_begin(self, args, state, control, **kw):
            stamps.append(time.perf_counter())

        def on_step_end(self, args, state, control, **kw):
            stamps.append(time.perf_counter())

    def reward(prompts, completions, completion_ids=None, **kw):
        if completion_ids is not None:
            lengths.append(float(np.mean([len(c) for c in completion_ids])))
        return _trl_reward(prompts, completions)

    model = transformers.Qwen2ForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    P, G, NEW_TOKENS = shape["P"], shape["G"], shape["new_tokens"]
    ds = Dataset.from_dict({"prompt": prompts})
    cfg = trl.GRPOConfig(
        output_dir=os.path.join(root, "trl_out"), use_cpu=True, bf16=False, fp16=False, report_to="none",
        logging_strategy="no", save_strategy="no", eval_strategy="no", disable_tqdm=True,
        per_device_train_batch_size=P * G, generation_batch_size=P * G, gradient_accumulation_steps=1,
        num_generations=G, max_completion_length=NEW_TOKENS, temperature=1.0, top_p=1.0, top_k=0,
        beta=0.0, epsilon=0.2, loss_type="grpo", scale_rewards="group", num_iterations=1,
        learning_rate=LR, lr_scheduler_type="constant", weight_decay=0.0, max_grad_norm=1.0,
        max_steps=warmup + steps, seed=0, use_vllm=False, log_completions=False, dataloader_num_workers=0,
        gradient_checkpointing=False,  # TRL's default is True: extra recompute that ours does not do
    )
    trainer = trl.GRPOTrainer(model=model, reward_funcs=reward, args=cfg, train_dataset=ds,
                              processing_class=hf_tok, callbacks=[_Timer()])
    with contextlib.redirect_stdout(sys.stderr):  # TRL prints its train summary: keep stdout for our JSON
        trainer.train()
    per_step = np.diff(stamps)  # [0] = train start -> end of step 1
    timed = per_step[warmup:]
    return dict(trl_version=trl.__version__, trl_step_times=[round(float(t), 4) for t in per_step],
                trl_s_per_step=float(np.median(timed)), trl_s_per_step_mean=float(np.mean(timed)),
                trl_s_per_step_min=float(np.min(timed)),
                trl_mean_completion_tokens=float(np.mean(lengths)) if lengths else None)


# ----------------------------------------------------------------------------------------------- ours

def _run_ours(hf_tok, model_dir: str, warmup: int, steps: int, shape: dict, prompts) -> dict:
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from mrl_jax import learner, see
    from mrl_jax import sampler as rollout
    from mrl_jax.rows import own_rows
    from mrl_jax.models import from_pretrained

    P, G, NEW_TOKENS = shape["P"], shape["G"], shape["new_tokens"]
    model = from_pretrained(model_dir)
    graphdef, params = nnx.split(model)
    del model
    eos, pad = hf_tok.eos_token_id, hf_tok.pad_token_id
    scfg = rollout.SamplingConfig(max_new_tokens=NEW_TOKENS, temperature=1.0, eos_id=eos, pad_id=pad)
    gcfg = learner.GRPOConfig(num_generations=G, max_completion_length=NEW_TOKENS, epsilon=0.2, beta=0.0,
                              loss_type="grpo", scale_rewards="group", num_iterations=1, temperature=1.0)
    optimizer = learner.make_optimizer(LR, weight_decay=0.0, max_grad_norm=1.0)
    opt_state = optimizer.init(params)
    update = learner.make_update_step(graphdef, optimizer, "none", gcfg)
    view = see.empty_view(P, 1, NEW_TOKENS, 1, 1)
    all_ids = hf_tok(text=prompts)["input_ids"]
    tp = rollout.bucket_length(max(len(x) for x in all_ids))  # one prompt shape for every step
    key = jax.random.PRNGKey(0)
    times, lengths, phases = [], [], []

    for step in range(warmup + steps):
        t0 = time.perf_counter()
        sl = [(step * P + i) % len(prompts) for i in range(P)]
        ids = hf_tok(text=[prompts[i] for i in sl])["input_ids"]  # host tokenization, as TRL does
        p_ids, p_mask = rollout.left_pad(ids, pad, length=tp)
        key, k_gen, k_upd = jax.random.split(key, 3)
        roll = rollout.generate(graphdef, params, jnp.asarray(p_ids), jnp.asarray(p_mask), k_gen, scfg,
                                num_samples=G)  # each prompt prefilled once for its G samples
        tokens, mask = np.asarray(roll.tokens), np.asarray(roll.mask)
        t1 = time.perf_counter()
        texts = hf_tok.batch_decode([t[m].tolist() for t, m in zip(tokens, mask)], skip_special_tokens=True)
        rewards = np.asarray(reward_fraction(texts), np.float32)
        logp = np.asarray(roll.logprobs)   # the own rows built on the host, as the trainer builds them
        batch = own_rows(
            prompt_ids=np.asarray(p_ids), prompt_mask=np.asarray(p_mask), completion_ids=tokens,
            completion_mask=mask.astype(np.float32), old_logp=logp, ref_logp=np.zeros_like(logp), rewards=rewards,
            truncated=np.asarray(roll.truncated))
        t2 = time.perf_counter()
        params, opt_state, metrics = update(params, opt_state, batch, view, k_upd)
        jax.block_until_ready((params, metrics["loss"]))
        t3 = time.perf_counter()
        times.append(t3 - t0)
        phases.append((t1 - t0, t2 - t1, t3 - t2))
        lengths.append(float(mask.sum(1).mean()))
    timed = times[warmup:]
    ph = np.median(np.asarray(phases[warmup:]), axis=0)
    return dict(ours_phases_s=dict(tokenize_rollout=round(float(ph[0]), 4),
                                   decode_reward_batch=round(float(ph[1]), 4), update=round(float(ph[2]), 4)),
                ours_s_per_step_min=float(np.min(timed)), ours_step_times=[round(t, 4) for t in times],
                ours_s_per_step=float(np.median(timed)),
                ours_s_per_step_mean=float(np.mean(timed)), ours_first_step_s=times[0],
                ours_mean_completion_tokens=float(np.mean(lengths)),
                ours_last_loss=float(metrics["loss"]), ours_skipped=float(metrics["skipped"]))


def _compare(hf_tok, model_dir: str, root: str, plan: dict, name: str, shape: dict) -> dict:
    """Ours then TRL on one shape; figures, loads and the speedups."""
    from mrl_jax.bench.load import section

    prompts = _prompts(64, shape["prompt_tokens"], hf_tok)
    out = dict(shape=dict(shape, mean_prompt_tokens=float(np.mean([len(x) for x in hf_tok(text=prompts)["input_ids"]]))))
    with section(f"ours_{name}") as out["load_ours"]:
        out.update(_run_ours(hf_tok, model_dir, plan["warmup"], plan["steps"], shape, prompts))
    try:
        import trl
    except ImportError as e:
        return dict(out, trl_s_per_step=None, speedup=None, trl_version=None,
                    trl_error=f"TRL is not installed ({e}); `pip install -e .[bench]`")
    try:
        with section(f"trl_{name}") as out["load_trl"]:
            out.update(_run_trl(hf_tok, model_dir, root, plan["warmup"], plan["steps"], shape, prompts))
    except Exception as e:  # record the precise reason, never fake a number
        return dict(out, trl_s_per_step=None, speedup=None, trl_version=trl.__version__,
                    trl_error=f"{type(e).__name__}: {e}")
    out["contended"] = bool(out["load_ours"]["contended"] or out["load_trl"]["contended"])
    out["speedup"] = out["trl_s_per_step"] / out["ours_s_per_step"]
    out["speedup_min"] = out["trl_s_per_step_min"] / out["ours_s_per_step_min"]  # best step vs best step
    return out


def run(quick: bool = False) -> dict:
    """Both shapes (``SHAPES``): the small one's figures at the top level (as before), the realistic one
    under ``realistic``. Goals: >= 2x TRL on the small shape, >= 3x on the realistic one."""
    import jax
    import torch
    import transformers

    plan = PLAN[bool(quick)]
    out = dict(setup=dict(loss_type="grpo", beta=0.0, epsilon=0.2, num_iterations=1, temperature=1.0, lr=LR,
                          model=MODEL, **plan),
               versions=dict(jax=jax.__version__, torch=torch.__version__, transformers=transformers.__version__),
               torch_threads=torch.get_num_threads(), cpu_count=os.cpu_count())
    with tempfile.TemporaryDirectory(prefix="bench_trl_") as root:
        hf_tok, model_dir, n_params = _build_assets(root)
        out["setup"]["n_params"] = int(n_params)
        out.update(_compare(hf_tok, model_dir, root, plan, "small", SHAPES["small"]))
        out["goal_speedup"] = 2.0
        out["meets_goal"] = bool((out.get("speedup") or 0.0) >= 2.0)
        real = _compare(hf_tok, model_dir, root, plan, "realistic", SHAPES["realistic"])
        out["realistic"] = dict(real, goal_speedup=3.0, meets_goal=bool((real.get("speedup") or 0.0) >= 3.0))
    out["contended"] = bool(out.get("contended", True) or out["realistic"].get("contended", True))
    return out


def main(argv=None) -> int:
    from mrl_jax.bench import script_main

    return script_main(run, __doc__.splitlines()[0], argv)


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    main()
