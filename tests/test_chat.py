"""Chat templates and stop sets with the real Phi-3 / SmolLM2 / Mistral tokenizer folders (../shared/tokenizers)."""

import json
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mrl_jax import models
from mrl_jax.tokenization.chat import ChatTemplateError, PromptFormat, read_chat_template, stop_ids
from mrl_jax.configs import ConfigError, from_dict
from mrl_jax.sampler import SamplingConfig, generate
from mrl_jax.tokenization import load_tokenizer
from mrl_jax.trainer.config import PolicySpec, RunConfig
from mrl_jax.trainer.encoding import decode_completions, encode_prompts
from mrl_jax.trainer.policy import build_prompt_format, build_stop_ids
from support import one_device_policy

PROMPTS = ["What is 2+3?", "Reverse 'abc'.\nAnswer only."]


def _hf_chat_ids(folder, messages):
    from transformers import PreTrainedTokenizerFast

    conf = json.loads((folder / "tokenizer_config.json").read_text())
    tok = PreTrainedTokenizerFast(tokenizer_file=str(folder / "tokenizer.json"), chat_template=conf["chat_template"],
                                  bos_token=conf["bos_token"], eos_token=conf["eos_token"])
    out = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    return list(out["input_ids"] if isinstance(out, dict) or hasattr(out, "keys") else out)


@pytest.mark.parametrize("name", ["phi-3-mini", "smollm2-135m"])
@pytest.mark.parametrize("system", [None, "You are terse."])
def test_chat_ids_equal_transformers_apply_chat_template(shared_tokenizers_dir, name, system):
    folder = shared_tokenizers_dir / name
    tok = load_tokenizer(folder)
    fmt = PromptFormat.chat_from(folder, system_prompt=system)
    got = fmt.encode(tok, PROMPTS)
    for text, ids in zip(PROMPTS, got):
        msgs = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": text}]
        assert ids == _hf_chat_ids(folder, msgs)
    # the turn markers are control tokens, and the generation prompt ends the prompt
    if name == "phi-3-mini":
        assert got[0][0] == tok.token_to_id("<|system|>" if system else "<|user|>")
        assert got[0][-1] == tok.token_to_id("<|assistant|>")
    else:
        assert got[0][0] == tok.token_to_id("<|im_start|>")
        assert got[0][-4] == tok.token_to_id("<|im_start|>") and tok.decode(got[0][-3:]) == "assistant\n"
    if name == "phi-3-mini":  # no BOS: the template does not write one (apply_chat_template adds none)
        assert tok.bos_id == 1 and 1 not in got[0]


def test_encode_prompts_chat_left_pads_without_bos(shared_tokenizers_dir):
    folder = shared_tokenizers_dir / "phi-3-mini"
    tok = load_tokenizer(folder)
    fmt = PromptFormat.chat_from(folder)
    ids, mask, _ = encode_prompts(tok, fmt, PROMPTS)
    for row, m, want in zip(ids, mask, fmt.encode(tok, PROMPTS)):
        assert list(row[m]) == want and not m[: len(row) - len(want)].any()
        assert tok.bos_id not in want  # Phi-3's template writes no <s>; a template string would get one
    t_ids, t_mask, _ = encode_prompts(tok, "{prompt}", PROMPTS[:1])
    assert list(t_ids[0][t_mask[0]]) == [tok.bos_id] + tok.encode(PROMPTS[0])


def test_folder_without_chat_template_is_a_one_line_error(shared_tokenizers_dir, tmp_path):
    folder = shared_tokenizers_dir / "mistral-7b-v0.1"
    with pytest.raises(ChatTemplateError) as e:
        read_chat_template(folder)
    msg = str(e.value)
    assert "tokenizer_config.json" in msg and "'chat_template'" in msg and "\n" not in msg
    spec = from_dict(PolicySpec, {"name": "m", "prompt_format": "chat", "tokenizer": {"path": str(folder)}})
    with pytest.raises(ConfigError, match=r"policies\.m\.prompt_format.*tokenizer_config\.json.*chat_template"):
        build_prompt_format(spec, load_tokenizer(folder))
    # a chat_template.jinja next to the tokenizer is used when the config has none
    shutil.copytree(folder, tmp_path / "m")
    (tmp_path / "m" / "chat_template.jinja").write_text("{% for m in messages %}[{{ m['content'] }}]{% endfor %}"
                                                        "{% if add_generation_prompt %}=>{% endif %}")
    assert PromptFormat.chat_from(tmp_path / "m").render(["hi"]) == ["[hi]=>"]


def test_system_prompt_needs_chat_format():
    with pytest.raises(ConfigError, match="system_prompt"):
        from_dict(PolicySpec, {"name": "a", "system_prompt": "hi"})
    spec = from_dict(PolicySpec, {"name": "a", "prompt_format": "chat", "prompt_template": "no placeholder",
                                  "stop_tokens": ["<|end|>", 7]})
    assert spec.stop_tokens == ["<|end|>", 7]


def test_stop_sets_are_what_the_files_say(shared_tokenizers_dir, tmp_path):
    smol = load_tokenizer(shared_tokenizers_dir / "smollm2-135m")
    # tokenizer_config eos = <|im_end|> (2), generation_config eos_token_id = 2
    assert stop_ids(smol, shared_tokenizers_dir / "smollm2-135m") == (2,)
    assert stop_ids(smol, shared_tokenizers_dir / "smollm2-135m", ["<|endoftext|>"]) == (2, 0)
    phi_dir = shared_tokenizers_dir / "phi-3-mini"
    phi = load_tokenizer(phi_dir)
    assert stop_ids(phi, phi_dir) == (32000,)  # <|endoftext|>; the fixture ships no generation_config.json
    assert stop_ids(phi, phi_dir, ["<|end|>"]) == (32000, 32007)
    # with Phi-3-mini-instruct's generation_config.json: eos_token_id is a list
    shutil.copytree(phi_dir, tmp_path / "phi")
    (tmp_path / "phi" / "generation_config.json").write_text(json.dumps({"eos_token_id": [32000, 32001, 32007]}))
    phi2 = load_tokenizer(tmp_path / "phi")
    assert stop_ids(phi2, tmp_path / "phi") == (32000, 32001, 32007)
    with pytest.raises(ValueError, match="stop token '<\\|nope\\|>'"):
        stop_ids(phi, phi_dir, ["<|nope|>"])
    spec = from_dict(PolicySpec, {"name": "p", "tokenizer": {"path": str(tmp_path / "phi")}, "stop_tokens": [5]})
    assert build_stop_ids(spec, phi2) == (32000, 32001, 32007, 5)
    bad = from_dict(PolicySpec, {"name": "p", "tokenizer": {"path": str(phi_dir)}, "stop_tokens": ["<|nope|>"]})
    with pytest.raises(ConfigError, match=r"policies\.p\.stop_tokens"):
        build_stop_ids(bad, phi)


def _stop_model(vocab: int, token: int):
    """Untied tiny llama whose greedy choice is always ``token``: blocks add nothing (zero output projections),
    every embedding row is ones, and only the lm_head column of ``token`` is non-zero."""
    model = models.tiny_model("llama", vocab, hidden_size=16, num_heads=2, num_kv_heads=1, num_layers=1,
                              intermediate_size=16, tie_word_embeddings=False)
    for layer in model.layers:
        layer.self_attn.o_proj.kernel[...] = jnp.zeros_like(layer.self_attn.o_proj.kernel[...])
        layer.mlp.down_proj.kernel[...] = jnp.zeros_like(layer.mlp.down_proj.kernel[...])
    model.embed_tokens.embedding[...] = jnp.ones_like(model.embed_tokens.embedding[...])
    k = np.zeros(model.lm_head.kernel.shape, np.float32)
    k[:, token] = 10.0
    model.lm_head.kernel[...] = jnp.asarray(k)
    return model


def test_sampler_stops_on_the_second_stop_id_and_decoding_strips_it(shared_tokenizers_dir, tmp_path):
    shutil.copytree(shared_tokenizers_dir / "phi-3-mini", tmp_path / "phi")
    (tmp_path / "phi" / "generation_config.json").write_text(json.dumps({"eos_token_id": [32000, 32001, 32007]}))
    tok = load_tokenizer(tmp_path / "phi")
    cfg = from_dict(RunConfig, {"policies": [{"name": "phi", "tokenizer": {"path": str(tmp_path / "phi")},
                                              "prompt_format": "chat", "sampling": {"max_new_tokens": 5}}],
                                "num_generations": 2, "prompts_per_round": 2, "rounds": 1})
    stop = 32001  # the second id of the stop set
    model = _stop_model(tok.vocab_size, stop)
    pol, params = one_device_policy(cfg, tok, model)
    st = pol.init_state(params)
    assert pol.sampling.eos_ids == (32000, 32001, 32007) and pol.prompt_format.is_chat
    ids, mask, _ = encode_prompts(tok, pol.prompt_format, PROMPTS)
    greedy = SamplingConfig(**{**pol.sampling.__dict__, "greedy": True})
    out = jax.device_get(generate(pol.graphdef, st.params, jnp.asarray(ids), jnp.asarray(mask), jax.random.key(0),
                                  greedy))
    assert (out.tokens[:, 0] == stop).all() and out.mask[:, 0].all() and not out.mask[:, 1:].any()
    assert (np.asarray(out.lengths) == 1).all() and not np.asarray(out.truncated).any()
    texts, content = decode_completions(tok, out.tokens, out.mask, pol.sampling.eos_ids)
    assert texts == ["", ""] and content == [[], []]
    # without 32001 in the stop set the same model never stops: the row runs to max_new_tokens
    no_stop = SamplingConfig(**{**greedy.__dict__, "eos_id": (32000, 32007)})
    out2 = jax.device_get(generate(pol.graphdef, st.params, jnp.asarray(ids), jnp.asarray(mask), jax.random.key(0),
                                   no_stop))
    assert (out2.tokens == stop).all() and out2.mask.all() and np.asarray(out2.truncated).all()


def test_decode_strips_only_a_final_stop_token(shared_tokenizers_dir):
    tok = load_tokenizer(shared_tokenizers_dir / "phi-3-mini")
    a, b = tok.encode("ab", continuation=True), tok.encode("cd", continuation=True)
    end, eot = tok.token_to_id("<|end|>"), tok.token_to_id("<|endoftext|>")
    rows = [a + [end], b + [eot], a + [end] + b]
    N = max(map(len, rows)) + 1
    tokens = np.zeros((3, N), np.int32)
    mask = np.zeros((3, N), bool)
    for r, s in enumerate(rows):
        tokens[r, :len(s)], mask[r, :len(s)] = s, True
    texts, content = decode_completions(tok, tokens, mask, (eot, end))
    assert content == [a, b, a + [end] + b] and texts[:2] == ["ab", "cd"]
    _, content_default = decode_completions(tok, tokens, mask)  # default stop set: the tokenizer's EOS only
    assert content_default[0] == a + [end] and content_default[1] == b


def test_chat_policy_trains_exports_and_evaluates_with_its_template(shared_tokenizers_dir, tmp_path):
    """A SmolLM2-tokenizer policy prompted through its chat template: a round runs, the export carries the
    template and the stop set, and the exported directory evaluates like the run's checkpoint."""
    from transformers import PreTrainedTokenizerFast

    from mrl_jax.export import evaluate_exported, export_policy
    from mrl_jax.trainer import train
    from mrl_jax.trainer.loop import evaluate_from_yaml

    folder = shared_tokenizers_dir / "smollm2-135m"
    cfg = from_dict(RunConfig, {
        "policies": [{"name": "smol", "tokenizer": {"path": str(folder)}, "prompt_format": "chat",
                      "system_prompt": "Add the numbers.", "stop_tokens": ["<|endoftext|>"],
                      "model": {"family": "llama", "hidden_size": 16, "num_layers": 1, "num_heads": 2,
                                "num_kv_heads": 1}, "sampling": {"max_new_tokens": 4}}],
        "task": {"name": "arith"}, "rounds": 1, "prompts_per_round": 2, "num_generations": 2,
        "checkpoint_every": 1, "eval_prompts": 4, "see": {"capacity": 64, "max_text_bytes": 0}})
    run = tmp_path / "run"
    train(cfg, run, progress=False)
    samples = [json.loads(line) for line in (run / "samples.jsonl").read_text().splitlines()]
    assert samples and all(isinstance(s["completion"], str) and "<|im_end|>" not in s["completion"] for s in samples)
    out = tmp_path / "export"
    export_policy(run, "smol", out)
    conf = json.loads((out / "tokenizer_config.json").read_text())
    assert conf["chat_template"] == json.loads((folder / "tokenizer_config.json").read_text())["chat_template"]
    assert json.loads((out / "generation_config.json").read_text())["eos_token_id"] == [2, 0]
    hf = PreTrainedTokenizerFast.from_pretrained(out)
    msgs = [{"role": "system", "content": "Add the numbers."}, {"role": "user", "content": "12+34="}]
    hf_ids = hf.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
    hf_ids = list(hf_ids["input_ids"] if hasattr(hf_ids, "keys") else hf_ids)
    assert PromptFormat.chat_from(out, "Add the numbers.").encode(load_tokenizer(out), ["12+34="])[0] == hf_ids
    got = evaluate_exported(run / "config.json", out, "smol")["eval"]["smol"]
    assert got == evaluate_from_yaml(run / "config.json", run)["eval"]["smol"]


def test_chat_policies_stop_at_their_turn_end_token(shared_tokenizers_dir):
    """<|end|> ends a Phi-3 chat turn even without generation_config.json; a template policy keeps the EOS."""
    phi_dir = shared_tokenizers_dir / "phi-3-mini"
    phi = load_tokenizer(phi_dir)
    assert stop_ids(phi, phi_dir, chat=True) == (32000, 32007)
    chat = from_dict(PolicySpec, {"name": "p", "prompt_format": "chat", "tokenizer": {"path": str(phi_dir)}})
    assert build_stop_ids(chat, phi) == (32000, 32007)
    plain = from_dict(PolicySpec, {"name": "p", "tokenizer": {"path": str(phi_dir)}})
    assert build_stop_ids(plain, phi) == (32000,)


def test_chat_template_kwargs_reach_the_template(shared_tokenizers_dir, tmp_path):
    shutil.copytree(shared_tokenizers_dir / "smollm2-135m", tmp_path / "q")
    conf = json.loads((tmp_path / "q" / "tokenizer_config.json").read_text())
    conf["chat_template"] = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
                             "{% endfor %}<|im_start|>assistant\n"
                             "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n{% endif %}")
    (tmp_path / "q" / "tokenizer_config.json").write_text(json.dumps(conf))
    tok = load_tokenizer(tmp_path / "q")
    spec = from_dict(PolicySpec, {"name": "q", "prompt_format": "chat", "tokenizer": {"path": str(tmp_path / "q")},
                                  "chat_template_kwargs": {"enable_thinking": False}})
    assert build_prompt_format(spec, tok).render(["hi"]) == [
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"]
    think = from_dict(PolicySpec, {"name": "q", "prompt_format": "chat", "tokenizer": {"path": str(tmp_path / "q")}})
    assert build_prompt_format(think, tok).render(["hi"])[0].endswith("assistant\n")
    with pytest.raises(ConfigError, match="chat_template_kwargs"):
        from_dict(PolicySpec, {"name": "q", "chat_template_kwargs": {"enable_thinking": False}})
